//! The quarantine's `header_bytes` column: a record's headers as received, in order, names
//! and values as bytes, so any bytes round-trip (a NUL, which neither JSONB nor TEXT can hold,
//! included).
//!
//! Format 1: a version byte `1`, then per header a kind byte and its fields, lengths as
//! big-endian `u32`:
//! - `0` whole name: name length, name, value;
//! - `1` name cut at a NUL: the name's full length, the readable part's length, that part,
//!   value;
//! - `2` unreadable (a name that is not UTF-8): nothing more;
//! - `3` a name that is no contract name (not UTF-8, or a NUL inside): name length, name's
//!   bytes, value;
//!
//! (`1` and `2` were written before names were read as bytes, and are only read now)
//! and a value is `0` (no value) or `1`, its length and its bytes.

use crate::headers::{Read, ReceivedHeader};

const VERSION: u8 = 1;

/// `headers` in the column's format.
pub(crate) fn encode(headers: &[Read<'_>]) -> Vec<u8> {
    let mut out = vec![VERSION];
    for header in headers {
        match header {
            Read::Whole(name, value) => {
                out.push(0);
                bytes(&mut out, name.as_bytes());
                optional(&mut out, *value);
            }
            Read::Bytes(name, value) => {
                out.push(3);
                bytes(&mut out, name);
                optional(&mut out, *value);
            }
        }
    }
    out
}

/// The headers `column` holds.
pub(crate) fn decode(column: &[u8]) -> Result<Vec<ReceivedHeader>, String> {
    let mut r = Reader(column);
    match r.u8()? {
        VERSION => {}
        other => return Err(format!("header format {other} is not known")),
    }
    let mut headers = Vec::new();
    while !r.0.is_empty() {
        headers.push(match r.u8()? {
            0 => ReceivedHeader::Whole {
                name: r.text()?,
                value: r.optional()?,
            },
            1 => ReceivedHeader::CutAtNul {
                len: usize::try_from(r.u32()?).map_err(|e| e.to_string())?,
                prefix: r.text()?,
                value: r.optional()?,
            },
            2 => ReceivedHeader::Unreadable,
            3 => ReceivedHeader::Bytes {
                name: r.bytes()?,
                value: r.optional()?,
            },
            kind => return Err(format!("header kind {kind} is not known")),
        });
    }
    Ok(headers)
}

/// Kafka lengths are `i32`: a length that does not fit a `u32` never comes from a record.
fn length(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&length(b.len()).to_be_bytes());
    out.extend_from_slice(b);
}

fn optional(out: &mut Vec<u8>, value: Option<&[u8]>) {
    match value {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            bytes(out, v);
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("header bytes end early".to_owned());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let len = usize::try_from(self.u32()?).map_err(|e| e.to_string())?;
        Ok(self.take(len)?.to_vec())
    }

    fn text(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?).map_err(|_| "a header name is not UTF-8".to_owned())
    }

    fn optional(&mut self) -> Result<Option<Vec<u8>>, String> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.bytes().map(Some),
            other => Err(format!("value marker {other} is not known")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_bytes_round_trip_in_order() {
        let read = [
            Read::Whole("id", Some(&b"a\0b"[..])),
            Read::Whole("bin", Some(&[0xff, 0x00, 0xc3][..])),
            Read::Whole("id", Some(b"")),
            Read::Whole("none", None),
            Read::Bytes(b"id\0x", Some(b"v")),
            Read::Bytes(&[0xff, 0xfe], None),
            Read::Whole("", Some(b"\0")),
        ];
        let column = encode(&read);
        let owned: Vec<ReceivedHeader> = read.iter().map(|r| r.received()).collect();
        assert_eq!(decode(&column), Ok(owned));
        assert_eq!(decode(&encode(&[])), Ok(vec![]));
    }

    #[test]
    fn a_damaged_column_is_an_error_not_a_panic() {
        let column = encode(&[Read::Whole("name", Some(b"value"))]);
        // Cut anywhere but after the version byte (no headers is a whole list).
        for cut in (0..column.len()).filter(|&cut| cut != 1) {
            assert!(decode(&column[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode(&[9]).is_err());
        assert!(decode(&[1, 7]).is_err());
    }

    /// Rows written before names were read as bytes still read.
    #[test]
    fn the_earlier_kinds_still_read() {
        let mut column = vec![
            1, 1, 0, 0, 0, 4, 0, 0, 0, 2, b'i', b'd', 1, 0, 0, 0, 1, b'v',
        ];
        column.push(2);
        assert_eq!(
            decode(&column),
            Ok(vec![
                ReceivedHeader::CutAtNul {
                    prefix: "id".to_owned(),
                    len: 4,
                    value: Some(b"v".to_vec())
                },
                ReceivedHeader::Unreadable,
            ])
        );
    }
}
