//! Server-sent events: the one parser for engine streams and the one emitter.

use bytes::{Bytes, BytesMut};

/// Splits a byte stream into the `data:` payloads of complete events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: BytesMut,
}

impl SseParser {
    /// Feeds bytes; returns the data payload of each event completed by them.
    /// An event that arrives whole with one `data:` line (every token event
    /// of an engine) is handed on as a slice of `chunk`, not copied; only an
    /// event split across chunks is gathered in the parser's buffer.
    pub fn push(&mut self, chunk: Bytes) -> Vec<Bytes> {
        let mut input = if self.buf.is_empty() {
            chunk
        } else {
            self.buf.extend_from_slice(&chunk);
            self.buf.split().freeze()
        };
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&input) {
            let event = input.split_to(end + sep);
            if let Some(data) = event_data(&event.slice(..end)) {
                events.push(data);
            }
        }
        if input.is_empty() {
            // Nothing kept of the bytes just parsed (the buffer would pin them).
            self.buf = BytesMut::new();
        } else {
            self.buf.extend_from_slice(&input);
        }
        events
    }

    /// Bytes received after the last complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The event separators, each searcher built once.
static LF_END: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\n\n"));
static CRLF_END: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\r\n\r\n"));

/// Position and length of the first event separator (blank line).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = LF_END.find(buf).map(|p| (p, 2));
    // Engines end lines with LF; look for CRLF separators only when a CR is there.
    if memchr::memchr(b'\r', buf).is_none() {
        return lf;
    }
    let crlf = CRLF_END.find(buf).map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The joined `data:` lines of one event; `None` for comments and empty
/// events. One `data:` line is a slice of `event`.
fn event_data(event: &Bytes) -> Option<Bytes> {
    let mut lines = event
        .split(|&b| b == b'\n')
        .filter(|line| line.starts_with(b"data:"));
    if let (Some(line), None) = (lines.next(), lines.next()) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let rest = &line[b"data:".len()..];
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        return Some(event.slice_ref(rest));
    }
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let joined = data.get_or_insert_with(Vec::new);
            if !joined.is_empty() {
                joined.push(b'\n');
            }
            joined.extend_from_slice(rest);
        }
    }
    data.map(Bytes::from)
}

/// One SSE event carrying `data`.
pub fn event(data: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The stream terminator.
pub const DONE: &[u8] = b"[DONE]";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_across_chunk_boundaries() {
        let mut parser = SseParser::default();
        assert!(parser.push(Bytes::from_static(b"data: {\"a\":")).is_empty());
        let events = parser.push(Bytes::from_static(b"1}\n\ndata: [DONE]\n\n: comment\n\nda"));
        assert_eq!(
            events,
            vec![
                Bytes::from_static(b"{\"a\":1}"),
                Bytes::from_static(b"[DONE]")
            ]
        );
        assert_eq!(parser.pending(), 2, "the start of the next event waits");
        let events = parser.push(Bytes::from_static(b"ta: x\n\n"));
        assert_eq!(events, vec![Bytes::from_static(b"x")]);
        assert_eq!(parser.pending(), 0);
    }

    #[test]
    fn handles_crlf_and_multiline_data() {
        let mut parser = SseParser::default();
        let events = parser.push(Bytes::from_static(
            b"data: a\r\ndata: b\r\n\r\nevent: e\r\ndata:c\r\n\r\n",
        ));
        assert_eq!(
            events,
            vec![Bytes::from_static(b"a\nb"), Bytes::from_static(b"c")]
        );
    }

    #[test]
    fn a_whole_event_is_not_copied() {
        let mut parser = SseParser::default();
        let chunk = Bytes::from_static(b"data: {\"id\":1}\n\n");
        let events = parser.push(chunk.clone());
        assert_eq!(events.len(), 1);
        let within = chunk.as_ptr_range();
        assert!(within.contains(&events[0].as_ptr()), "a slice of the chunk");
    }

    #[test]
    fn emits_what_it_parses() {
        let mut parser = SseParser::default();
        assert_eq!(parser.push(event(b"{}")), vec![Bytes::from_static(b"{}")]);
    }
}
