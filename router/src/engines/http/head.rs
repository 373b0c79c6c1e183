//! The heads of an exchange with an engine: the request's (written by hand:
//! a POST with a few headers, or a bodiless GET) and the response's (parsed by `httparse`, the
//! parser hyper uses), with the body's framing and whether the connection may
//! be used again.

use super::framing::Framing;
use axum::http::HeaderValue;

/// Largest response head read (vLLM's is ~200 bytes; room for what a proxy in
/// front of an engine adds).
pub const MAX_RESPONSE_HEAD: usize = 8 * 1024;
/// Most response headers parsed.
const MAX_HEADERS: usize = 64;

/// Why a request cannot be written or a response head is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("invalid request header {0}")]
    RequestHeader(&'static str),
    #[error("malformed response head: {0}")]
    Malformed(String),
    #[error("response head larger than {MAX_RESPONSE_HEAD} bytes")]
    TooLarge,
    #[error("unexpected protocol switch (status 101)")]
    Upgrade,
    #[error("invalid content-length")]
    ContentLength,
}

/// The methods the router calls engines with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// A JSON body (every request the router forwards).
    Post,
    /// No body (probes, model lists).
    Get,
}

/// The request head of `method` to `target` (a path) on `authority`
/// (`host:port`), with `headers` (names in lower case); a POST carries
/// `content_length` bytes of JSON.
pub fn request(
    method: Method,
    authority: &str,
    target: &str,
    headers: &[(&'static str, &str)],
    content_length: usize,
) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(160 + target.len() + authority.len());
    if target.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(HeadError::RequestHeader(":path"));
    }
    head.extend_from_slice(match method {
        Method::Post => b"POST ",
        Method::Get => b"GET ",
    });
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(authority.as_bytes());
    head.extend_from_slice(b"\r\n");
    if method == Method::Post {
        head.extend_from_slice(b"content-type: application/json\r\ncontent-length: ");
        head.extend_from_slice(content_length.to_string().as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    for (name, value) in headers {
        debug_assert!(
            !matches!(
                *name,
                "host" | "content-length" | "content-type" | "transfer-encoding"
            ),
            "{name} is the client's to write"
        );
        // A value with a CR or LF would smuggle headers or a second request.
        HeaderValue::from_str(value).map_err(|_| HeadError::RequestHeader(name))?;
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Ok(head)
}

/// A parsed response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    /// Where the body ends.
    pub framing: Framing,
    /// Whether the connection may carry another request after this body.
    pub reusable: bool,
    /// Bytes of the head (to take from the read buffer).
    pub len: usize,
}

/// Parses the response head at the start of `buf`; `Ok(None)` until it is
/// whole. An interim (1xx) head is returned as it is: the caller skips it.
pub fn response(buf: &[u8]) -> Result<Option<ResponseHead>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > MAX_RESPONSE_HEAD => {
            return Err(HeadError::TooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(HeadError::Malformed(err.to_string())),
    };
    if len > MAX_RESPONSE_HEAD {
        return Err(HeadError::TooLarge);
    }
    let status = parsed.code.unwrap_or(0);
    if status == 101 {
        return Err(HeadError::Upgrade);
    }
    let mut reusable = parsed.version == Some(1);
    let mut chunked = None;
    let mut length: Option<u64> = None;
    for header in parsed.headers.iter() {
        let value = header.value;
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // Only the last coding says how the body ends.
            let last = value.rsplit(|b| *b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if header.name.eq_ignore_ascii_case("content-length") {
            // Digits only (`parse` would take a `+`).
            let digits = value.trim_ascii();
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return Err(HeadError::ContentLength);
            }
            let parsed = std::str::from_utf8(digits)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(HeadError::ContentLength)?;
            if length.is_some_and(|l| l != parsed) {
                return Err(HeadError::ContentLength);
            }
            length = Some(parsed);
        } else if header.name.eq_ignore_ascii_case("connection")
            && value
                .split(|b| *b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"))
        {
            reusable = false;
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Done
    } else {
        match (chunked, length) {
            (Some(true), length) => {
                // Both: the length is ignored, and the connection is not
                // trusted again (RFC 9112 section 6.3).
                reusable &= length.is_none();
                Framing::chunked()
            }
            (Some(false), _) => {
                reusable = false;
                Framing::Close
            }
            (None, Some(length)) => Framing::length(length),
            (None, None) => {
                reusable = false;
                Framing::Close
            }
        }
    };
    Ok(Some(ResponseHead {
        status,
        framing,
        reusable,
        len,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_head_carries_its_headers() {
        let head = request(
            Method::Post,
            "127.0.0.1:8100",
            "/v1/completions",
            &[("x-request-id", "abc"), ("traceparent", "00-1-2-01")],
            42,
        )
        .expect("valid");
        assert_eq!(
            String::from_utf8(head).expect("ascii"),
            "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8100\r\n\
             content-type: application/json\r\ncontent-length: 42\r\n\
             x-request-id: abc\r\ntraceparent: 00-1-2-01\r\n\r\n"
        );
        // A GET has no body, so neither its type nor its length.
        let head = request(Method::Get, "127.0.0.1:8100", "/health", &[], 0).expect("valid");
        assert_eq!(
            String::from_utf8(head).expect("ascii"),
            "GET /health HTTP/1.1\r\nhost: 127.0.0.1:8100\r\n\r\n"
        );
    }

    #[test]
    fn a_header_value_cannot_smuggle_a_header() {
        let head = request(
            Method::Post,
            "h:1",
            "/v1/completions",
            &[("x-request-id", "a\r\nx-evil: 1")],
            0,
        );
        assert_eq!(head, Err(HeadError::RequestHeader("x-request-id")));
        let head = request(Method::Get, "h:1", "/v1/models HTTP/1.1\r\n", &[], 0);
        assert_eq!(head, Err(HeadError::RequestHeader(":path")));
    }

    #[test]
    fn framing_and_reuse_follow_the_head() {
        let parse = |text: &str| response(text.as_bytes()).expect("valid").expect("whole");
        let head = parse("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nbody");
        assert_eq!(head.framing, Framing::chunked());
        assert!(head.reusable);
        assert_eq!(head.len, 47);
        let head = parse("HTTP/1.1 400 Bad\r\nContent-Length: 12\r\n\r\n");
        assert_eq!(
            (head.status, head.framing, head.reusable),
            (400, Framing::Length(12), true)
        );
        let head =
            parse("HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 1\r\n\r\n");
        assert!(!head.reusable);
        let head = parse("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((head.framing, head.reusable), (Framing::Close, false));
        let head = parse("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n");
        assert!(!head.reusable, "HTTP/1.0 closes by default");
        let head = parse(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 5\r\n\r\n",
        );
        assert_eq!((head.framing, head.reusable), (Framing::chunked(), false));
        let head = parse("HTTP/1.1 204 No Content\r\ncontent-length: 9\r\n\r\n");
        assert_eq!(head.framing, Framing::Done);
        let head = parse("HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(head.status, 100);
    }

    #[test]
    fn bad_heads_are_errors_and_partial_ones_wait() {
        assert_eq!(response(b"HTTP/1.1 200 OK\r\ncontent-le"), Ok(None));
        assert!(matches!(
            response(b"HTTP/9 200 OK\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        assert_eq!(
            response(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"),
            Err(HeadError::ContentLength)
        );
        for bad in ["-1", "+5", "5, 5", "", "0x10"] {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n");
            assert_eq!(
                response(head.as_bytes()),
                Err(HeadError::ContentLength),
                "{bad:?}"
            );
        }
        assert_eq!(
            response(b"HTTP/1.1 101 Switching\r\n\r\n"),
            Err(HeadError::Upgrade)
        );
        let mut long = b"HTTP/1.1 200 OK\r\n".to_vec();
        while long.len() <= MAX_RESPONSE_HEAD {
            long.extend_from_slice(format!("x-pad: {}\r\n", "0".repeat(1000)).as_bytes());
        }
        assert_eq!(response(&long), Err(HeadError::TooLarge));
    }
}
