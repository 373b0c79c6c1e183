//! Why a decoder failed a request (`Cause`) and the failure as resume
//! reads it (`Failure`): made by an attempt (`attempt.rs`) or a derender
//! (`derender.rs`), decided on by `resume.rs`.

/// Why a decoder failed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// No connection to the decoder: it never saw the request (not a resume).
    Connect,
    /// Connected, but no response headers within the decode-open timeout.
    NoHeaders,
    /// The response body failed mid-stream (reset, broken chunking).
    Reset,
    /// The stream ended without a finish_reason for every choice.
    Truncated,
    /// No first token within the first-token timeout.
    FirstToken,
    /// No event within the stall timeout after the first token.
    Stall,
    /// A 5xx status, or an error event with a 5xx code.
    ServerError,
    /// The decoder sent what the protocol does not allow: invalid JSON, a choice
    /// the request does not have, token ids that are not integers, an event
    /// larger than the router reads, more tokens than asked for.
    Protocol,
    /// The registry declared the decoder dead (heartbeat TTL, probes).
    Dead,
    /// `drain?migrate=true` on the decoder.
    Migrate,
}

impl Cause {
    /// Every cause, for the tests that go through them all.
    pub const ALL: [Cause; 10] = [
        Cause::Connect,
        Cause::NoHeaders,
        Cause::Reset,
        Cause::Truncated,
        Cause::FirstToken,
        Cause::Stall,
        Cause::ServerError,
        Cause::Protocol,
        Cause::Dead,
        Cause::Migrate,
    ];

    /// The `cause` label of `connex_resumes_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Connect => "connect",
            Cause::NoHeaders => "no_headers",
            Cause::Reset => "reset",
            Cause::Truncated => "truncated",
            Cause::FirstToken => "first_token",
            Cause::Stall => "stall",
            Cause::ServerError => "5xx",
            Cause::Protocol => "protocol",
            Cause::Dead => "dead",
            Cause::Migrate => "migrate",
        }
    }

    /// Whether the decoder had the request (it may have generated tokens):
    /// every cause but a failed connect.
    pub fn reached_decoder(self) -> bool {
        self != Cause::Connect
    }
}

/// A decoder failure: which decoder, why, and what it said.
#[derive(Debug, Clone)]
pub struct Failure {
    pub decoder: String,
    pub cause: Cause,
    pub message: String,
}

impl Failure {
    pub fn new(decoder: &str, cause: Cause, message: impl Into<String>) -> Self {
        Self {
            decoder: decoder.to_string(),
            cause,
            message: message.into(),
        }
    }
}
