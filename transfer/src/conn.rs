//! Frame I/O on one TCP connection, every read and write under a time limit.
//!
//! Shared by the listener and the client so both sides read headers, payloads
//! and raw block bytes the same way.

use crate::error::{Result, TransferError};
use crate::proto::{FrameError, Header, HEADER_LEN, MAX_PAYLOAD, VERSION};
use std::future::Future;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest piece of block bytes moved by one timed read or write, so that a
/// dead peer is noticed within one I/O timeout whatever the transfer size.
pub(crate) const IO_PIECE: usize = 4 << 20;

/// Runs `fut` under `limit`, naming `what` in the timeout error.
pub(crate) async fn timed<T>(
    what: &'static str,
    limit: Duration,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result.map_err(TransferError::Io),
        Err(_) => Err(TransferError::Timeout { what, after: limit }),
    }
}

/// Reads one frame header. `Ok(None)`: the peer closed cleanly between frames.
/// Waits up to `idle` for the first byte, then `io` for the rest.
pub(crate) async fn read_header<S: AsyncRead + Unpin>(
    stream: &mut S,
    idle: Duration,
    io: Duration,
) -> Result<Option<[u8; HEADER_LEN]>> {
    let mut buf = [0u8; HEADER_LEN];
    let first = timed("waiting for a frame", idle, stream.read(&mut buf)).await?;
    if first == 0 {
        return Ok(None);
    }
    timed(
        "reading a frame header",
        io,
        stream.read_exact(&mut buf[first..]),
    )
    .await?;
    Ok(Some(buf))
}

/// Why a header cannot be followed: answered with an error, then the
/// connection is closed (its byte stream cannot be trusted any more).
pub(crate) fn check_header(
    raw: &[u8; HEADER_LEN],
) -> std::result::Result<Header, (crate::proto::ErrorCode, FrameError)> {
    use crate::proto::ErrorCode;
    let header = Header::parse(raw).map_err(|e| (ErrorCode::BadFrame, e))?;
    if header.version != VERSION {
        return Err((
            ErrorCode::BadVersion,
            FrameError(format!(
                "protocol version {} is not supported; this peer speaks {VERSION}",
                header.version
            )),
        ));
    }
    if header.len > MAX_PAYLOAD {
        return Err((
            ErrorCode::TooLarge,
            FrameError(format!(
                "payload of {} bytes over the limit {MAX_PAYLOAD}",
                header.len
            )),
        ));
    }
    Ok(header)
}

/// Reads a payload of `len` bytes (already checked against the limit).
pub(crate) async fn read_payload<S: AsyncRead + Unpin>(
    stream: &mut S,
    len: u32,
    io: Duration,
) -> Result<Vec<u8>> {
    let mut payload = vec![0u8; len as usize];
    timed(
        "reading a frame payload",
        io,
        stream.read_exact(&mut payload),
    )
    .await?;
    Ok(payload)
}

/// Writes a whole frame (or block bytes), piece by piece, each under `io`.
pub(crate) async fn write_all<S: AsyncWrite + Unpin>(
    stream: &mut S,
    bytes: &[u8],
    io: Duration,
) -> Result<()> {
    for piece in bytes.chunks(IO_PIECE) {
        timed("writing", io, stream.write_all(piece)).await?;
    }
    Ok(())
}

/// Fills `dest` from the stream, piece by piece, each under `io`.
pub(crate) async fn read_into<S: AsyncRead + Unpin>(
    stream: &mut S,
    dest: &mut [u8],
    io: Duration,
) -> Result<()> {
    for piece in dest.chunks_mut(IO_PIECE) {
        timed("reading block bytes", io, stream.read_exact(piece)).await?;
    }
    Ok(())
}
