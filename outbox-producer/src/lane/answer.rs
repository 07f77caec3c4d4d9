//! A destination's answer as JSON that PostgreSQL will store. A batch whose record fails is
//! rolled back and its calls are made again on every batch, so an answer the database
//! refuses must never reach it: JSONB refuses U+0000 in any string (22P05), values over
//! 255 MiB, and nesting deeper than the server's `max_stack_depth` parses (about 20,000
//! levels at the default 2 MB, far fewer where a managed service lowers it).

use serde_json::{Value, json};

/// Deepest nesting stored as it is: the deepest serde_json reads back (`outcome()`), and far
/// below what the smallest `max_stack_depth` parses.
pub(crate) const MAX_DEPTH: usize = 127;

/// How much of an omitted answer's JSON text the marker keeps.
const START_BYTES: usize = 1024;

/// `answer` as JSON text to store: every U+0000 made U+FFFD, and an answer nested deeper than
/// [`MAX_DEPTH`] or longer than `max_bytes` once written replaced by
/// `{"outbox_answer_omitted": {"reason": ..., "bytes": n, "start": "<its first KiB>"}}`, so
/// that the action is still recorded (done, or rejected) and never called again for it.
pub(crate) fn storable(mut answer: Value, max_bytes: usize) -> String {
    if deeper_than(&answer, MAX_DEPTH) {
        // Neither written nor scrubbed, and taken apart without recursion: writing, scrubbing
        // and dropping a `Value` all recurse, and this one may be deep enough to overflow
        // the stack.
        dismantle(answer);
        return omitted(format!("nested deeper than {MAX_DEPTH} levels"), None, "");
    }
    scrub(&mut answer);
    let text = answer.to_string();
    if text.len() <= max_bytes {
        return text;
    }
    omitted(
        format!("larger than max_answer_bytes ({max_bytes} bytes)"),
        Some(text.len()),
        &text,
    )
}

fn omitted(reason: String, bytes: Option<usize>, text: &str) -> String {
    let mut end = START_BYTES.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    json!({
        "outbox_answer_omitted": { "reason": reason, "bytes": bytes, "start": &text[..end] }
    })
    .to_string()
}

/// Whether `value` nests deeper than `limit` arrays and objects, without recursing.
fn deeper_than(value: &Value, limit: usize) -> bool {
    let mut stack = vec![(value, 0_usize)];
    while let Some((value, depth)) = stack.pop() {
        match value {
            Value::Array(_) | Value::Object(_) if depth == limit => return true,
            Value::Array(items) => stack.extend(items.iter().map(|child| (child, depth + 1))),
            Value::Object(map) => stack.extend(map.values().map(|child| (child, depth + 1))),
            _ => {}
        }
    }
    false
}

/// Drops `value` one level at a time.
fn dismantle(value: Value) {
    let mut stack = vec![value];
    while let Some(value) = stack.pop() {
        match value {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
            _ => {}
        }
    }
}

fn scrub(value: &mut Value) {
    match value {
        Value::String(s) if s.contains('\0') => *s = s.replace('\0', "\u{fffd}"),
        Value::Array(items) => items.iter_mut().for_each(scrub),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains('\0')) {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(k, v)| (k.replace('\0', "\u{fffd}"), v))
                    .collect();
            }
            map.values_mut().for_each(scrub);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize) -> Value {
        (0..levels).fold(json!(1), |inner, _| Value::Array(vec![inner]))
    }

    #[test]
    fn answers_never_hold_what_postgres_refuses() {
        let answer = json!({ "a\u{0}b": ["x\u{0}", { "k": "\u{0}" }], "n": 1 });
        let stored = storable(answer, usize::MAX);
        assert!(!stored.contains("\\u0000"), "{stored}");
        assert_eq!(
            serde_json::from_str::<Value>(&stored).expect("json")["a\u{fffd}b"][0],
            "x\u{fffd}"
        );
    }

    #[test]
    fn an_answer_too_deep_to_drop_recursively_is_taken_apart() {
        // Deep enough to overflow a 2 MiB stack if written or dropped recursively.
        let deep = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(|| {
                let deep = (0..200_000).fold(json!(1), |inner, _| Value::Array(vec![inner]));
                storable(deep, usize::MAX)
            })
            .expect("thread")
            .join()
            .expect("no stack overflow");
        assert!(deep.contains("nested deeper than 127"), "{deep}");
    }

    #[test]
    fn every_answer_stored_reads_back() {
        let deepest = storable(nested(MAX_DEPTH), usize::MAX);
        assert!(serde_json::from_str::<Value>(&deepest).is_ok(), "{deepest}");
        let deeper = storable(nested(MAX_DEPTH + 1), usize::MAX);
        assert!(deeper.contains("outbox_answer_omitted"), "{deeper}");
        // What serde_json refuses one level deeper: the limit is exactly its own.
        assert!(serde_json::from_str::<Value>(&nested(MAX_DEPTH + 1).to_string()).is_err());
    }

    #[test]
    fn depth_is_counted_in_arrays_and_objects() {
        assert!(!deeper_than(&nested(MAX_DEPTH), MAX_DEPTH));
        assert!(deeper_than(&nested(MAX_DEPTH + 1), MAX_DEPTH));
        assert!(!deeper_than(&json!({ "a": { "b": 1 } }), 2));
        assert!(deeper_than(&json!({ "a": { "b": [] } }), 2));
        assert!(!deeper_than(&json!("flat"), 0));
    }

    #[test]
    fn a_marker_starts_with_the_answer_cut_on_a_character() {
        // `{"s":"` is 6 bytes and each `€` 3: byte 1024 falls inside one.
        let answer = json!({ "s": "€".repeat(2000) });
        let stored: Value = serde_json::from_str(&storable(answer.clone(), 100)).expect("json");
        let marker = &stored["outbox_answer_omitted"];
        assert_eq!(marker["bytes"], answer.to_string().len());
        let start = marker["start"].as_str().expect("start");
        assert!(start.len() <= START_BYTES && answer.to_string().starts_with(start));
        assert_eq!(storable(answer.clone(), 1 << 20), answer.to_string());
    }
}
