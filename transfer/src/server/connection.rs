//! One accepted connection: frames in, replies out, until the peer goes, a
//! deadline passes or the holder stops. As mini-redis's `Connection`: reading
//! a frame (`read_frame`: the waits, the header's checks, the payload, the
//! decoding) and writing a reply (`write`) are each one method, so that the
//! request loop (`serve`) is a short dispatch.

use super::answer::answer;
use super::handshake::{Admit, Auth};
use super::stream::stream_range;
use super::UNPROVEN_GRACE;
use super::{PeerSlot, Shared, HANDSHAKE_TIMEOUT, IDLE_TIMEOUT, MAX_HANDSHAKE_PAYLOAD};
use crate::conn;
use crate::error::TransferError;
use crate::inbound_idle::{ConnIdle, IdleMark};
use crate::proto::{ErrorCode, Reply, Request};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// One accepted connection and what it holds while served.
pub(crate) struct Connection {
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    idle: ConnIdle,
    _slots: (OwnedSemaphorePermit, PeerSlot),
    accepted: Instant,
    auth: Auth,
    /// Only a connection that has served an op (a pooled one) may be closed
    /// as idle: a new one's first request may be on its way (with a secret,
    /// right after its handshake), and its peer does not retry on a
    /// connection it has just opened. One still unproven after
    /// [`UNPROVEN_GRACE`] may be closed too: a reader proves itself in a
    /// round trip, so it is someone without the secret holding a slot.
    served_op: bool,
    /// The write deadline of the frame being answered (shorter while the
    /// handshake's own deadline runs).
    io: Duration,
}

/// What reading the next frame gave.
enum Incoming {
    /// A request, under its sequence number.
    Request(u32, Request),
    /// A frame the connection survives but cannot serve (an unknown op, a
    /// payload that does not decode): answered with this, then the next frame.
    Answer(u32, Reply),
    /// The end of the connection, after this reply if any: the peer went
    /// away, sent nothing in time or a header that cannot be trusted, or the
    /// holder needs the slot or is stopping.
    Close(Option<(u32, Reply)>),
}

impl Connection {
    pub(crate) fn new(
        shared: Arc<Shared>,
        shutdown: CancellationToken,
        idle: ConnIdle,
        slots: (OwnedSemaphorePermit, PeerSlot),
    ) -> Self {
        let auth = match shared.secret {
            None => Auth::Open,
            Some(_) => Auth::AwaitHello,
        };
        let io = shared.io_timeout;
        Self {
            shared,
            shutdown,
            idle,
            _slots: slots,
            accepted: Instant::now(),
            auth,
            served_op: false,
            io,
        }
    }

    /// Serves the connection's requests until it ends.
    pub(crate) async fn serve(mut self, mut stream: TcpStream) {
        loop {
            let (seq, request) = match self.read_frame(&mut stream).await {
                Incoming::Request(seq, request) => (seq, request),
                Incoming::Answer(seq, reply) => {
                    if self.write(&mut stream, seq, &reply).await.is_err() {
                        return;
                    }
                    continue;
                }
                Incoming::Close(last) => {
                    if let Some((seq, reply)) = last {
                        let _ = self.write(&mut stream, seq, &reply).await;
                    }
                    return;
                }
            };
            match self.dispatch(stream, seq, request).await {
                Some(back) => stream = back,
                None => return,
            }
        }
    }

    /// Serves one request: a handshake step, a `Read` (streamed, taking the
    /// connection and giving it back) or any other op. None: close.
    async fn dispatch(
        &mut self,
        mut stream: TcpStream,
        seq: u32,
        request: Request,
    ) -> Option<TcpStream> {
        let request = match self.auth.admit(self.shared.secret.as_ref(), request) {
            Ok(Admit::Serve(request)) => {
                self.served_op = true;
                request
            }
            Ok(Admit::Answer(reply)) => {
                self.write(&mut stream, seq, &reply).await.ok()?;
                return Some(stream);
            }
            Err(refusal) => {
                tracing::warn!(refusal, "connection refused");
                let reply = Reply::error(ErrorCode::Unauthorized, refusal);
                let _ = self.write(&mut stream, seq, &reply).await;
                return None;
            }
        };
        match request {
            Request::Read(range) => {
                let (shared, shutdown) = (&*self.shared, &self.shutdown);
                match stream_range(stream, shared, shutdown, seq, &range).await {
                    Ok(back) => Some(back),
                    Err(err) => {
                        tracing::debug!(%err, "connection closed while streaming");
                        None
                    }
                }
            }
            other => {
                let reply = answer(&self.shared, other);
                match self.write(&mut stream, seq, &reply).await {
                    Ok(()) => Some(stream),
                    Err(err) => {
                        tracing::debug!(%err, "connection closed while answering");
                        None
                    }
                }
            }
        }
    }

    /// Writes `reply` to request `seq` within the frame's write deadline.
    async fn write(
        &self,
        stream: &mut TcpStream,
        seq: u32,
        reply: &Reply,
    ) -> Result<(), TransferError> {
        conn::write_all(stream, &reply.encode(seq), self.io).await
    }

    /// Reads the next frame: waits for it (idle, or within what is left of
    /// the handshake's time), reads and checks its header, reads its payload
    /// and decodes it.
    async fn read_frame(&mut self, stream: &mut TcpStream) -> Incoming {
        // Until the handshake is done, every wait ends at its deadline.
        let (idle, io) = if self.auth.done() {
            (IDLE_TIMEOUT, self.shared.io_timeout)
        } else {
            let left = HANDSHAKE_TIMEOUT.saturating_sub(self.accepted.elapsed());
            if left.is_zero() {
                tracing::debug!("handshake not completed in time; closing");
                return Incoming::Close(None);
            }
            (left, left.min(self.shared.io_timeout))
        };
        self.io = io;
        let closable_after = if self.served_op {
            Some(Duration::ZERO)
        } else if self.auth.done() {
            None
        } else {
            Some(UNPROVEN_GRACE.saturating_sub(self.accepted.elapsed()))
        };
        if !self.next_frame(stream, idle, closable_after).await {
            return Incoming::Close(None);
        }
        let raw = tokio::select! {
            _ = self.shutdown.cancelled() => return Incoming::Close(None),
            raw = conn::read_header(stream, io, io) => raw,
        };
        let raw = match raw {
            Ok(Some(raw)) => raw,
            Ok(None) => return Incoming::Close(None),
            // A header cut short: tell the peer, if it still listens.
            Err(TransferError::Io(_)) => {
                let reply = Reply::error(ErrorCode::BadFrame, "truncated frame header");
                return Incoming::Close(Some((0, reply)));
            }
            Err(_) => return Incoming::Close(None),
        };
        let seq = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
        let header = match conn::check_header(&raw) {
            Ok(header) => header,
            Err((code, err)) => return Incoming::Close(Some((seq, Reply::error(code, err.0)))),
        };
        if !self.auth.done() && header.len > MAX_HANDSHAKE_PAYLOAD {
            // Nobody unproven makes this side buffer megabytes.
            let reply = Reply::error(ErrorCode::Unauthorized, "handshake first");
            return Incoming::Close(Some((seq, reply)));
        }
        let payload = match conn::read_payload(stream, header.len, io).await {
            Ok(payload) => payload,
            Err(err) => {
                let reply = Reply::error(ErrorCode::BadFrame, format!("truncated frame: {err}"));
                return Incoming::Close(Some((seq, reply)));
            }
        };
        match Request::decode(header.op, &payload) {
            Ok(request) => Incoming::Request(seq, request),
            Err(err) => {
                let code = if Request::known_op(header.op) {
                    ErrorCode::BadFrame
                } else {
                    ErrorCode::UnknownOp
                };
                Incoming::Answer(seq, Reply::error(code, err.0))
            }
        }
    }

    /// Waits for the next frame's first byte within `limit`. `closable_after`:
    /// from when on the wait counts as idle, a connection the holder may close
    /// for a new one (`None`: never). False: close the connection (the peer
    /// closed or sent nothing in time, the holder needed the slot or is
    /// stopping).
    async fn next_frame(
        &self,
        stream: &TcpStream,
        limit: Duration,
        closable_after: Option<Duration>,
    ) -> bool {
        let mut first = [0u8; 1];
        let mut limit = limit;
        if let Some(after) = closable_after.filter(|after| !after.is_zero()) {
            let kept = after.min(limit);
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                peeked = tokio::time::timeout(kept, stream.peek(&mut first)) => {
                    if let Ok(peeked) = peeked {
                        return matches!(peeked, Ok(1..));
                    }
                }
            }
            limit = limit.saturating_sub(kept);
            if limit.is_zero() {
                return false;
            }
        }
        let mark = closable_after.map(|_| self.idle.idle());
        let closing = async {
            match &mark {
                Some(mark) => mark.closing().await,
                None => std::future::pending().await,
            }
        };
        // A peek, not `readable()`: readiness can be left over from the last
        // frame, and a peek consumes nothing, so a closed idle connection
        // never loses a byte of a frame.
        let peeked = tokio::select! {
            _ = self.shutdown.cancelled() => return false,
            _ = closing => {
                tracing::debug!("idle connection closed for a new one");
                return false;
            }
            peeked = tokio::time::timeout(limit, stream.peek(&mut first)) => peeked,
        };
        // A frame arriving as the holder chose this connection is left
        // unread: the peer sees the connection closed and retries.
        mark.is_none_or(IdleMark::busy) && matches!(peeked, Ok(Ok(1..)))
    }
}
