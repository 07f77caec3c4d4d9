//! A record's headers, read whatever their bytes.
//!
//! rdkafka 0.39 reads a header's name with `CStr::to_str().unwrap()` (`Headers::get`,
//! `try_get`, `iter`): a name that is not UTF-8, which Go and C producers can send, panics,
//! and neither the name nor the value can be read through it. And librdkafka hands names out
//! as C strings: a name with a NUL inside (`id\0x`) reads as the part before the NUL (`id`).
//! So the headers are read here through librdkafka's own call (`rd_kafka_header_get_all`),
//! names as bytes, in full: a record whose names break the contract is quarantined
//! (`invalid_header_name`) with every byte of them, instead of killing its partition's worker
//! or passing for a contract header.
//!
//! One case stays beyond reach: a name with a NUL inside and no value (a null value, not an
//! empty one) reads as its part before the NUL, for librdkafka tells a name's length only
//! through where its value starts.

use std::ffi::{CStr, c_char, c_void};

use rdkafka::Message;
use rdkafka::bindings::{rd_kafka_header_get_all, rd_kafka_headers_t, rd_kafka_resp_err_t};
use rdkafka::message::{BorrowedHeaders, Headers, OwnedHeaders, OwnedMessage};

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
    /// A name that is no contract name (not UTF-8, or a NUL inside), its bytes in full.
    Bytes {
        /// The name's bytes.
        name: Vec<u8>,
        /// The value.
        value: Option<Vec<u8>>,
    },
    /// Stored by versions before 0.1.0's header reader: a name with a NUL inside, known up to
    /// its first NUL.
    CutAtNul {
        /// The name up to its first NUL.
        prefix: String,
        /// The name's length in bytes.
        len: usize,
        /// The value.
        value: Option<Vec<u8>>,
    },
    /// Stored by versions before 0.1.0's header reader: a name that is not UTF-8, read neither
    /// it nor its value.
    Unreadable,
}

/// One header of a message, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read<'m> {
    /// A contract-shaped name: UTF-8 without NUL.
    Whole(&'m str, Option<&'m [u8]>),
    /// Any other name, as bytes.
    Bytes(&'m [u8], Option<&'m [u8]>),
}

impl<'m> Read<'m> {
    fn new(name: &'m [u8], value: Option<&'m [u8]>) -> Self {
        match std::str::from_utf8(name) {
            Ok(text) if !name.contains(&0) => Self::Whole(text, value),
            _ => Self::Bytes(name, value),
        }
    }

    /// The name's and value's bytes.
    pub(crate) fn len(self) -> usize {
        let (name, value) = match self {
            Self::Whole(name, value) => (name.as_bytes(), value),
            Self::Bytes(name, value) => (name, value),
        };
        name.len() + value.map_or(0, <[u8]>::len)
    }

    #[cfg(test)]
    pub(crate) fn received(self) -> ReceivedHeader {
        let value = |v: Option<&[u8]>| v.map(<[u8]>::to_vec);
        match self {
            Self::Whole(name, v) => ReceivedHeader::Whole {
                name: name.to_owned(),
                value: value(v),
            },
            Self::Bytes(name, v) => ReceivedHeader::Bytes {
                name: name.to_vec(),
                value: value(v),
            },
        }
    }
}

/// Every header of `message`, in order.
pub(crate) fn read(message: &OwnedMessage) -> Vec<Read<'_>> {
    let Some(headers) = message.headers() else {
        return Vec::new();
    };
    (0..headers.count())
        .map_while(|i| get(headers, i))
        .map(|(name, value)| Read::new(name, value))
        .collect()
}

/// The value of `message`'s first header named `name` in full, if it is UTF-8.
pub(crate) fn text<'m>(message: &'m OwnedMessage, name: &str) -> Option<&'m str> {
    read(message).into_iter().find_map(|h| match h {
        Read::Whole(n, Some(value)) if n == name => std::str::from_utf8(value).ok(),
        _ => None,
    })
}

/// How much of a bad name an error shows (`header_bytes` keeps all of it).
const SHOWN: usize = 64;

/// Why a record whose headers are `read` breaks the contract's header names, if it does.
pub(crate) fn name_defect(read: &[Read<'_>]) -> Option<String> {
    let defects: Vec<String> = read
        .iter()
        .enumerate()
        .filter_map(|(i, h)| match h {
            Read::Whole(..) => None,
            Read::Bytes(name, _) => Some(format!(
                "header {i}: its name \"{}\"{} is {}",
                name[..name.len().min(SHOWN)].escape_ascii(),
                if name.len() > SHOWN {
                    format!("... ({} bytes)", name.len())
                } else {
                    String::new()
                },
                if std::str::from_utf8(name).is_ok() {
                    "not to have a NUL inside"
                } else {
                    "not UTF-8"
                }
            )),
        })
        .collect();
    (!defects.is_empty()).then(|| defects.join("; "))
}

/// Header `idx` of `headers`: its name's bytes and its value, as librdkafka holds them.
#[expect(
    unsafe_code,
    reason = "rdkafka's safe header API panics on a name that is not UTF-8 and cuts a name at \
              its first NUL; this is the one call that reads any name"
)]
fn get(headers: &OwnedHeaders, idx: usize) -> Option<(&[u8], Option<&[u8]>)> {
    // rdkafka's `BorrowedHeaders` is a zero-sized type whose address is the native
    // `rd_kafka_headers_t` pointer (rdkafka's own `BorrowedHeaders::as_native_ptr` is this
    // cast); `as_borrowed` makes such a reference of the message's own headers. The unit
    // tests hold this crate's rdkafka to it: re-read them when upgrading rdkafka.
    // librdkafka casts the index to `int`: keep it in range here.
    if idx >= headers.count() {
        return None;
    }
    let native =
        std::ptr::from_ref::<BorrowedHeaders>(headers.as_borrowed()).cast::<rd_kafka_headers_t>();
    let mut name: *const c_char = std::ptr::null();
    let mut value: *const c_void = std::ptr::null();
    let mut size = 0_usize;
    // SAFETY: `native` is the live header list `headers` owns (above), borrowed for the call;
    // the out-pointers are valid locals. librdkafka returns an error for `idx` out of range.
    let code = unsafe { rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size) };
    if code != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
        return None;
    }
    // SAFETY: librdkafka's header is one allocation, `name`, a NUL, then `value` and a NUL
    // (`rd_kafka_header_add`); it lives as long as `headers` and is never written to after
    // it is added. So `name` is NUL-terminated; and when there is a value, the name's bytes
    // (NULs inside included) are all those between `name` and the NUL before `value`, and the
    // value's are `size` bytes from `value`. The checks below keep to that layout: a value
    // that would not start after the name's C string is read as if the name ended there.
    unsafe {
        let c_name = CStr::from_ptr(name).to_bytes();
        let value = (!value.is_null()).then(|| (value.cast::<u8>(), size));
        let name_len = value.map_or(c_name.len(), |(start, _)| {
            start
                .addr()
                .checked_sub(name.addr() + 1)
                .filter(|&len| len >= c_name.len())
                .unwrap_or(c_name.len())
        });
        Some((
            std::slice::from_raw_parts(name.cast::<u8>(), name_len),
            value.map(|(start, size)| std::slice::from_raw_parts(start, size)),
        ))
    }
}

/// Checks the header reader against the librdkafka linked in: a header named `id\0x` must read
/// back as those 4 bytes, with its value. A librdkafka whose header layout differs (another
/// version, a `dynamic-linking` build) would otherwise read names wrong, or out of bounds.
pub(crate) fn self_test() -> Result<(), String> {
    let headers = OwnedHeaders::new()
        .insert(rdkafka::message::Header {
            key: "id\0x",
            value: Some(b"v".as_slice()),
        })
        .insert(rdkafka::message::Header {
            key: "k",
            value: None::<&[u8]>,
        });
    match (get(&headers, 0), get(&headers, 1)) {
        (Some((b"id\0x", Some(b"v"))), Some((b"k", None))) => Ok(()),
        other => Err(format!(
            "this build's librdkafka stores Kafka headers differently from the one the consumer \
             was written for (librdkafka 2.12.1 through rdkafka-sys 4.10.0): a header named \
             \"id\\0x\" read back as {other:?}; build against the pinned version (no \
             `dynamic-linking`)"
        )),
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
    fn the_self_test_passes_on_the_librdkafka_linked_in() {
        assert_eq!(self_test(), Ok(()));
    }

    #[test]
    fn names_are_read_in_full_whatever_their_bytes() {
        let m = message(&[
            ("id", Some(b"a")),
            ("id\0x", Some(b"b")),
            ("\0", Some(b"\0")),
            ("empty", Some(b"")),
            ("none", None),
            ("n\0", Some(b"")),
            ("idx\0", None),
        ]);
        assert_eq!(
            read(&m),
            [
                Read::Whole("id", Some(&b"a"[..])),
                Read::Bytes(b"id\0x", Some(b"b")),
                Read::Bytes(b"\0", Some(b"\0")),
                Read::Whole("empty", Some(&b""[..])),
                Read::Whole("none", None),
                Read::Bytes(b"n\0", Some(b"")),
                // Without a value to tell where the name ends, it reads as librdkafka shows it.
                Read::Whole("idx", None),
            ]
        );
        assert_eq!(text(&m, "id"), Some("a"));
        assert!(
            name_defect(&read(&m)).is_some_and(|d| d.contains(r#"header 1: its name "id\x00x""#))
        );
        assert_eq!(name_defect(&read(&message(&[("a", Some(b"b"))]))), None);
    }

    /// What the safe API reads, `get` reads alike: it is given the native list (a wrong pointer
    /// would read other bytes or none), and the slices are the very ones librdkafka holds.
    #[test]
    fn get_reads_the_list_rdkafkas_safe_api_reads() {
        let names: Vec<String> = (0..40).map(|i| format!("h{i}")).collect();
        let pairs: Vec<(&str, Option<&[u8]>)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), (i % 3 != 0).then_some(n.as_bytes())))
            .collect();
        let m = message(&pairs);
        let headers = m.headers().expect("headers");
        for i in 0..headers.count() {
            let safe = headers.get(i);
            let (name, value) = get(headers, i).expect("in range");
            assert_eq!(name.as_ptr(), safe.key.as_ptr());
            assert_eq!(name, safe.key.as_bytes());
            assert_eq!(value, safe.value);
        }
        assert_eq!(get(headers, headers.count()), None);
    }
}
