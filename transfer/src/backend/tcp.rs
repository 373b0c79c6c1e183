//! The TCP backend: the holder streams requested byte ranges of a hold.
//!
//! A pull is cut into stripes of the hold's bytes (blocks laid end to end;
//! only the selected blocks' runs when a pull selects some); each stripe is one `Read` request on its own pooled connection to the
//! holder's listener, answered with a `Data` header and the raw bytes. The
//! holder writes straight from the held memory, the reader reads straight into
//! the destination blocks: the only copies are the kernel's.

use super::{Backend, Exposure, Fetch, PullFence};
use crate::client::{AnswerBy, CtrlClient};
use crate::config::BackendKind;
use crate::conn;
use crate::error::{Result, TransferError};
use crate::proto::{ReadRange, Reply, Request};
use crate::region::{DestSpan, RegionEntry};
use futures_util::future::BoxFuture;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// Smallest stripe worth its own connection.
const MIN_STRIPE: u64 = 16 << 20;

pub(crate) struct TcpBackend;

impl Backend for TcpBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Tcp
    }

    fn expose(&self, _region: &RegionEntry) -> Result<Exposure> {
        Ok(Exposure::default())
    }

    fn endpoint(&self) -> Vec<u8> {
        Vec::new()
    }

    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>> {
        Box::pin(fetch(job))
    }
}

/// How many stripes a pull of `total` bytes is cut into.
fn stripes(total: u64, max_streams: usize) -> u64 {
    (total / MIN_STRIPE).clamp(1, max_streams.max(1) as u64)
}

async fn fetch(job: Fetch<'_>) -> Result<u32> {
    let total: u64 = job.ranges.iter().map(|&(_, len)| len).sum();
    if total == 0 {
        return Ok(0);
    }
    let stripe = total.div_ceil(stripes(total, job.max_streams));
    // Each range of the hold (all of it, or the selected blocks' runs) is cut
    // into stripes of at most `stripe` bytes, each with its destination
    // pieces; at most `max_streams` of them are read at once.
    let mut dest = job.dest.into_iter();
    let mut current: Option<DestSpan> = None;
    let mut queue = VecDeque::new();
    for &(start, len) in &job.ranges {
        let mut offset = start;
        while offset < start + len {
            let part = stripe.min(start + len - offset);
            let mut pieces = Vec::new();
            let mut need = part as usize;
            while need > 0 {
                let mut span = match current.take() {
                    Some(span) => span,
                    None => dest.next().ok_or_else(|| {
                        TransferError::SizeMismatch("destination shorter than the hold".into())
                    })?,
                };
                if span.len > need {
                    pieces.push(span.split_front(need));
                    need = 0;
                    current = Some(span);
                } else {
                    need -= span.len;
                    pieces.push(span);
                }
            }
            queue.push_back((offset, part, pieces));
            offset += part;
        }
    }
    let count = queue.len() as u32;
    let stripe_of = |offset: u64, len: u64| Stripe {
        ctrl: job.ctrl.clone(),
        addr: job.remote_ctrl.to_string(),
        range: ReadRange {
            id: job.transfer_id.to_string(),
            epoch: job.epoch,
            offset,
            len,
        },
        io: job.io_timeout,
        deadline: job.deadline,
        fence: job.fence.clone(),
    };
    // The tasks own their destination spans (and so the claim): if this
    // future is dropped, the fence is cut, and the claim is released only
    // once their blocking reads have returned. Stripes not started yet are
    // written by nobody.
    let mut tasks = JoinSet::new();
    let in_flight = job.max_streams.max(1);
    while tasks.len() < in_flight {
        let Some((offset, len, pieces)) = queue.pop_front() else {
            break;
        };
        tasks.spawn(read_stripe(stripe_of(offset, len), pieces));
    }
    // On a failure or at the deadline, the other stripes are still waited
    // for (the fence shuts their sockets down, so they end at once), so that
    // when a pull returns, nothing writes into its destination any more.
    let mut failed = None;
    let mut past_deadline = false;
    loop {
        let joined = tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(joined) => joined,
                None => break,
            },
            _ = tokio::time::sleep_until(job.deadline.into()), if !past_deadline => {
                past_deadline = true;
                job.fence.cut();
                queue.clear();
                continue;
            }
        };
        let err = match joined {
            Ok(Ok(())) => {
                if let Some((offset, len, pieces)) = queue.pop_front() {
                    tasks.spawn(read_stripe(stripe_of(offset, len), pieces));
                }
                continue;
            }
            Ok(Err(err)) => err,
            Err(err) => TransferError::Protocol(format!("stripe task failed: {err}")),
        };
        if failed.is_none() {
            // The first failure stops the other stripes too.
            job.fence.cut();
            queue.clear();
            failed = Some(err);
        }
    }
    if past_deadline || Instant::now() >= job.deadline {
        return Err(TransferError::Timeout {
            what: "pulling a hold (deadline)",
            after: job.io_timeout,
        });
    }
    if let Some(err) = failed {
        return Err(err);
    }
    Ok(count)
}

/// One stripe's request: a range of the hold's bytes.
struct Stripe {
    ctrl: CtrlClient,
    addr: String,
    range: ReadRange,
    io: Duration,
    deadline: Instant,
    fence: Arc<PullFence>,
}

async fn read_stripe(stripe: Stripe, pieces: Vec<DestSpan>) -> Result<()> {
    // Destination blocks that sit end to end in memory are read as one buffer.
    let mut merged: Vec<DestSpan> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        if !merged.last_mut().is_some_and(|last| last.try_merge(&piece)) {
            merged.push(piece);
        }
    }
    let mut pieces = merged;
    let Stripe {
        ctrl,
        addr,
        range,
        io,
        deadline,
        fence,
    } = stripe;
    let len = range.len;
    let request = Request::Read(range);
    let answer_by = AnswerBy::Deadline(deadline);
    let asked = Instant::now();
    let opened =
        tokio::time::timeout_at(deadline.into(), ctrl.open(&addr, &request, answer_by)).await;
    // The wait ran to the pull's deadline, not one I/O timeout: say how long.
    let (mut conn, reply) = opened.map_err(|_| TransferError::Timeout {
        what: "asking for block bytes",
        after: asked.elapsed(),
    })??;
    match reply {
        Reply::Data { len: got } if got == len => {}
        other => {
            return Err(TransferError::Protocol(format!(
                "expected {len} data bytes, got {other:?}"
            )))
        }
    }
    if len <= conn::ASYNC_MAX {
        // A small stripe: read on the async socket (conn::ASYNC_MAX says
        // why), within one I/O timeout and the pull's deadline, and stopped
        // at once by the fence. The destination is written only while this
        // future runs, and it owns the destination spans.
        let stream = conn.take_stream()?;
        let limit = io.min(deadline.saturating_duration_since(Instant::now()));
        let mut bufs: Vec<&mut [u8]> = pieces.iter_mut().map(DestSpan::as_mut).collect();
        let moved = tokio::select! {
            read = conn::timed("moving block bytes", limit, conn::read_scatter_async(&stream, &mut bufs)) => read,
            () = fence.cancelled() => Err(TransferError::Protocol("pull cut".into())),
        };
        drop(bufs);
        moved?;
        conn.put_stream(stream);
        conn.finish();
        return Ok(());
    }
    let mut watched = None;
    let moved = conn::blocking(
        conn.take_stream()?,
        io,
        deadline,
        |socket| {
            watched = Some(fence.watch(socket)?);
            Ok(())
        },
        move |stream| {
            let mut bufs: Vec<&mut [u8]> = pieces.iter_mut().map(DestSpan::as_mut).collect();
            conn::read_scatter(stream, &mut bufs)
        },
    )
    .await;
    if let Some(key) = watched {
        fence.unwatch(key);
    }
    let (stream, ()) = moved?;
    if fence.is_cut() {
        // Shut down under us: not a connection for the pool.
        return Err(TransferError::Protocol("pull cut".into()));
    }
    conn.put_stream(stream);
    conn.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_pulls_use_several_streams_small_ones_one() {
        assert_eq!(stripes(4096, 4), 1);
        assert_eq!(stripes(MIN_STRIPE * 2, 4), 2);
        assert_eq!(stripes(256 << 20, 4), 4);
        assert_eq!(stripes(256 << 20, 0), 1);
    }

    #[test]
    fn tcp_never_claims_device_memory() {
        // It reads and writes raw host addresses: a device pointer must be
        // staged through host memory by the engine, never handed to it.
        assert!(!TcpBackend.device_memory());
    }
}
