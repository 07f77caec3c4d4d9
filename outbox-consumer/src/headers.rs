//! A record's headers, read whatever their bytes.
//!
//! rdkafka 0.39 reads a header's name with `CStr::to_str().unwrap()` (`Headers::get`,
//! `try_get`, `iter`): a name that is not UTF-8, which Go and C producers can send, panics,
//! and neither the name nor the value can be read through it. And librdkafka hands names out
//! as C strings: a name with a NUL inside (`id\0x`) reads as the part before the NUL (`id`).
//! Here each header is read on its own with the panic caught, and a name cut at a NUL is told
//! apart from a whole one, so that such a record is quarantined (`invalid_header_name`)
//! instead of killing its partition's worker or passing for a contract header.
//!
//! What cannot be read through rdkafka's safe API is not kept: the bytes of a name that is not
//! UTF-8 (nor its value), and the bytes of a name after its first NUL (its length is known).
//! Unwinding must be on (`panic = "unwind"`, Rust's default) for the panic to be caught.

use std::panic::{AssertUnwindSafe, catch_unwind};

use rdkafka::Message;
use rdkafka::message::{Headers, OwnedHeaders, OwnedMessage};

/// A header as received, with what could be read of it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub enum ReceivedHeader {
    /// A name read in full (UTF-8, no NUL) and its value's bytes (`None`: no value).
    Whole {
        /// The name.
        name: String,
        /// The value.
        value: Option<Vec<u8>>,
    },
    /// A name with a NUL inside: librdkafka shows only what precedes the first NUL.
    CutAtNul {
        /// The name up to its first NUL.
        prefix: String,
        /// The name's length in bytes.
        len: usize,
        /// The value.
        value: Option<Vec<u8>>,
    },
    /// A name that is not UTF-8: rdkafka reads neither it nor its value.
    Unreadable,
}

/// One header of a message, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read<'m> {
    Whole(&'m str, Option<&'m [u8]>),
    CutAtNul {
        prefix: &'m str,
        len: usize,
        value: Option<&'m [u8]>,
    },
    Unreadable,
}

impl Read<'_> {
    #[cfg(test)]
    pub(crate) fn received(self) -> ReceivedHeader {
        let value = |v: Option<&[u8]>| v.map(<[u8]>::to_vec);
        match self {
            Self::Whole(name, v) => ReceivedHeader::Whole {
                name: name.to_owned(),
                value: value(v),
            },
            Self::CutAtNul {
                prefix,
                len,
                value: v,
            } => ReceivedHeader::CutAtNul {
                prefix: prefix.to_owned(),
                len,
                value: value(v),
            },
            Self::Unreadable => ReceivedHeader::Unreadable,
        }
    }
}

/// Every header of `message`, in order.
pub(crate) fn read(message: &OwnedMessage) -> Vec<Read<'_>> {
    let Some(headers) = message.headers() else {
        return Vec::new();
    };
    (0..headers.count()).map(|i| read_one(headers, i)).collect()
}

/// The value of `message`'s first header named `name` in full, if it is UTF-8.
pub(crate) fn text<'m>(message: &'m OwnedMessage, name: &str) -> Option<&'m str> {
    read(message).into_iter().find_map(|h| match h {
        Read::Whole(n, Some(value)) if n == name => std::str::from_utf8(value).ok(),
        _ => None,
    })
}

/// Why a record whose headers are `read` breaks the contract's header names, if it does.
pub(crate) fn name_defect(read: &[Read<'_>]) -> Option<String> {
    let defects: Vec<String> = read
        .iter()
        .enumerate()
        .filter_map(|(i, h)| match h {
            Read::Whole(..) => None,
            Read::CutAtNul { prefix, len, .. } => Some(format!(
                "header {i}: its name of {len} bytes has a NUL after {prefix:?}"
            )),
            Read::Unreadable => Some(format!("header {i}: its name is not UTF-8")),
        })
        .collect();
    (!defects.is_empty()).then(|| defects.join("; "))
}

fn read_one(headers: &OwnedHeaders, idx: usize) -> Read<'_> {
    match catch_unwind(AssertUnwindSafe(|| headers.try_get(idx))) {
        Ok(Some(header)) => {
            let len = name_len(header.key, header.value);
            if len == header.key.len() {
                Read::Whole(header.key, header.value)
            } else {
                Read::CutAtNul {
                    prefix: header.key,
                    len,
                    value: header.value,
                }
            }
        }
        Ok(None) | Err(_) => Read::Unreadable,
    }
}

/// The length in bytes of a header's name, NULs included. librdkafka keeps a header's name, a
/// NUL and then its value in one allocation (`rd_kafka_header_add`), so where a non-empty
/// value starts tells; an empty or missing value does not (rdkafka gives an empty value a slice
/// of its own), and the name is then taken as it reads. The unit tests hold librdkafka to it.
fn name_len(name: &str, value: Option<&[u8]>) -> usize {
    match value {
        Some(value) if !value.is_empty() => value
            .as_ptr()
            .addr()
            .wrapping_sub(name.as_ptr().addr())
            .wrapping_sub(1),
        _ => name.len(),
    }
}

/// A message of topic `t` with `headers`, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_message(headers: &[(&str, Option<&[u8]>)]) -> OwnedMessage {
    use rdkafka::message::{Header, Timestamp};
    let headers = headers
        .iter()
        .fold(OwnedHeaders::new(), |hs, (key, value)| {
            hs.insert(Header { key, value: *value })
        });
    OwnedMessage::new(
        None,
        None,
        "t".into(),
        Timestamp::NotAvailable,
        0,
        0,
        Some(headers),
    )
}

#[cfg(test)]
mod tests {
    use super::test_message as message;
    use super::*;

    #[test]
    fn a_name_with_a_nul_is_told_from_the_name_before_it() {
        let m = message(&[
            ("id", Some(b"a")),
            ("id\0x", Some(b"b")),
            ("\0", Some(b"\0")),
            ("empty", Some(b"")),
            ("none", None),
            ("idx\0", None),
        ]);
        assert_eq!(
            read(&m),
            [
                Read::Whole("id", Some(&b"a"[..])),
                Read::CutAtNul {
                    prefix: "id",
                    len: 4,
                    value: Some(b"b")
                },
                Read::CutAtNul {
                    prefix: "",
                    len: 1,
                    value: Some(b"\0")
                },
                Read::Whole("empty", Some(&b""[..])),
                Read::Whole("none", None),
                // Without a value to tell where the name ends, it reads as librdkafka shows it.
                Read::Whole("idx", None),
            ]
        );
        assert_eq!(text(&m, "id"), Some("a"));
        assert!(name_defect(&read(&m)).is_some_and(|d| d.contains("header 1")));
        assert_eq!(name_defect(&read(&message(&[("a", Some(b"b"))]))), None);
    }
}
