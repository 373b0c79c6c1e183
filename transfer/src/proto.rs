//! The control protocol: versioned, length-prefixed binary frames, with a hard
//! limit on every field.
//!
//! Every frame starts with the same 12-byte header in every version:
//! `magic "CX" | version u8 | op u8 | seq u32 | payload_len u32` (little endian),
//! followed by `payload_len` bytes of payload (at most [`MAX_PAYLOAD`]). A
//! reply carries the seq of its request. Strings are `u16 len + UTF-8`, blobs
//! `u32 len + bytes`, lists `u32 count + items`; a payload must be consumed
//! exactly (trailing bytes are an error). The one exception to "everything is
//! a frame" is [`Reply::Data`]: its payload holds the byte count, and that many
//! raw block bytes follow the frame on the stream. docs/transfer.md has the
//! table of ops and limits.

use crate::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
use crate::config::BackendKind;
use crate::stats::{HoldInfo, HolderStats};
use bytes::{Buf, BufMut, BytesMut};

pub const MAGIC: [u8; 2] = *b"CX";
/// Version 2: the challenge-response handshake (the secret no longer
/// travels) and the pull window in `describe`.
pub const VERSION: u8 = 2;
pub const HEADER_LEN: usize = 12;
/// Largest payload of any frame.
pub const MAX_PAYLOAD: u32 = 2 << 20;
/// Longest transfer id (printable ASCII, no spaces).
pub const MAX_ID_LEN: usize = 256;
/// Most blocks in one hold.
pub const MAX_BLOCKS: usize = 65_536;
/// Most distinct remote keys (registered regions) one hold may span.
pub const MAX_KEYS: usize = 64;
/// Longest remote key (e.g. a packed UCX rkey).
pub const MAX_KEY_LEN: usize = 4096;
/// Longest backend endpoint blob (e.g. a UCX worker address).
pub const MAX_ENDPOINT_LEN: usize = 64 * 1024;
/// Longest error message.
pub const MAX_MESSAGE_LEN: usize = 1024;
/// Most transfer ids in one `ReleaseMany`.
pub const MAX_RELEASE_BATCH: usize = 1024;
/// Largest single read of the TCP data path.
pub const MAX_READ_LEN: u64 = 1 << 40;

/// Request op codes.
mod op {
    pub const RENEW: u8 = 0x01;
    pub const RELEASE: u8 = 0x02;
    pub const STAT: u8 = 0x03;
    pub const STATS: u8 = 0x04;
    pub const DESCRIBE: u8 = 0x05;
    pub const READ: u8 = 0x06;
    pub const DONE: u8 = 0x07;
    pub const HELLO: u8 = 0x08;
    pub const PROOF: u8 = 0x09;
    pub const ABORT: u8 = 0x0A;
    pub const RELEASE_MANY: u8 = 0x0B;
    pub const HOLD: u8 = 0x80;
    pub const RELEASED: u8 = 0x81;
    pub const STAT_REPLY: u8 = 0x82;
    pub const STATS_REPLY: u8 = 0x83;
    pub const DESCRIPTOR: u8 = 0x84;
    pub const DATA: u8 = 0x85;
    pub const DONE_REPLY: u8 = 0x86;
    pub const WELCOME: u8 = 0x87;
    pub const CHALLENGE: u8 = 0x88;
    pub const RELEASED_MANY: u8 = 0x89;
    pub const ERROR: u8 = 0xFF;
}

/// Error codes of [`Reply::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    BadFrame = 1,
    BadVersion = 2,
    TooLarge = 3,
    UnknownOp = 4,
    HoldNotFound = 5,
    StaleEpoch = 6,
    BadRange = 7,
    WrongBackend = 8,
    Busy = 9,
    Internal = 10,
    /// No completed handshake before the op, or a wrong proof.
    Unauthorized = 11,
    /// A resume epoch above the holder's bound (`served` carries the bound).
    EpochOutOfRange = 12,
}

impl ErrorCode {
    pub fn from_u16(code: u16) -> Option<Self> {
        use ErrorCode::*;
        [
            BadFrame,
            BadVersion,
            TooLarge,
            UnknownOp,
            HoldNotFound,
            StaleEpoch,
            BadRange,
            WrongBackend,
            Busy,
            Internal,
            Unauthorized,
            EpochOutOfRange,
        ]
        .into_iter()
        .find(|c| *c as u16 == code)
    }
}

/// A malformed frame or field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FrameError(pub String);

fn bad(msg: impl Into<String>) -> FrameError {
    FrameError(msg.into())
}

/// The fixed header of every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u8,
    pub op: u8,
    pub seq: u32,
    pub len: u32,
}

impl Header {
    /// Parses a header; the version and length are checked by the caller,
    /// which must still answer in a way the peer can read.
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        if bytes[..2] != MAGIC {
            return Err(bad("bad magic (not a connex-transfer frame)"));
        }
        let mut b = &bytes[2..];
        Ok(Self {
            version: b.get_u8(),
            op: b.get_u8(),
            seq: b.get_u32_le(),
            len: b.get_u32_le(),
        })
    }
}

/// Checks a transfer id: 1..=MAX_ID_LEN printable ASCII characters, no spaces.
pub fn check_transfer_id(id: &str) -> Result<(), FrameError> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(bad(format!(
            "transfer id must be 1..={MAX_ID_LEN} bytes, got {}",
            id.len()
        )));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad("transfer id must be printable ASCII without spaces"));
    }
    Ok(())
}

/// What a TCP read asks for: bytes `offset..offset+len` of hold `id`'s
/// blocks laid end to end, at resume `epoch`. The reader's stripe makes it,
/// the holder's connection streams it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRange {
    pub id: String,
    pub epoch: u32,
    pub offset: u64,
    pub len: u64,
}

/// A request from a reader or a control client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Renew {
        id: String,
        epoch: u32,
    },
    Release {
        id: String,
    },
    Stat {
        id: String,
    },
    Stats,
    /// Start of a pull: the blocks and keys a reader needs. `window_ms`: how
    /// long the pull may run (its deadline); a one-sided backend's hold is
    /// not freed while a pull's window is open and it has not reported done.
    Describe {
        id: String,
        epoch: u32,
        backend: u8,
        window_ms: u32,
    },
    /// TCP data path: a range of the hold's bytes.
    Read(ReadRange),
    /// End of a complete pull of `bytes`.
    Done {
        id: String,
        epoch: u32,
        bytes: u64,
    },
    /// First frame of a connection from a client that has the secret: its
    /// nonce. A holder with the secret answers [`Reply::Challenge`], one
    /// without it [`Reply::Welcome`] (which such a client refuses).
    Hello {
        nonce: Nonce,
    },
    /// The client's proof over the holder's nonce and its own.
    Proof {
        proof: Proof,
    },
    /// A one-sided pull failed and its gets have stopped: its window closes
    /// (answered with `Done{released: false}`).
    Abort {
        id: String,
    },
    /// Frees several holds in one call (the router releases the holds of
    /// the requests that ended within a few milliseconds together);
    /// answered with one flag per id, in order.
    ReleaseMany {
        ids: Vec<String>,
    },
}

/// One block of a descriptor: its length, remote address and key index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBlock {
    pub len: u64,
    pub addr: u64,
    pub key: u16,
}

/// What a reader needs to pull a hold with the holder's backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub backend: u8,
    pub info: HoldInfo,
    /// Backend-specific: how to reach the holder's data (empty for TCP).
    pub endpoint: Vec<u8>,
    /// Backend-specific remote keys, one per region the hold spans.
    pub keys: Vec<Vec<u8>>,
    pub blocks: Vec<RemoteBlock>,
}

/// A reply from a holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Hold(HoldInfo),
    Released(bool),
    /// Per id of a `ReleaseMany`, in order: whether it was held.
    ReleasedMany(Vec<bool>),
    Stat(Option<HoldInfo>),
    Stats(HolderStats),
    Descriptor(Descriptor),
    /// `len` raw bytes follow this frame.
    Data {
        len: u64,
    },
    Done {
        released: bool,
    },
    /// The handshake is complete (or not needed: a holder without a secret).
    Welcome,
    /// The holder's nonce and its proof over the reader's nonce and its own.
    Challenge {
        nonce: Nonce,
        proof: Proof,
    },
    Error {
        code: u16,
        served: u32,
        asked: u32,
        message: String,
    },
}

impl Reply {
    /// An error reply (message cut to the limit).
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE_LEN {
            let mut cut = MAX_MESSAGE_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self::Error {
            code: code as u16,
            served: 0,
            asked: 0,
            message,
        }
    }
}

// ---- encoding ----

/// A frame being built: header placeholder, then the payload.
struct Out(BytesMut);

impl Out {
    fn new(op: u8, seq: u32) -> Self {
        let mut buf = BytesMut::with_capacity(64);
        buf.put_slice(&MAGIC);
        buf.put_u8(VERSION);
        buf.put_u8(op);
        buf.put_u32_le(seq);
        buf.put_u32_le(0);
        Self(buf)
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.put_u8(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.put_u16_le(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.put_u32_le(v);
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.put_u64_le(v);
        self
    }
    /// Strings are limited by their own field limit; u16 always fits those.
    fn str(&mut self, v: &str) -> &mut Self {
        let v = &v.as_bytes()[..v.len().min(u16::MAX as usize)];
        self.0.put_u16_le(v.len() as u16);
        self.0.put_slice(v);
        self
    }
    fn blob(&mut self, v: &[u8]) -> &mut Self {
        self.0.put_u32_le(v.len() as u32);
        self.0.put_slice(v);
        self
    }
    fn finish(mut self) -> BytesMut {
        let len = (self.0.len() - HEADER_LEN) as u32;
        self.0[8..12].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

fn put_info(out: &mut Out, info: &HoldInfo) {
    out.str(&info.transfer_id)
        .u32(info.blocks)
        .u64(info.bytes)
        .u64(info.expires_in_ms)
        .u32(info.epoch)
        .u32(info.pulls);
}

impl Request {
    pub fn encode(&self, seq: u32) -> BytesMut {
        let mut out;
        match self {
            Request::Renew { id, epoch } => {
                out = Out::new(op::RENEW, seq);
                out.str(id).u32(*epoch);
            }
            Request::Release { id } => {
                out = Out::new(op::RELEASE, seq);
                out.str(id);
            }
            Request::Stat { id } => {
                out = Out::new(op::STAT, seq);
                out.str(id);
            }
            Request::Stats => out = Out::new(op::STATS, seq),
            Request::Describe {
                id,
                epoch,
                backend,
                window_ms,
            } => {
                out = Out::new(op::DESCRIBE, seq);
                out.str(id).u32(*epoch).u8(*backend).u32(*window_ms);
            }
            Request::Read(range) => {
                out = Out::new(op::READ, seq);
                out.str(&range.id)
                    .u32(range.epoch)
                    .u64(range.offset)
                    .u64(range.len);
            }
            Request::Done { id, epoch, bytes } => {
                out = Out::new(op::DONE, seq);
                out.str(id).u32(*epoch).u64(*bytes);
            }
            Request::Hello { nonce } => {
                out = Out::new(op::HELLO, seq);
                out.blob(nonce);
            }
            Request::Proof { proof } => {
                out = Out::new(op::PROOF, seq);
                out.blob(proof);
            }
            Request::Abort { id } => {
                out = Out::new(op::ABORT, seq);
                out.str(id);
            }
            Request::ReleaseMany { ids } => {
                out = Out::new(op::RELEASE_MANY, seq);
                out.u32(ids.len() as u32);
                for id in ids {
                    out.str(id);
                }
            }
        }
        out.finish()
    }

    /// Decodes a request payload of op `op`.
    pub fn decode(op: u8, payload: &[u8]) -> Result<Self, FrameError> {
        let mut r = In(payload);
        let request = match op {
            op::RENEW => Request::Renew {
                id: r.id()?,
                epoch: r.u32()?,
            },
            op::RELEASE => Request::Release { id: r.id()? },
            op::STAT => Request::Stat { id: r.id()? },
            op::STATS => Request::Stats,
            op::DESCRIBE => Request::Describe {
                id: r.id()?,
                epoch: r.u32()?,
                backend: r.u8()?,
                window_ms: r.u32()?,
            },
            op::READ => {
                let (id, epoch, offset, len) = (r.id()?, r.u32()?, r.u64()?, r.u64()?);
                if len > MAX_READ_LEN {
                    return Err(bad(format!(
                        "read of {len} bytes over the limit {MAX_READ_LEN}"
                    )));
                }
                Request::Read(ReadRange {
                    id,
                    epoch,
                    offset,
                    len,
                })
            }
            op::DONE => Request::Done {
                id: r.id()?,
                epoch: r.u32()?,
                bytes: r.u64()?,
            },
            op::HELLO => Request::Hello {
                nonce: r.fixed::<NONCE_LEN>("nonce")?,
            },
            op::PROOF => Request::Proof {
                proof: r.fixed::<PROOF_LEN>("proof")?,
            },
            op::ABORT => Request::Abort { id: r.id()? },
            op::RELEASE_MANY => {
                let n = r.count(MAX_RELEASE_BATCH, "transfer ids")?;
                Request::ReleaseMany {
                    ids: (0..n).map(|_| r.id()).collect::<Result<_, _>>()?,
                }
            }
            other => return Err(bad(format!("unknown request op 0x{other:02x}"))),
        };
        r.end()?;
        Ok(request)
    }

    /// The transfer id the request is about.
    pub fn transfer_id(&self) -> Option<&str> {
        match self {
            Request::Renew { id, .. }
            | Request::Release { id }
            | Request::Stat { id }
            | Request::Describe { id, .. }
            | Request::Read(ReadRange { id, .. })
            | Request::Done { id, .. }
            | Request::Abort { id } => Some(id),
            Request::Stats
            | Request::Hello { .. }
            | Request::Proof { .. }
            | Request::ReleaseMany { .. } => None,
        }
    }

    /// Whether `op` is a request op this version knows.
    pub fn known_op(op: u8) -> bool {
        (op::RENEW..=op::RELEASE_MANY).contains(&op)
    }
}

impl Reply {
    pub fn encode(&self, seq: u32) -> BytesMut {
        let mut out;
        match self {
            Reply::Hold(info) => {
                out = Out::new(op::HOLD, seq);
                put_info(&mut out, info);
            }
            Reply::Released(was) => {
                out = Out::new(op::RELEASED, seq);
                out.u8(u8::from(*was));
            }
            Reply::ReleasedMany(were) => {
                out = Out::new(op::RELEASED_MANY, seq);
                out.u32(were.len() as u32);
                for was in were {
                    out.u8(u8::from(*was));
                }
            }
            Reply::Stat(info) => {
                out = Out::new(op::STAT_REPLY, seq);
                match info {
                    Some(info) => {
                        out.u8(1);
                        put_info(&mut out, info);
                    }
                    None => {
                        out.u8(0);
                    }
                }
            }
            Reply::Stats(s) => {
                out = Out::new(op::STATS_REPLY, seq);
                out.u32(8)
                    .u64(s.holds)
                    .u64(s.held_bytes)
                    .u64(s.pulls)
                    .u64(s.releases)
                    .u64(s.expiries)
                    .u64(s.evictions)
                    .u64(s.stale_epoch_refusals)
                    .u64(s.bytes_served);
            }
            Reply::Descriptor(d) => {
                out = Out::new(op::DESCRIPTOR, seq);
                out.u8(d.backend);
                put_info(&mut out, &d.info);
                out.blob(&d.endpoint).u32(d.keys.len() as u32);
                for key in &d.keys {
                    out.blob(key);
                }
                out.u32(d.blocks.len() as u32);
                for b in &d.blocks {
                    out.u64(b.len).u64(b.addr).u16(b.key);
                }
            }
            Reply::Data { len } => {
                out = Out::new(op::DATA, seq);
                out.u64(*len);
            }
            Reply::Done { released } => {
                out = Out::new(op::DONE_REPLY, seq);
                out.u8(u8::from(*released));
            }
            Reply::Welcome => out = Out::new(op::WELCOME, seq),
            Reply::Challenge { nonce, proof } => {
                out = Out::new(op::CHALLENGE, seq);
                out.blob(nonce).blob(proof);
            }
            Reply::Error {
                code,
                served,
                asked,
                message,
            } => {
                out = Out::new(op::ERROR, seq);
                out.u16(*code).u32(*served).u32(*asked).str(message);
            }
        }
        out.finish()
    }

    /// Decodes a reply payload of op `op`.
    pub fn decode(op: u8, payload: &[u8]) -> Result<Self, FrameError> {
        let mut r = In(payload);
        let reply = match op {
            op::HOLD => Reply::Hold(r.info()?),
            op::RELEASED => Reply::Released(r.flag()?),
            op::RELEASED_MANY => {
                let n = r.count(MAX_RELEASE_BATCH, "release flags")?;
                Reply::ReleasedMany((0..n).map(|_| r.flag()).collect::<Result<_, _>>()?)
            }
            op::STAT_REPLY => Reply::Stat(if r.flag()? { Some(r.info()?) } else { None }),
            op::STATS_REPLY => {
                let fields = r.u32()?;
                if fields != 8 {
                    return Err(bad(format!("stats with {fields} fields, expected 8")));
                }
                Reply::Stats(HolderStats {
                    holds: r.u64()?,
                    held_bytes: r.u64()?,
                    pulls: r.u64()?,
                    releases: r.u64()?,
                    expiries: r.u64()?,
                    evictions: r.u64()?,
                    stale_epoch_refusals: r.u64()?,
                    bytes_served: r.u64()?,
                })
            }
            op::DESCRIPTOR => {
                let backend = r.u8()?;
                if BackendKind::from_code(backend).is_none() {
                    return Err(bad(format!("unknown backend code {backend}")));
                }
                let info = r.info()?;
                let endpoint = r.blob(MAX_ENDPOINT_LEN)?;
                let nkeys = r.count(MAX_KEYS, "keys")?;
                let keys = (0..nkeys)
                    .map(|_| r.blob(MAX_KEY_LEN))
                    .collect::<Result<Vec<_>, _>>()?;
                let nblocks = r.count(MAX_BLOCKS, "blocks")?;
                let mut blocks = Vec::with_capacity(nblocks);
                for _ in 0..nblocks {
                    let block = RemoteBlock {
                        len: r.u64()?,
                        addr: r.u64()?,
                        key: r.u16()?,
                    };
                    if !keys.is_empty() && usize::from(block.key) >= keys.len() {
                        return Err(bad(format!("block key {} out of range", block.key)));
                    }
                    blocks.push(block);
                }
                Reply::Descriptor(Descriptor {
                    backend,
                    info,
                    endpoint,
                    keys,
                    blocks,
                })
            }
            op::DATA => {
                let len = r.u64()?;
                if len > MAX_READ_LEN {
                    return Err(bad(format!("data of {len} bytes over the limit")));
                }
                Reply::Data { len }
            }
            op::DONE_REPLY => Reply::Done {
                released: r.flag()?,
            },
            op::WELCOME => Reply::Welcome,
            op::CHALLENGE => Reply::Challenge {
                nonce: r.fixed::<NONCE_LEN>("nonce")?,
                proof: r.fixed::<PROOF_LEN>("proof")?,
            },
            op::ERROR => Reply::Error {
                code: r.u16()?,
                served: r.u32()?,
                asked: r.u32()?,
                message: r.str(MAX_MESSAGE_LEN)?,
            },
            other => return Err(bad(format!("unknown reply op 0x{other:02x}"))),
        };
        r.end()?;
        Ok(reply)
    }
}

// ---- decoding ----

/// A payload being read; every read checks what is left.
struct In<'a>(&'a [u8]);

impl In<'_> {
    fn need(&self, n: usize, what: &str) -> Result<(), FrameError> {
        if self.0.len() < n {
            return Err(bad(format!(
                "truncated payload: {what} needs {n} bytes, {} left",
                self.0.len()
            )));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        self.need(1, "u8")?;
        Ok(self.0.get_u8())
    }
    fn flag(&mut self) -> Result<bool, FrameError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(bad(format!("flag must be 0 or 1, got {v}"))),
        }
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        self.need(2, "u16")?;
        Ok(self.0.get_u16_le())
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        self.need(4, "u32")?;
        Ok(self.0.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        self.need(8, "u64")?;
        Ok(self.0.get_u64_le())
    }
    fn str(&mut self, max: usize) -> Result<String, FrameError> {
        let len = usize::from(self.u16()?);
        if len > max {
            return Err(bad(format!("string of {len} bytes over the limit {max}")));
        }
        self.need(len, "string")?;
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        String::from_utf8(head.to_vec()).map_err(|_| bad("string is not UTF-8"))
    }
    fn id(&mut self) -> Result<String, FrameError> {
        let id = self.str(MAX_ID_LEN)?;
        check_transfer_id(&id)?;
        Ok(id)
    }
    fn blob(&mut self, max: usize) -> Result<Vec<u8>, FrameError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(bad(format!("blob of {len} bytes over the limit {max}")));
        }
        self.need(len, "blob")?;
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head.to_vec())
    }
    /// A blob of exactly `N` bytes.
    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N], FrameError> {
        let blob = self.blob(N)?;
        blob.try_into()
            .map_err(|_| bad(format!("{what} must be {N} bytes")))
    }
    fn count(&mut self, max: usize, what: &str) -> Result<usize, FrameError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(bad(format!("{n} {what} over the limit {max}")));
        }
        Ok(n)
    }
    fn info(&mut self) -> Result<HoldInfo, FrameError> {
        Ok(HoldInfo {
            transfer_id: self.id()?,
            blocks: self.u32()?,
            bytes: self.u64()?,
            expires_in_ms: self.u64()?,
            epoch: self.u32()?,
            pulls: self.u32()?,
        })
    }
    fn end(&self) -> Result<(), FrameError> {
        if !self.0.is_empty() {
            return Err(bad(format!(
                "{} trailing bytes after the payload",
                self.0.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn split(frame: &[u8]) -> (Header, &[u8]) {
        let header = Header::parse(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(header.len as usize, frame.len() - HEADER_LEN);
        (header, &frame[HEADER_LEN..])
    }

    fn info() -> HoldInfo {
        HoldInfo {
            transfer_id: "xfer-1".into(),
            blocks: 3,
            bytes: 1 << 33,
            expires_in_ms: 59_000,
            epoch: 2,
            pulls: 1,
        }
    }

    #[test]
    fn every_request_and_reply_round_trips() {
        let requests = [
            Request::Renew {
                id: "a".into(),
                epoch: 7,
            },
            Request::Release { id: "a".into() },
            Request::Stat { id: "a".into() },
            Request::Stats,
            Request::Describe {
                id: "a".into(),
                epoch: 1,
                backend: 2,
                window_ms: 30_000,
            },
            Request::Read(ReadRange {
                id: "a".into(),
                epoch: 1,
                offset: 5,
                len: 1 << 30,
            }),
            Request::Done {
                id: "a".into(),
                epoch: 1,
                bytes: 9,
            },
            Request::Hello { nonce: [7; 32] },
            Request::Proof { proof: [9; 32] },
            Request::Abort { id: "a".into() },
            Request::ReleaseMany {
                ids: vec!["a".into(), "b".into()],
            },
            Request::ReleaseMany { ids: vec![] },
        ];
        for (seq, request) in requests.iter().enumerate() {
            let frame = request.encode(seq as u32);
            let (header, payload) = split(&frame);
            assert_eq!((header.version, header.seq), (VERSION, seq as u32));
            assert!(Request::known_op(header.op));
            assert_eq!(&Request::decode(header.op, payload).unwrap(), request);
        }
        let replies = [
            Reply::Hold(info()),
            Reply::Released(true),
            Reply::ReleasedMany(vec![true, false, true]),
            Reply::Stat(None),
            Reply::Stat(Some(info())),
            Reply::Stats(HolderStats {
                holds: 1,
                pulls: 9,
                bytes_served: 1 << 40,
                ..Default::default()
            }),
            Reply::Descriptor(Descriptor {
                backend: 2,
                info: info(),
                endpoint: vec![1, 2, 3],
                keys: vec![vec![9; 100], vec![]],
                blocks: vec![RemoteBlock {
                    len: 4,
                    addr: 0xdead,
                    key: 1,
                }],
            }),
            Reply::Data { len: 1 << 20 },
            Reply::Done { released: false },
            Reply::Welcome,
            Reply::Challenge {
                nonce: [1; 32],
                proof: [2; 32],
            },
            Reply::error(ErrorCode::StaleEpoch, "old"),
        ];
        for reply in &replies {
            let frame = reply.encode(1);
            let (header, payload) = split(&frame);
            assert_eq!(&Reply::decode(header.op, payload).unwrap(), reply);
        }
    }

    #[test]
    fn truncated_oversized_and_trailing_payloads_are_refused() {
        let frame = Request::Read(ReadRange {
            id: "abc".into(),
            epoch: 1,
            offset: 0,
            len: 8,
        })
        .encode(0);
        let (header, payload) = split(&frame);
        for cut in 0..payload.len() {
            assert!(
                Request::decode(header.op, &payload[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut long = payload.to_vec();
        long.push(0);
        assert!(Request::decode(header.op, &long).is_err());
        // An id longer than the limit, or not printable.
        let mut p = Vec::new();
        p.extend_from_slice(&((MAX_ID_LEN + 1) as u16).to_le_bytes());
        p.extend(std::iter::repeat_n(b'a', MAX_ID_LEN + 1));
        assert!(Request::decode(0x02, &p).is_err());
        assert!(Request::decode(0x02, &[2, 0, b'a', b' ']).is_err());
        // Too many blocks in a descriptor: refused before allocating them.
        let mut d = Reply::Descriptor(Descriptor {
            backend: 1,
            info: info(),
            endpoint: vec![],
            keys: vec![],
            blocks: vec![],
        })
        .encode(0)
        .to_vec();
        let n = d.len();
        d[n - 4..].copy_from_slice(&((MAX_BLOCKS + 1) as u32).to_le_bytes());
        assert!(Reply::decode(0x84, &d[HEADER_LEN..]).is_err());
        assert!(Request::decode(0x7f, &[]).is_err());
        // More ids in one ReleaseMany than the limit: refused before reading them.
        let over = ((MAX_RELEASE_BATCH + 1) as u32).to_le_bytes();
        assert!(Request::decode(0x0B, &over).is_err());
        assert!(Reply::decode(0x89, &over).is_err());
        // A nonce or a proof of the wrong length.
        for op in [0x08, 0x09] {
            for len in [0u32, 31, 33] {
                let mut p = len.to_le_bytes().to_vec();
                p.extend(std::iter::repeat_n(1u8, len as usize));
                assert!(Request::decode(op, &p).is_err(), "op {op} len {len}");
            }
        }
        assert!(Header::parse(b"XX\x01\x01\0\0\0\0\0\0\0\0").is_err());
        // The error message is cut to its limit (on a char boundary).
        let long = Reply::error(ErrorCode::Internal, "é".repeat(MAX_MESSAGE_LEN));
        let frame = long.encode(0);
        let (header, payload) = split(&frame);
        assert!(Reply::decode(header.op, payload).is_ok());
    }
}
