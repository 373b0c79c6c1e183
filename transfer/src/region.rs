//! Registered memory regions and the spans of them that holds and pulls use.
//!
//! A region is either a buffer this crate owns (tests, the mock engine) or a raw
//! pointer + length that the caller owns (a vLLM KV cache). Holders only read
//! their regions; readers write into theirs, and a reader claims every range it
//! writes so that two pulls can never write the same bytes at once and the
//! owner cannot take the buffer back while a pull writes into it. This is the
//! one module that turns addresses into slices, hence the `unsafe`.
#![allow(unsafe_code)]

use crate::error::{Result, TransferError};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Identifier of a registered region, unique within one holder or reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A block inside a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

impl BlockRef {
    /// A block of `len` bytes at `offset` of `region`.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }
}

/// Memory handed to a holder or a reader.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    /// Whether `ptr` came from `Box::into_raw` of a boxed slice we must free.
    owned: bool,
}

// SAFETY: a Region is a pointer + length. Owned memory is only freed by Drop;
// raw memory stays valid by the contract of `Region::raw`. Concurrent access is
// disciplined by the table below (holders read only; readers write claimed,
// disjoint ranges).
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` exposes no unsynchronised mutation.
unsafe impl Sync for Region {}

impl Region {
    /// A buffer owned by the region (freed when the region and every hold
    /// over it are gone).
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        let ptr = Box::into_raw(bytes.into_boxed_slice()).cast::<u8>();
        Self {
            ptr,
            len,
            owned: true,
        }
    }

    /// Caller-owned memory, e.g. a tensor's storage.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads (holder) or reads and writes
    /// (reader) for as long as the region is registered, any hold over it
    /// exists, or a pull into it runs; and nothing else may write the bytes of a
    /// held block while it is held, or read a destination block during a pull.
    pub unsafe fn raw(ptr: *mut u8, len: usize) -> Self {
        Self {
            ptr,
            len,
            owned: false,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address (what one-sided backends register and advertise).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn check(&self, offset: u64, len: u64) -> Result<Range<usize>> {
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= self.len as u64);
        match end {
            Some(end) => Ok(offset as usize..end as usize),
            None => Err(TransferError::InvalidArgument(format!(
                "block {offset}+{len} is outside the region of {} bytes",
                self.len
            ))),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owned {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
            // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice in
            // `Region::owned`, and this is the only place that frees it.
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

/// A registered region with the ranges pulls are writing into now.
pub(crate) struct RegionEntry {
    pub(crate) id: RegionId,
    pub(crate) region: Region,
    /// Claimed ranges, start -> end (disjoint, so a lookup is one range query).
    claims: Mutex<BTreeMap<usize, usize>>,
    /// Backend state tied to the memory (e.g. a UCX mapping), dropped first.
    keepalive: Mutex<Option<Box<dyn Send + Sync>>>,
    /// The key remote readers need for this region (one-sided backends).
    remote_key: Mutex<Option<Arc<Vec<u8>>>>,
}

impl Drop for RegionEntry {
    fn drop(&mut self) {
        // Undo the backend's hold on the memory before the memory goes.
        drop(
            self.keepalive
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }
}

impl RegionEntry {
    pub(crate) fn keep_alive(&self, value: Option<Box<dyn Send + Sync>>) {
        *self.keepalive.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }

    pub(crate) fn set_remote_key(&self, key: Option<Vec<u8>>) {
        *self.remote_key.lock().unwrap_or_else(|e| e.into_inner()) = key.map(Arc::new);
    }

    pub(crate) fn remote_key(&self) -> Option<Arc<Vec<u8>>> {
        self.remote_key
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn claims(&self) -> MutexGuard<'_, BTreeMap<usize, usize>> {
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether `range` overlaps one of the disjoint ranges in `claims`.
fn claimed(claims: &BTreeMap<usize, usize>, range: &Range<usize>) -> bool {
    // Only the last claim starting before `range.end` can overlap it.
    !range.is_empty()
        && claims
            .range(..range.end)
            .next_back()
            .is_some_and(|(_, &end)| end > range.start)
}

/// Bytes of a held block, readable while the span (and so its region) lives.
#[derive(Clone)]
pub(crate) struct SrcSpan {
    entry: Arc<RegionEntry>,
    offset: usize,
    len: usize,
}

impl SrcSpan {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Address of the first byte (one-sided backends).
    pub(crate) fn addr(&self) -> u64 {
        self.entry.region.addr() + self.offset as u64
    }

    pub(crate) fn region_id(&self) -> RegionId {
        self.entry.id
    }

    /// The remote key of the span's region, if its backend made one.
    pub(crate) fn remote_key(&self) -> Option<Arc<Vec<u8>>> {
        self.entry.remote_key()
    }

    /// The sub-span `[from, from+len)` of this span.
    pub(crate) fn slice(&self, from: usize, len: usize) -> SrcSpan {
        debug_assert!(from + len <= self.len);
        SrcSpan {
            entry: self.entry.clone(),
            offset: self.offset + from,
            len,
        }
    }

    /// Extends this span by `next` when `next` starts where it ends in the
    /// same region (fewer, larger writes).
    pub(crate) fn try_merge(&mut self, next: &SrcSpan) -> bool {
        if Arc::ptr_eq(&self.entry, &next.entry) && self.offset + self.len == next.offset {
            self.len += next.len;
            return true;
        }
        false
    }

    /// The held bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the range was bounds-checked against the region when the hold
        // was created; the Arc keeps owned memory alive, raw memory is valid by
        // `Region::raw`'s contract, and holders never write their regions.
        unsafe { std::slice::from_raw_parts(self.entry.region.ptr.add(self.offset), self.len) }
    }
}

/// A destination range a pull has claimed; writes to it are exclusive until
/// the last clone of its [`Claim`] is dropped.
pub(crate) struct DestSpan {
    ptr: *mut u8,
    pub(crate) len: usize,
    /// Keeps the region (and so the claim) alive while the span is in use.
    _claim: Arc<Claim>,
}

// SAFETY: the span's range is claimed exclusively (see `Claim`), so the task
// that holds it is the only writer, wherever it runs.
unsafe impl Send for DestSpan {}

impl DestSpan {
    /// The writable bytes of the span.
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: bounds checked when claimed; the claim makes this the only
        // writer and keeps the region registered-or-alive; `&mut self` makes
        // this slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Extends this span by `next` when `next` starts where it ends and
    /// belongs to the same claim (fewer, larger reads).
    pub(crate) fn try_merge(&mut self, next: &DestSpan) -> bool {
        if Arc::ptr_eq(&self._claim, &next._claim) && self.ptr.wrapping_add(self.len) == next.ptr {
            self.len += next.len;
            return true;
        }
        false
    }

    /// Splits off the first `at` bytes.
    pub(crate) fn split_front(&mut self, at: usize) -> DestSpan {
        debug_assert!(at <= self.len);
        let front = DestSpan {
            ptr: self.ptr,
            len: at,
            _claim: self._claim.clone(),
        };
        // SAFETY: `at <= len`, so the new start stays inside the claimed range.
        self.ptr = unsafe { self.ptr.add(at) };
        self.len -= at;
        front
    }
}

/// The ranges one pull claimed; released when dropped.
pub(crate) struct Claim {
    ranges: Vec<(Arc<RegionEntry>, Range<usize>)>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        for (entry, range) in &self.ranges {
            entry.claims().remove(&range.start);
        }
    }
}

/// Registered regions of one holder or reader.
#[derive(Default)]
pub(crate) struct RegionTable {
    next: AtomicU64,
    regions: Mutex<HashMap<RegionId, Arc<RegionEntry>>>,
}

impl RegionTable {
    fn map(&self) -> MutexGuard<'_, HashMap<RegionId, Arc<RegionEntry>>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn register(&self, region: Region) -> Arc<RegionEntry> {
        let id = RegionId(self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let entry = Arc::new(RegionEntry {
            id,
            region,
            claims: Mutex::new(BTreeMap::new()),
            keepalive: Mutex::new(None),
            remote_key: Mutex::new(None),
        });
        self.map().insert(id, entry.clone());
        entry
    }

    pub(crate) fn get(&self, id: RegionId) -> Result<Arc<RegionEntry>> {
        self.map()
            .get(&id)
            .cloned()
            .ok_or_else(|| TransferError::InvalidArgument(format!("unknown region {}", id.0)))
    }

    /// Removes a region; its memory lives on while holds or pulls use it.
    pub(crate) fn unregister(&self, id: RegionId) -> Option<Arc<RegionEntry>> {
        self.map().remove(&id)
    }

    /// Removes an owned region nobody else uses and gives its bytes back.
    pub(crate) fn take_owned(&self, id: RegionId) -> Result<Vec<u8>> {
        let mut map = self.map();
        let entry = map
            .remove(&id)
            .ok_or_else(|| TransferError::InvalidArgument(format!("unknown region {}", id.0)))?;
        match Arc::try_unwrap(entry) {
            Ok(mut entry) if entry.region.owned => {
                entry.keep_alive(None);
                let slice = std::ptr::slice_from_raw_parts_mut(entry.region.ptr, entry.region.len);
                entry.region.owned = false;
                // SAFETY: the pointer came from `Box::into_raw` of a boxed slice;
                // clearing `owned` above hands the allocation over to this Box
                // and nobody else holds the entry (try_unwrap succeeded).
                Ok(unsafe { Box::from_raw(slice) }.into_vec())
            }
            Ok(entry) => {
                map.insert(id, Arc::new(entry));
                Err(TransferError::InvalidArgument(format!(
                    "region {} is caller-owned memory",
                    id.0
                )))
            }
            Err(entry) => {
                map.insert(id, entry);
                Err(TransferError::InvalidArgument(format!(
                    "region {} is in use by a hold or a pull",
                    id.0
                )))
            }
        }
    }

    /// Bounds-checked read-only spans of `blocks` (holder side).
    pub(crate) fn spans(&self, blocks: &[BlockRef]) -> Result<Vec<SrcSpan>> {
        blocks
            .iter()
            .map(|block| {
                let entry = self.get(block.region)?;
                let range = entry.region.check(block.offset, block.len)?;
                Ok(SrcSpan {
                    entry,
                    offset: range.start,
                    len: range.len(),
                })
            })
            .collect()
    }

    /// Whether a pull may still write into any of `blocks`: one running, or one
    /// that gave up while reads it cannot cancel are queued (Mooncake). Blocks
    /// of regions no longer registered are not known here (false).
    pub(crate) fn any_claimed(&self, blocks: &[BlockRef]) -> bool {
        blocks.iter().any(|block| {
            self.get(block.region).is_ok_and(|entry| {
                let start = usize::try_from(block.offset).unwrap_or(usize::MAX);
                let end = start.saturating_add(usize::try_from(block.len).unwrap_or(usize::MAX));
                claimed(&entry.claims(), &(start..end))
            })
        })
    }

    /// Claims `blocks` for writing (reader side): bounds-checked, disjoint from
    /// each other and from every running pull.
    pub(crate) fn claim(&self, blocks: &[BlockRef]) -> Result<Vec<DestSpan>> {
        let mut ranges: Vec<(Arc<RegionEntry>, Range<usize>)> = Vec::with_capacity(blocks.len());
        for block in blocks {
            let entry = self.get(block.region)?;
            let range = entry.region.check(block.offset, block.len)?;
            ranges.push((entry, range));
        }
        // Overlaps among the blocks themselves: sort, compare neighbours.
        let mut order: Vec<(RegionId, usize, usize)> = ranges
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(e, r)| (e.id, r.start, r.end))
            .collect();
        order.sort_unstable();
        if let Some(pair) = order
            .windows(2)
            .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
        {
            return Err(TransferError::InvalidArgument(format!(
                "destination blocks overlap in region {}",
                pair[0].0 .0
            )));
        }
        // Then against every running pull; release what was taken on conflict.
        let mut taken: Vec<(Arc<RegionEntry>, Range<usize>)> = Vec::with_capacity(ranges.len());
        for (entry, range) in &ranges {
            if range.is_empty() {
                continue;
            }
            let mut claims = entry.claims();
            if claimed(&claims, range) {
                drop(claims);
                drop(Claim { ranges: taken });
                return Err(TransferError::InvalidArgument(format!(
                    "destination {}..{} of region {} is being written by another pull",
                    range.start, range.end, entry.id.0
                )));
            }
            claims.insert(range.start, range.end);
            taken.push((entry.clone(), range.clone()));
        }
        let claim = Arc::new(Claim { ranges: taken });
        Ok(ranges
            .into_iter()
            .map(|(entry, range)| DestSpan {
                // SAFETY: `range` is inside the region (checked above).
                ptr: unsafe { entry.region.ptr.add(range.start) },
                len: range.len(),
                _claim: claim.clone(),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_region_round_trips_and_bounds_are_checked() {
        let table = RegionTable::default();
        let id = table.register(Region::owned(vec![7; 100])).id;
        assert!(table.spans(&[BlockRef::new(id, 90, 10)]).is_ok());
        assert!(table.spans(&[BlockRef::new(id, 91, 10)]).is_err());
        assert!(table.spans(&[BlockRef::new(id, u64::MAX, 2)]).is_err());
        assert!(table.spans(&[BlockRef::new(RegionId(99), 0, 1)]).is_err());
        assert_eq!(table.take_owned(id).ok(), Some(vec![7; 100]));
        assert!(table.take_owned(id).is_err());
    }

    #[test]
    fn claims_are_exclusive_until_dropped() {
        let table = RegionTable::default();
        let id = table.register(Region::owned(vec![0; 64])).id;
        let mut spans = table
            .claim(&[BlockRef::new(id, 0, 16), BlockRef::new(id, 32, 16)])
            .expect("claim");
        // Overlapping a running pull, or itself, is refused.
        assert!(table.claim(&[BlockRef::new(id, 8, 4)]).is_err());
        assert!(table
            .claim(&[BlockRef::new(id, 16, 8), BlockRef::new(id, 20, 8)])
            .is_err());
        // Disjoint ranges may run at once.
        let other = table.claim(&[BlockRef::new(id, 16, 16)]).expect("disjoint");
        // The buffer cannot be taken back while pulls write into it.
        assert!(table.take_owned(id).is_err());
        spans[0].as_mut().fill(1);
        let front = spans[1].split_front(4);
        spans[1].as_mut().fill(2);
        drop((spans, front, other));
        let bytes = table.take_owned(id).expect("free again");
        assert_eq!(&bytes[..16], &[1; 16]);
        assert_eq!(&bytes[32..36], &[0; 4]);
        assert_eq!(&bytes[36..48], &[2; 12]);
    }
}
