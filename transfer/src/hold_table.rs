//! The hold table: transfer id -> held blocks with a lease, plus the counters.
//!
//! A hold's blocks go back to the engine ([`HoldTable::take_freed`]) only once
//! nothing reads them any more: every TCP read streaming from them holds a
//! [`ReadGuard`], and a one-sided pull (UCX, Mooncake) counts from its
//! `describe` until its `done` or the end of the window its reader announced.
//! A release, expiry or eviction takes the hold out of the table at once (no
//! new read can start) and fences the reads in flight (their sockets are shut
//! down, their stall waits cancelled); the id is reported freed when the last
//! of them has stopped.
//!
//! Every rule about a hold's life lives here and nowhere else: a lease renewed
//! by every pull and renew, expiry, release (explicit or after the first
//! complete pull), the byte budget that evicts the oldest holds, and the epoch
//! check that refuses a replay older than one the hold has served. The table is
//! plain synchronous code under one mutex, so it is tested without sockets.

use crate::config::ReleaseMode;
use crate::error::{Result, TransferError};
use crate::proto;
use crate::region::SrcSpan;
use crate::stats::{HoldInfo, HolderStats};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Most freed ids kept for [`HoldTable::take_freed`] when nobody collects them.
const MAX_FREED: usize = 65_536;

struct Hold {
    seq: u64,
    spans: Vec<SrcSpan>,
    bytes: u64,
    deadline: Instant,
    served_epoch: u32,
    pulls: u32,
    reads: Reads,
}

/// A TCP read streaming from a hold: how to stop it.
struct ReadFence {
    /// A handle of the socket its blocking writer uses, once it has one.
    socket: Option<std::net::TcpStream>,
    /// Cancelled by the fence (wakes a writer waiting asynchronously).
    token: CancellationToken,
}

/// The reads in flight on one hold.
#[derive(Default)]
struct Reads {
    streams: HashMap<u64, ReadFence>,
    /// Ends of the windows of one-sided pulls described and not yet done.
    windows: Vec<Instant>,
}

impl Reads {
    /// Stops what can be stopped: shuts the TCP reads' sockets down.
    fn fence(&mut self) {
        for read in self.streams.values_mut() {
            read.token.cancel();
            if let Some(socket) = read.socket.take() {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Whether a read may still touch the blocks at `now`.
    fn active(&mut self, now: Instant) -> bool {
        self.windows.retain(|end| *end > now);
        !self.streams.is_empty() || !self.windows.is_empty()
    }
}

#[derive(Default)]
struct Inner {
    holds: HashMap<String, Hold>,
    /// Holds taken out of the table whose reads have not all stopped yet.
    draining: HashMap<String, Reads>,
    next_read: u64,
    /// Creation order, for eviction: seq -> transfer id.
    order: BTreeMap<u64, String>,
    next_seq: u64,
    stats: HolderStats,
    freed: VecDeque<String>,
}

/// Why a hold left the table.
#[derive(Clone, Copy)]
enum Gone {
    Released,
    Expired,
    Evicted,
}

impl Inner {
    /// Takes a hold out of the table; its id is reported freed once its reads
    /// in flight (fenced here) have stopped.
    fn remove(&mut self, id: &str, why: Gone, now: Instant) -> bool {
        let Some(mut hold) = self.holds.remove(id) else {
            return false;
        };
        hold.reads.fence();
        if hold.reads.active(now) {
            self.draining.insert(id.to_string(), hold.reads);
        } else {
            self.push_freed(id);
        }
        self.order.remove(&hold.seq);
        self.stats.holds -= 1;
        self.stats.held_bytes -= hold.bytes;
        match why {
            Gone::Released => self.stats.releases += 1,
            Gone::Expired => self.stats.expiries += 1,
            Gone::Evicted => self.stats.evictions += 1,
        }
        true
    }

    fn push_freed(&mut self, id: &str) {
        if self.freed.len() >= MAX_FREED {
            self.freed.pop_front();
        }
        self.freed.push_back(id.to_string());
    }

    /// Reports the draining holds whose last read has stopped.
    fn settle(&mut self, now: Instant) {
        let done: Vec<String> = self
            .draining
            .iter_mut()
            .filter_map(|(id, reads)| (!reads.active(now)).then(|| id.clone()))
            .collect();
        for id in done {
            self.draining.remove(&id);
            self.push_freed(&id);
        }
    }

    /// The reads of hold `id`, live or draining.
    fn reads(&mut self, id: &str) -> Option<&mut Reads> {
        match self.holds.get_mut(id) {
            Some(hold) => Some(&mut hold.reads),
            None => self.draining.get_mut(id),
        }
    }

    /// Closes the window of one one-sided pull of `id` (the one that ends
    /// first: they are alike), then reports the hold if that was its last read.
    fn close_window(&mut self, id: &str, now: Instant) -> bool {
        let closed = self.reads(id).is_some_and(|reads| {
            let first = reads
                .windows
                .iter()
                .enumerate()
                .min_by_key(|(_, end)| **end)
                .map(|(i, _)| i);
            first.map(|i| reads.windows.swap_remove(i)).is_some()
        });
        self.settle(now);
        closed
    }

    /// A TCP read ended.
    fn end_read(&mut self, id: &str, key: u64, now: Instant) {
        if let Some(reads) = self.reads(id) {
            reads.streams.remove(&key);
        }
        if self.draining.contains_key(id) {
            self.settle(now);
        }
    }
    /// The live hold `id`, expiring it first if its lease ran out.
    fn live(&mut self, id: &str, now: Instant) -> Result<&mut Hold> {
        let expired = match self.holds.get(id) {
            None => true,
            Some(hold) if hold.deadline <= now => {
                self.remove(id, Gone::Expired, now);
                true
            }
            Some(_) => false,
        };
        match self.holds.get_mut(id) {
            Some(hold) if !expired => Ok(hold),
            _ => Err(TransferError::HoldNotFound {
                transfer_id: id.to_string(),
            }),
        }
    }

    /// `live` + the epoch checks + a renewed lease.
    fn serve(
        &mut self,
        id: &str,
        epoch: u32,
        now: Instant,
        lease: Duration,
        max_epoch: u32,
    ) -> Result<&mut Hold> {
        let hold = self.live(id, now)?;
        if epoch > max_epoch {
            return Err(TransferError::EpochOutOfRange {
                asked: epoch,
                max: max_epoch,
            });
        }
        if epoch < hold.served_epoch {
            let served = hold.served_epoch;
            self.stats.stale_epoch_refusals += 1;
            return Err(TransferError::StaleEpoch {
                served,
                asked: epoch,
            });
        }
        let hold = self.live(id, now)?;
        hold.served_epoch = epoch;
        hold.deadline = now + lease;
        Ok(hold)
    }
}

fn info(id: &str, hold: &Hold, now: Instant) -> HoldInfo {
    HoldInfo {
        transfer_id: id.to_string(),
        blocks: hold.spans.len() as u32,
        bytes: hold.bytes,
        expires_in_ms: hold.deadline.saturating_duration_since(now).as_millis() as u64,
        epoch: hold.served_epoch,
        pulls: hold.pulls,
    }
}

/// All holds of one holder.
pub(crate) struct HoldTable {
    inner: Arc<Mutex<Inner>>,
    lease: Duration,
    release: ReleaseMode,
    budget: Option<u64>,
    max_epoch: u32,
}

impl HoldTable {
    pub(crate) fn new(lease: Duration, release: ReleaseMode, budget: Option<u64>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner::default())),
            lease,
            release,
            budget,
            max_epoch: crate::config::DEFAULT_MAX_EPOCH,
        }
    }

    /// The highest resume epoch a hold accepts.
    pub(crate) fn with_max_epoch(mut self, max_epoch: u32) -> Self {
        self.max_epoch = max_epoch;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// Adds a hold, evicting the oldest ones when the budget requires it.
    pub(crate) fn create(&self, id: &str, spans: Vec<SrcSpan>, now: Instant) -> Result<()> {
        proto::check_transfer_id(id).map_err(|e| TransferError::InvalidArgument(e.to_string()))?;
        if spans.len() > proto::MAX_BLOCKS {
            return Err(TransferError::InvalidArgument(format!(
                "a hold has at most {} blocks, got {}",
                proto::MAX_BLOCKS,
                spans.len()
            )));
        }
        let bytes: u64 = spans.iter().map(|s| s.len() as u64).sum();
        let mut inner = self.lock();
        // An expired hold of the same id is gone, not a conflict; one whose
        // reads are still stopping is.
        let _ = inner.live(id, now);
        if inner.holds.contains_key(id) || inner.draining.contains_key(id) {
            return Err(TransferError::HoldExists(id.to_string()));
        }
        if let Some(budget) = self.budget {
            if bytes > budget {
                return Err(TransferError::OverBudget { bytes, budget });
            }
            while inner.stats.held_bytes + bytes > budget {
                let Some((_, oldest)) = inner.order.pop_first() else {
                    break;
                };
                inner.remove(&oldest, Gone::Evicted, now);
            }
        }
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.order.insert(seq, id.to_string());
        inner.holds.insert(
            id.to_string(),
            Hold {
                seq,
                spans,
                bytes,
                deadline: now + self.lease,
                served_epoch: 0,
                pulls: 0,
                reads: Reads::default(),
            },
        );
        inner.stats.holds += 1;
        inner.stats.held_bytes += bytes;
        Ok(())
    }

    /// Extends the lease (refusing a stale epoch).
    pub(crate) fn renew(&self, id: &str, epoch: u32, now: Instant) -> Result<HoldInfo> {
        let mut inner = self.lock();
        let hold = inner.serve(id, epoch, now, self.lease, self.max_epoch)?;
        Ok(info(id, hold, now))
    }

    /// Frees a hold; false when it was not held (release is idempotent).
    pub(crate) fn release(&self, id: &str, now: Instant) -> bool {
        self.lock().remove(id, Gone::Released, now)
    }

    /// Frees several holds under one lock; per id, whether it was held.
    pub(crate) fn release_many(&self, ids: &[String], now: Instant) -> Vec<bool> {
        let mut inner = self.lock();
        ids.iter()
            .map(|id| inner.remove(id, Gone::Released, now))
            .collect()
    }

    /// The hold as it is now, without renewing it.
    pub(crate) fn stat(&self, id: &str, now: Instant) -> Option<HoldInfo> {
        let mut inner = self.lock();
        let hold = inner.live(id, now).ok()?;
        Some(info(id, hold, now))
    }

    /// Start of a pull: the hold's blocks, lease renewed. `window`: a
    /// one-sided pull reads the blocks without the holder until it is done or
    /// this long has passed, so the hold counts it as a read meanwhile.
    pub(crate) fn describe(
        &self,
        id: &str,
        epoch: u32,
        window: Option<Duration>,
        now: Instant,
    ) -> Result<(HoldInfo, Vec<SrcSpan>)> {
        let mut inner = self.lock();
        let hold = inner.serve(id, epoch, now, self.lease, self.max_epoch)?;
        if let Some(window) = window {
            hold.reads.windows.push(now + window);
        }
        Ok((info(id, hold, now), hold.spans.clone()))
    }

    /// The spans covering bytes `offset..offset+len` of the hold (blocks laid
    /// end to end), lease renewed, and the guard that counts the read until
    /// it drops.
    pub(crate) fn read(
        &self,
        id: &str,
        epoch: u32,
        offset: u64,
        len: u64,
        now: Instant,
    ) -> Result<(Vec<SrcSpan>, ReadGuard)> {
        let mut inner = self.lock();
        let key = inner.next_read;
        inner.next_read += 1;
        let hold = inner.serve(id, epoch, now, self.lease, self.max_epoch)?;
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= hold.bytes)
            .ok_or_else(|| {
                TransferError::InvalidArgument(format!(
                    "range {offset}+{len} is outside the hold's {} bytes",
                    hold.bytes
                ))
            })?;
        let mut out = Vec::new();
        let mut at = 0u64;
        for span in &hold.spans {
            let (start, stop) = (at, at + span.len() as u64);
            at = stop;
            if stop <= offset || span.len() == 0 {
                continue;
            }
            if start >= end {
                break;
            }
            let from = offset.max(start) - start;
            let to = end.min(stop) - start;
            out.push(span.slice(from as usize, (to - from) as usize));
        }
        let token = CancellationToken::new();
        hold.reads.streams.insert(
            key,
            ReadFence {
                socket: None,
                token: token.clone(),
            },
        );
        let guard = ReadGuard {
            table: self.inner.clone(),
            id: id.to_string(),
            key,
            token,
        };
        Ok((out, guard))
    }

    /// End of a complete pull: counts it, and frees the hold in `after_pull`
    /// mode. Refused when a newer epoch took the hold over meanwhile (the bytes
    /// the reader got may then be torn). Returns whether the hold was freed.
    pub(crate) fn finish_pull(&self, id: &str, epoch: u32, now: Instant) -> Result<bool> {
        let mut inner = self.lock();
        // A one-sided pull's window closes with its done, whatever it says.
        inner.close_window(id, now);
        let hold = inner.serve(id, epoch, now, self.lease, self.max_epoch)?;
        hold.pulls += 1;
        inner.stats.pulls += 1;
        Ok(self.release == ReleaseMode::AfterPull && inner.remove(id, Gone::Released, now))
    }

    /// A one-sided pull failed and its gets have stopped: closes its window.
    /// Returns whether the hold had one open.
    pub(crate) fn abort_pull(&self, id: &str, now: Instant) -> bool {
        self.lock().close_window(id, now)
    }

    /// Drops every hold whose lease ran out.
    pub(crate) fn sweep(&self, now: Instant) {
        let mut inner = self.lock();
        let expired: Vec<String> = inner
            .holds
            .iter()
            .filter(|(_, hold)| hold.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            inner.remove(&id, Gone::Expired, now);
        }
        inner.settle(now);
    }

    pub(crate) fn add_bytes_served(&self, bytes: u64) {
        self.lock().stats.bytes_served += bytes;
    }

    pub(crate) fn stats(&self) -> HolderStats {
        self.lock().stats
    }

    /// Ids freed (released, expired, evicted) and no longer read since the
    /// last call.
    pub(crate) fn take_freed(&self, now: Instant) -> Vec<String> {
        let mut inner = self.lock();
        inner.settle(now);
        inner.freed.drain(..).collect()
    }

    /// Holds taken out of the table whose reads are still stopping.
    pub(crate) fn draining(&self) -> usize {
        self.lock().draining.len()
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts one TCP read of a hold until it drops (moved into the blocking
/// writer, so it drops when the writer has stopped, even if the connection's
/// task was aborted).
pub(crate) struct ReadGuard {
    table: Arc<Mutex<Inner>>,
    id: String,
    key: u64,
    token: CancellationToken,
}

impl ReadGuard {
    /// Cancelled when the hold is freed under the read.
    pub(crate) fn fenced(&self) -> CancellationToken {
        self.token.clone()
    }

    /// What registers the writer's socket with the read (see [`ReadFencer`]).
    pub(crate) fn fencer(&self) -> ReadFencer {
        ReadFencer {
            table: self.table.clone(),
            id: self.id.clone(),
            key: self.key,
        }
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        lock(&self.table).end_read(&self.id, self.key, Instant::now());
    }
}

/// Gives a read's socket to the hold, so that freeing the hold shuts it down.
pub(crate) struct ReadFencer {
    table: Arc<Mutex<Inner>>,
    id: String,
    key: u64,
}

impl ReadFencer {
    /// Refused (and the socket shut down) when the hold was freed already.
    pub(crate) fn watch(self, socket: std::net::TcpStream) -> Result<()> {
        let mut inner = lock(&self.table);
        let live = inner.holds.contains_key(&self.id);
        match inner
            .reads(&self.id)
            .and_then(|r| r.streams.get_mut(&self.key))
        {
            Some(read) if live => {
                read.socket = Some(socket);
                Ok(())
            }
            _ => {
                let _ = socket.shutdown(std::net::Shutdown::Both);
                Err(TransferError::HoldNotFound {
                    transfer_id: self.id,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::region::{BlockRef, Region, RegionTable};

    fn spans(table: &RegionTable, sizes: &[u64]) -> Vec<SrcSpan> {
        let total = sizes.iter().sum::<u64>() as usize;
        let bytes: Vec<u8> = (0..total).map(|i| i as u8).collect();
        let id = table.register(Region::owned(bytes)).id;
        let mut at = 0;
        let blocks: Vec<BlockRef> = sizes
            .iter()
            .map(|&len| {
                let b = BlockRef::new(id, at, len);
                at += len;
                b
            })
            .collect();
        table.spans(&blocks).unwrap()
    }

    const LEASE: Duration = Duration::from_secs(10);

    /// A table whose holds go on release, holding at most `budget` bytes; the
    /// regions its holds are made of, and the time it starts at.
    fn new_table(budget: Option<u64>) -> (RegionTable, HoldTable, Instant) {
        let table = HoldTable::new(LEASE, ReleaseMode::OnRelease, budget);
        (RegionTable::default(), table, Instant::now())
    }

    #[test]
    fn lease_is_renewed_by_pulls_and_renews_and_expires_otherwise() {
        let (regions, table, t0) = new_table(None);
        table.create("a", spans(&regions, &[4, 4]), t0).unwrap();
        table.create("b", spans(&regions, &[4]), t0).unwrap();
        // A renew at 8 s and a pull at 16 s keep "a"; "b" expires at 10 s.
        table.renew("a", 0, t0 + Duration::from_secs(8)).unwrap();
        assert_eq!(table.stat("b", t0 + Duration::from_secs(10)), None);
        let (info, spans) = table
            .describe("a", 0, None, t0 + Duration::from_secs(16))
            .unwrap();
        assert_eq!((info.blocks, info.bytes, spans.len()), (2, 8, 2));
        assert_eq!(info.expires_in_ms, 10_000);
        assert!(table.stat("a", t0 + Duration::from_secs(25)).is_some());
        table.sweep(t0 + Duration::from_secs(26));
        let stats = table.stats();
        assert_eq!((stats.holds, stats.held_bytes, stats.expiries), (0, 0, 2));
        assert!(matches!(
            table.renew("a", 0, t0 + Duration::from_secs(27)),
            Err(TransferError::HoldNotFound { .. })
        ));
        let mut freed = table.take_freed(t0 + Duration::from_secs(26));
        freed.sort();
        assert_eq!(freed, ["a", "b"]);
        assert!(table.take_freed(t0 + Duration::from_secs(26)).is_empty());
    }

    #[test]
    fn release_is_idempotent_and_after_pull_frees_on_the_first_complete_pull() {
        let (regions, table, now) = new_table(None);
        table.create("a", spans(&regions, &[8]), now).unwrap();
        assert!(!table.finish_pull("a", 0, now).unwrap());
        assert!(table.release("a", now));
        assert!(!table.release("a", now));
        assert_eq!(table.stats().releases, 1);
        assert_eq!(table.stats().pulls, 1);

        let table = HoldTable::new(LEASE, ReleaseMode::AfterPull, None);
        table.create("a", spans(&regions, &[8]), now).unwrap();
        // A started pull does not free it; the finished one does.
        table.describe("a", 0, None, now).unwrap();
        assert!(table.stat("a", now).is_some());
        assert!(table.finish_pull("a", 0, now).unwrap());
        assert_eq!(table.stat("a", now), None);
        assert_eq!(table.take_freed(now), ["a"]);
    }

    #[test]
    fn budget_evicts_the_oldest_holds_and_counts_them() {
        let (regions, table, now) = new_table(Some(100));
        table.create("a", spans(&regions, &[40]), now).unwrap();
        table.create("b", spans(&regions, &[40]), now).unwrap();
        table.create("c", spans(&regions, &[50]), now).unwrap();
        assert_eq!(table.stat("a", now), None);
        assert!(table.stat("b", now).is_some() && table.stat("c", now).is_some());
        table.create("d", spans(&regions, &[60]), now).unwrap();
        let stats = table.stats();
        // b (40) and c (50) both had to go to fit d (60) under 100.
        assert_eq!((stats.evictions, stats.holds, stats.held_bytes), (3, 1, 60));
        assert!(matches!(
            table.create("e", spans(&regions, &[101]), now),
            Err(TransferError::OverBudget { .. })
        ));
        assert!(matches!(
            table.create("d", spans(&regions, &[1]), now),
            Err(TransferError::HoldExists(_))
        ));
    }

    #[test]
    fn stale_epochs_are_refused_and_counted() {
        let (regions, table, now) = new_table(None);
        table.create("a", spans(&regions, &[8]), now).unwrap();
        table.describe("a", 0, None, now).unwrap();
        table.renew("a", 2, now).unwrap();
        assert!(matches!(
            table.describe("a", 1, None, now),
            Err(TransferError::StaleEpoch {
                served: 2,
                asked: 1
            })
        ));
        assert!(matches!(
            table.renew("a", 0, now),
            Err(TransferError::StaleEpoch {
                served: 2,
                asked: 0
            })
        ));
        // A pull of epoch 1 that started before epoch 2 was served cannot finish.
        assert!(table.finish_pull("a", 1, now).is_err());
        assert_eq!(table.renew("a", 2, now).unwrap().epoch, 2);
        assert_eq!(table.stats().stale_epoch_refusals, 3);
        // Nobody pushes a hold past the resume bound (and so locks it out).
        let table = table.with_max_epoch(3);
        assert!(matches!(
            table.renew("a", u32::MAX, now),
            Err(TransferError::EpochOutOfRange {
                asked: u32::MAX,
                max: 3
            })
        ));
        assert_eq!(table.renew("a", 3, now).unwrap().epoch, 3);
    }

    #[test]
    fn reads_map_byte_ranges_onto_blocks() {
        let (regions, table, now) = new_table(None);
        table
            .create("a", spans(&regions, &[4, 0, 6, 5]), now)
            .unwrap();
        let got: Vec<u8> = table
            .read("a", 0, 2, 10, now)
            .unwrap()
            .0
            .iter()
            .flat_map(|s| s.bytes().to_vec())
            .collect();
        assert_eq!(got, (2..12).collect::<Vec<u8>>());
        assert!(table.read("a", 0, 10, 6, now).is_err());
        assert!(table.read("a", 0, u64::MAX, 2, now).is_err());
        assert_eq!(table.read("a", 0, 15, 0, now).unwrap().0.len(), 0);
    }

    #[test]
    fn a_freed_hold_is_reported_only_when_its_last_read_stopped() {
        let (regions, table, now) = new_table(Some(100));
        table.create("a", spans(&regions, &[8]), now).unwrap();
        let (_, first) = table.read("a", 0, 0, 8, now).unwrap();
        let (_, second) = table.read("a", 0, 0, 4, now).unwrap();
        let fenced = first.fenced();
        assert!(table.release("a", now));
        // Out of the table at once (no new read, no renew), but not freed.
        assert!(table.stat("a", now).is_none());
        assert!(table.read("a", 0, 0, 8, now).is_err());
        assert!(fenced.is_cancelled(), "the reads in flight are fenced");
        assert!(table.take_freed(now).is_empty());
        assert_eq!(table.draining(), 1);
        // The id cannot be held again while its old blocks are read.
        assert!(matches!(
            table.create("a", spans(&regions, &[8]), now),
            Err(TransferError::HoldExists(_))
        ));
        drop(first);
        assert!(table.take_freed(now).is_empty());
        drop(second);
        assert_eq!(table.take_freed(now), ["a"]);
        assert_eq!(table.draining(), 0);
        // Expiry and eviction wait for reads the same way.
        table.create("b", spans(&regions, &[60]), now).unwrap();
        let (_, read) = table.read("b", 0, 0, 60, now).unwrap();
        table.create("c", spans(&regions, &[60]), now).unwrap();
        assert_eq!(table.stats().evictions, 1);
        assert!(table.take_freed(now).is_empty());
        drop(read);
        assert_eq!(table.take_freed(now), ["b"]);
        let (_, read) = table.read("c", 0, 0, 60, now).unwrap();
        table.sweep(now + LEASE);
        assert!(table.take_freed(now + LEASE).is_empty());
        drop(read);
        assert_eq!(table.take_freed(now + LEASE), ["c"]);
    }

    #[test]
    fn a_one_sided_pull_holds_the_blocks_until_done_or_its_window_ends() {
        let (regions, table, now) = new_table(None);
        let window = Some(Duration::from_secs(5));
        table.create("a", spans(&regions, &[8]), now).unwrap();
        table.describe("a", 0, window, now).unwrap();
        table.release("a", now);
        assert!(table.take_freed(now).is_empty());
        // Its done (refused: the hold is gone) closes the window.
        assert!(table.finish_pull("a", 0, now).is_err());
        assert_eq!(table.take_freed(now), ["a"]);
        // One whose pull failed says so (abort): freed at once.
        table.create("c", spans(&regions, &[8]), now).unwrap();
        table.describe("c", 0, window, now).unwrap();
        table.release("c", now);
        assert!(table.take_freed(now).is_empty());
        assert!(table.abort_pull("c", now));
        assert!(!table.abort_pull("c", now));
        assert_eq!(table.take_freed(now), ["c"]);
        // A reader that never says done: freed when its window ends.
        table.create("b", spans(&regions, &[8]), now).unwrap();
        table.describe("b", 0, window, now).unwrap();
        table.release("b", now);
        assert!(table.take_freed(now + Duration::from_secs(4)).is_empty());
        assert_eq!(table.take_freed(now + Duration::from_secs(5)), ["b"]);
    }

    #[test]
    fn bad_transfer_ids_are_refused() {
        let regions = RegionTable::default();
        let table = HoldTable::new(LEASE, ReleaseMode::OnRelease, None);
        for bad in ["", "a b", &"x".repeat(proto::MAX_ID_LEN + 1), "é"] {
            assert!(table
                .create(bad, spans(&regions, &[1]), Instant::now())
                .is_err());
        }
    }
}
