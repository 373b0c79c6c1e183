//! Where an engine's response body ends (RFC 9112 section 6.3): a
//! `content-length`, chunked transfer coding (how vLLM's server sends a
//! stream), or the connection's close. A pure decoder over the bytes read so
//! far: it takes whole data pieces out of the buffer without copying them, and
//! bounds what it must hold before it can tell (a chunk-size line, trailers).

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size line (hex size and extensions) or trailer line.
pub const MAX_LINE: usize = 4096;
/// Most trailer bytes after the last chunk.
pub const MAX_TRAILERS: usize = 16 * 1024;

/// Why a body is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("chunk size line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("chunk data not followed by CRLF")]
    ChunkEnd,
    #[error("trailers longer than {MAX_TRAILERS} bytes")]
    TrailersTooLong,
    #[error("invalid trailer line")]
    Trailer,
    #[error("connection closed before the body's end")]
    Truncated,
}

/// How the body ends, and how far it has come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Framing {
    /// `content-length`: this many bytes are still to come.
    Length(u64),
    /// Chunked transfer coding.
    Chunked(ChunkedState),
    /// Until the connection closes (no length given; never reusable).
    Close,
    /// The body has ended.
    Done,
}

/// Where a chunked body stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkedState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes to go.
    Data(u64),
    /// After a chunk's data: expecting its CRLF.
    DataEnd,
    /// After the last (zero-size) chunk: trailer lines until an empty one;
    /// how many trailer bytes were seen so far.
    Trailers(usize),
}

impl Framing {
    /// A body of `length` bytes.
    pub fn length(length: u64) -> Self {
        if length == 0 {
            Framing::Done
        } else {
            Framing::Length(length)
        }
    }

    pub fn chunked() -> Self {
        Framing::Chunked(ChunkedState::Size)
    }

    pub fn is_done(&self) -> bool {
        *self == Framing::Done
    }

    /// Takes the next piece of body data out of `buf`. `Ok(None)`: more bytes
    /// are needed, or the body has ended ([`Framing::is_done`]).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, FramingError> {
        loop {
            match self {
                Framing::Done => return Ok(None),
                Framing::Close => {
                    return Ok((!buf.is_empty()).then(|| buf.split().freeze()));
                }
                Framing::Length(left) => {
                    let Some(data) = take_counted(left, buf) else {
                        return Ok(None);
                    };
                    if *left == 0 {
                        *self = Framing::Done;
                    }
                    return Ok(Some(data));
                }
                Framing::Chunked(chunk) => match chunk {
                    ChunkedState::Size => {
                        let Some(line) = take_line(buf, FramingError::ChunkSize)? else {
                            return Ok(None);
                        };
                        let size = chunk_size(&line)?;
                        *chunk = if size == 0 {
                            ChunkedState::Trailers(0)
                        } else {
                            ChunkedState::Data(size)
                        };
                    }
                    ChunkedState::Data(left) => {
                        let Some(data) = take_counted(left, buf) else {
                            return Ok(None);
                        };
                        if *left == 0 {
                            *chunk = ChunkedState::DataEnd;
                        }
                        return Ok(Some(data));
                    }
                    ChunkedState::DataEnd => {
                        if buf.len() < 2 {
                            if buf.first().is_some_and(|b| *b != b'\r') {
                                return Err(FramingError::ChunkEnd);
                            }
                            return Ok(None);
                        }
                        if &buf[..2] != b"\r\n" {
                            return Err(FramingError::ChunkEnd);
                        }
                        buf.advance(2);
                        *chunk = ChunkedState::Size;
                    }
                    ChunkedState::Trailers(seen) => {
                        let Some(line) = take_line(buf, FramingError::Trailer)? else {
                            return Ok(None);
                        };
                        if line.is_empty() {
                            *self = Framing::Done;
                        } else {
                            *seen += line.len() + 2;
                            if *seen > MAX_TRAILERS {
                                return Err(FramingError::TrailersTooLong);
                            }
                        }
                    }
                },
            }
        }
    }

    /// The connection closed: the end of a close-delimited body, an error for
    /// any other body that has not ended.
    pub fn eof(&mut self) -> Result<(), FramingError> {
        match self {
            Framing::Close | Framing::Done => {
                *self = Framing::Done;
                Ok(())
            }
            _ => Err(FramingError::Truncated),
        }
    }

    /// How many bytes to make room for before the next read: what a known
    /// length still needs, within bounds (a token event is a few hundred
    /// bytes; a prefill's answer may be megabytes).
    pub fn read_hint(&self) -> usize {
        const SMALL: usize = 2048;
        const LARGE: usize = 64 * 1024;
        let left = match self {
            Framing::Length(left) | Framing::Chunked(ChunkedState::Data(left)) => *left,
            _ => return SMALL,
        };
        usize::try_from(left).unwrap_or(LARGE).clamp(SMALL, LARGE)
    }
}

/// Up to `left` of `buf`'s bytes, taken off `left` (None: `buf` is empty).
fn take_counted(left: &mut u64, buf: &mut BytesMut) -> Option<Bytes> {
    if buf.is_empty() {
        return None;
    }
    let take = take_len(*left, buf.len());
    *left -= take as u64;
    Some(buf.split_to(take).freeze())
}

/// `min(left, available)` without overflow.
fn take_len(left: u64, available: usize) -> usize {
    usize::try_from(left).map_or(available, |left| left.min(available))
}

/// Takes one CRLF-ended line out of `buf` (without its CRLF); `None` until a
/// whole line is there; `malformed` for a bare LF or a control byte in it.
fn take_line(
    buf: &mut BytesMut,
    malformed: FramingError,
) -> Result<Option<BytesMut>, FramingError> {
    let Some(end) = memchr::memchr(b'\n', buf) else {
        if buf.len() > MAX_LINE {
            return Err(FramingError::LineTooLong);
        }
        return Ok(None);
    };
    if end > MAX_LINE {
        return Err(FramingError::LineTooLong);
    }
    if end == 0 || buf[end - 1] != b'\r' {
        return Err(malformed);
    }
    let mut line = buf.split_to(end + 1);
    line.truncate(end - 1);
    if line
        .iter()
        .any(|b| (b.is_ascii_control() && *b != b'\t') || *b == 0x7f)
    {
        return Err(malformed);
    }
    Ok(Some(line))
}

/// A chunk-size line's size: hex digits, then optional whitespace and
/// extensions (`;name=value`, ignored).
fn chunk_size(line: &[u8]) -> Result<u64, FramingError> {
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let rest = &line[digits..];
    let rest_ok = rest.is_empty()
        || matches!(
            rest.iter().find(|b| !matches!(b, b' ' | b'\t')),
            None | Some(b';')
        );
    if digits == 0 || digits > 16 || !rest_ok {
        return Err(FramingError::ChunkSize);
    }
    let text = std::str::from_utf8(&line[..digits]).map_err(|_| FramingError::ChunkSize)?;
    u64::from_str_radix(text, 16).map_err(|_| FramingError::ChunkSize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `wire` to a decoder `step` bytes at a time; the body it gave,
    /// whether it ended, and what was left after its end.
    fn run(
        mut framing: Framing,
        wire: &[u8],
        step: usize,
    ) -> Result<(Vec<u8>, bool), FramingError> {
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        for piece in wire.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            while let Some(data) = framing.decode(&mut buf)? {
                assert!(!data.is_empty(), "an empty data piece");
                body.extend_from_slice(&data);
            }
            if framing.is_done() {
                break;
            }
        }
        Ok((body, framing.is_done()))
    }

    /// `parts` in chunked coding, with an extension and a trailer.
    fn chunked(parts: &[&[u8]]) -> Vec<u8> {
        let mut wire = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            if i % 2 == 0 {
                wire.extend(format!("{:x}\r\n", part.len()).bytes());
            } else {
                wire.extend(format!("{:X} ;ext=\"v\"\r\n", part.len()).bytes());
            }
            wire.extend_from_slice(part);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        wire
    }

    #[test]
    fn a_chunked_body_decodes_whatever_the_read_sizes() {
        let parts: Vec<Vec<u8>> = (0..40)
            .map(|i| {
                (0..(i * 37 % 300 + 1))
                    .map(|j| b'a' + ((i + j) % 26) as u8)
                    .collect()
            })
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let wire = chunked(&refs);
        let expected = parts.concat();
        for step in [1, 2, 3, 7, 64, 1000, wire.len()] {
            let (body, done) = run(Framing::chunked(), &wire, step).expect("decodes");
            assert_eq!(body, expected, "read {step} bytes at a time");
            assert!(done, "the last chunk ends the body (step {step})");
        }
    }

    #[test]
    fn a_body_ends_at_its_length_and_leaves_what_follows() {
        let mut framing = Framing::length(5);
        let mut buf = BytesMut::from(&b"helloHTTP/1.1"[..]);
        assert_eq!(
            framing.decode(&mut buf).expect("ok"),
            Some(Bytes::from("hello"))
        );
        assert!(framing.is_done());
        assert_eq!(&buf[..], b"HTTP/1.1", "the next response's bytes stay");
        assert_eq!(Framing::length(0), Framing::Done);
        let mut after_chunks = BytesMut::from(&b"2\r\nhi\r\n0\r\n\r\nNEXT"[..]);
        let mut framing = Framing::chunked();
        assert_eq!(
            framing.decode(&mut after_chunks).expect("ok"),
            Some(Bytes::from("hi"))
        );
        assert_eq!(framing.decode(&mut after_chunks).expect("ok"), None);
        assert!(framing.is_done());
        assert_eq!(&after_chunks[..], b"NEXT");
    }

    #[test]
    fn malformed_chunked_bodies_are_errors() {
        for (wire, error) in [
            (&b"zz\r\nab\r\n"[..], FramingError::ChunkSize),
            (b"\r\n", FramingError::ChunkSize),
            (b"2 x\r\nab\r\n", FramingError::ChunkSize),
            (b"2\nab\r\n", FramingError::ChunkSize),
            (b"11111111111111111\r\n", FramingError::ChunkSize),
            (b"2\r\nabXY", FramingError::ChunkEnd),
            (b"2\r\nabX", FramingError::ChunkEnd),
            (b"2;a=\rb\r\nab\r\n", FramingError::ChunkSize),
            (b"2;a=\0\r\nab\r\n", FramingError::ChunkSize),
            (b"0\r\nx-t: \x01\r\n\r\n", FramingError::Trailer),
            (b"0\r\nx-t: 1\n\r\n", FramingError::Trailer),
        ] {
            assert_eq!(
                run(Framing::chunked(), wire, wire.len()),
                Err(error),
                "{wire:?}"
            );
        }
        let long = vec![b'1'; MAX_LINE + 10];
        assert_eq!(
            run(Framing::chunked(), &long, 1000),
            Err(FramingError::LineTooLong)
        );
        let mut trailers = b"0\r\n".to_vec();
        for _ in 0..1000 {
            trailers.extend_from_slice(b"x-trailer: 0123456789abcdef\r\n");
        }
        assert_eq!(
            run(Framing::chunked(), &trailers, 512),
            Err(FramingError::TrailersTooLong)
        );
    }

    #[test]
    fn the_connection_closing_ends_only_a_close_delimited_body() {
        let mut framing = Framing::Close;
        let mut buf = BytesMut::from(&b"rest"[..]);
        assert_eq!(
            framing.decode(&mut buf).expect("ok"),
            Some(Bytes::from("rest"))
        );
        assert_eq!(framing.eof(), Ok(()));
        assert!(framing.is_done());
        assert_eq!(Framing::length(3).eof(), Err(FramingError::Truncated));
        assert_eq!(Framing::chunked().eof(), Err(FramingError::Truncated));
        assert_eq!(Framing::Done.eof(), Ok(()));
    }

    #[test]
    fn a_huge_declared_chunk_is_read_as_it_comes() {
        let mut framing = Framing::chunked();
        let mut buf = BytesMut::from(&b"ffffffffffffffff\r\nabc"[..]);
        assert_eq!(
            framing.decode(&mut buf).expect("ok"),
            Some(Bytes::from("abc"))
        );
        assert_eq!(framing.read_hint(), 64 * 1024);
        assert_eq!(Framing::length(10).read_hint(), 2048);
    }
}
