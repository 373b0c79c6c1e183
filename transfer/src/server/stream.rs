//! The TCP data path: a `Read` answered with the held bytes, written straight
//! from the held memory.

use super::answer::error_reply;
use super::{Shared, IDLE_TIMEOUT};
use crate::conn::{self, IO_PIECE};
use crate::error::{Result, TransferError};
use crate::proto::{ReadRange, Reply};
use crate::region::SrcSpan;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Answers a `Read`: a `Data` header, then the bytes straight from the held
/// memory (no copy on this side; the kernel copies into the socket).
/// Takes the connection and gives it back when the answer is complete. The
/// read is counted on the hold until its writer has stopped, and a release
/// meanwhile shuts the socket down (the reader sees a cut stream).
pub(super) async fn stream_range(
    mut stream: TcpStream,
    shared: &Shared,
    shutdown: &CancellationToken,
    seq: u32,
    range: &ReadRange,
) -> Result<TcpStream> {
    let (io, len) = (shared.io_timeout, range.len);
    let (id, epoch, offset) = (&range.id, range.epoch, range.offset);
    let (spans, read) = match shared.holds.read(id, epoch, offset, len, Instant::now()) {
        Ok(found) => found,
        Err(err) => {
            conn::write_all(&mut stream, &error_reply(&err).encode(seq), io).await?;
            return Ok(stream);
        }
    };
    conn::write_all(&mut stream, &Reply::Data { len }.encode(seq), io).await?;
    // Blocks that sit end to end in memory go out as one buffer.
    let mut merged: Vec<SrcSpan> = Vec::with_capacity(spans.len());
    for span in spans {
        if !merged.last_mut().is_some_and(|last| last.try_merge(&span)) {
            merged.push(span);
        }
    }
    let faults = &shared.faults;
    let stream = match (faults.stall_after_bytes, faults.trickle) {
        (None, Some(every)) => {
            // Fault injection: one byte per interval until done or fenced.
            let fenced = read.fenced();
            for span in &merged {
                for byte in span.bytes().chunks(1) {
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        _ = fenced.cancelled() => {
                            return Err(TransferError::Protocol("hold freed".into()));
                        }
                        _ = shutdown.cancelled() => {
                            return Err(TransferError::Protocol("holder stopping".into()));
                        }
                    }
                    conn::write_all(&mut stream, byte, io).await?;
                }
            }
            drop(read);
            stream
        }
        (None, None) if len <= conn::ASYNC_MAX => {
            // A small read: written on the async socket (conn::ASYNC_MAX says
            // why), within one I/O timeout (it is less than one I/O piece),
            // and stopped at once when the hold is freed or the holder stops.
            // The read counts until this arm ends, so the blocks stay the
            // hold's while their bytes are written.
            let fenced = read.fenced();
            let bufs: Vec<&[u8]> = merged.iter().map(SrcSpan::bytes).collect();
            tokio::select! {
                written = conn::timed("moving block bytes", io, conn::write_gather_async(&stream, &bufs)) => written?,
                _ = fenced.cancelled() => {
                    return Err(TransferError::Protocol("hold freed".into()));
                }
                _ = shutdown.cancelled() => {
                    return Err(TransferError::Protocol("holder stopping".into()));
                }
            }
            drop(bufs);
            drop(read);
            stream
        }
        (None, None) => {
            // A reader must take at least one I/O piece per I/O timeout.
            let pieces = u32::try_from(len / IO_PIECE as u64).unwrap_or(u32::MAX);
            let now = Instant::now();
            let deadline = now
                .checked_add(io.saturating_mul(pieces.saturating_add(1)))
                .unwrap_or(now + IDLE_TIMEOUT);
            let fencer = read.fencer();
            let (stream, ()) = conn::blocking(
                stream,
                io,
                deadline,
                |socket| fencer.watch(socket),
                move |stream| {
                    // Owned here: the read counts until this writer stops.
                    let _read = read;
                    let bufs: Vec<&[u8]> = merged.iter().map(SrcSpan::bytes).collect();
                    conn::write_gather(stream, &bufs)
                },
            )
            .await?;
            stream
        }
        (Some(limit), _) => {
            // Fault injection: after `limit` bytes, keep the connection and
            // send nothing more until the holder stops or the hold is freed.
            let fenced = read.fenced();
            for span in &merged {
                for piece in span.bytes().chunks(IO_PIECE) {
                    if shared.streamed.load(Ordering::Relaxed) >= limit {
                        tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = fenced.cancelled() => {}
                        }
                        return Err(TransferError::Protocol("read stopped".into()));
                    }
                    tokio::select! {
                        written = conn::write_all(&mut stream, piece, io) => written?,
                        _ = fenced.cancelled() => {
                            return Err(TransferError::Protocol("hold freed".into()));
                        }
                    }
                    shared
                        .streamed
                        .fetch_add(piece.len() as u64, Ordering::Relaxed);
                }
            }
            drop(read);
            stream
        }
    };
    shared.holds.add_bytes_served(len);
    Ok(stream)
}
