//! `Reader`: the decoder-side half. Registers destination memory and pulls
//! holds into it: describe (renews the lease, checks the epoch), check the
//! blocks match, let the backend move the bytes, then report the pull done
//! (which a newer epoch or a release meanwhile turns into an error).

use crate::backend::{self, Backend, CutOnDrop, Fetch, PullFence, Role};
use crate::client::{ClientConfig, CtrlClient};
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::net::KeyedLimit;
use crate::proto::Descriptor;
use crate::region::{BlockRef, DestSpan, Region, RegionId, RegionTable};
use crate::stats::{HoldInfo, PullStats};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Setup of a [`Reader`].
#[derive(Debug, Clone)]
pub struct ReaderConfig {
    pub backend: BackendKind,
    pub client: ClientConfig,
    /// Most data streams of one pull.
    pub max_streams: usize,
    /// Overall limit of a [`Reader::pull`] (describe, data and done together).
    pub pull_timeout: Duration,
    /// Most pulls at once from one holder address; more wait for a place
    /// within their own deadline (a burst of requests must not open more
    /// connections to one holder than it serves from one peer).
    pub max_pulls_per_holder: usize,
}

impl ReaderConfig {
    pub fn new(backend: BackendKind) -> Self {
        Self {
            backend,
            client: ClientConfig::default(),
            max_streams: 4,
            pull_timeout: Duration::from_secs(30),
            max_pulls_per_holder: 64,
        }
    }
}

/// Pulls holds into registered memory.
pub struct Reader {
    backend: Arc<dyn Backend>,
    regions: RegionTable,
    ctrl: CtrlClient,
    max_streams: usize,
    pull_timeout: Duration,
    /// [`ReaderConfig::max_pulls_per_holder`].
    admission: Arc<KeyedLimit>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("backend", &self.backend.kind())
            .finish()
    }
}

impl Reader {
    /// A reader of `backend` with default limits. Fails when the backend is
    /// not built in or its library cannot start.
    pub fn new(backend: BackendKind) -> Result<Self> {
        Self::with_config(ReaderConfig::new(backend))
    }

    pub fn with_config(config: ReaderConfig) -> Result<Self> {
        Ok(Self {
            backend: backend::create(config.backend, Role::Reader)?,
            regions: RegionTable::default(),
            ctrl: CtrlClient::with_config(config.client),
            max_streams: config.max_streams,
            pull_timeout: config.pull_timeout,
            admission: KeyedLimit::new(config.max_pulls_per_holder),
        })
    }

    pub fn backend(&self) -> BackendKind {
        self.backend.kind()
    }

    /// Whether the backend can write GPU memory directly (else a decoder
    /// whose KV cache is on a GPU pulls into host memory and copies).
    pub fn device_memory(&self) -> bool {
        self.backend.device_memory()
    }

    /// The control client this reader uses (release, renew, stat).
    pub fn ctrl(&self) -> &CtrlClient {
        &self.ctrl
    }

    /// Registers destination memory.
    pub fn register_region(&self, region: Region) -> Result<RegionId> {
        let entry = self.regions.register(region);
        match self.backend.register_local(&entry) {
            Ok(exposure) => {
                entry.keep_alive(exposure.keepalive);
                Ok(entry.id)
            }
            Err(err) => {
                self.regions.unregister(entry.id);
                Err(err)
            }
        }
    }

    /// Forgets a region (a running pull keeps it until it ends).
    pub fn unregister_region(&self, id: RegionId) -> bool {
        self.regions.unregister(id).is_some()
    }

    /// Whether a pull may still write into any of `blocks`: true while one
    /// runs, and after a failed Mooncake pull until its queued reads have
    /// ended. Blocks must not go back to their engine while it is true.
    pub fn writing_into(&self, blocks: &[BlockRef]) -> bool {
        self.regions.any_claimed(blocks)
    }

    /// Unregisters an owned region and gives its bytes back; refused while a
    /// pull writes into it.
    pub fn take_region(&self, id: RegionId) -> Result<Vec<u8>> {
        self.regions.take_owned(id)
    }

    /// Pulls hold `transfer_id` from the holder at `remote_ctrl` into `dest`
    /// (same count and lengths, in order, as the hold's blocks). Renews the
    /// hold. Bounded by the configured `pull_timeout` as a whole.
    pub async fn pull(
        &self,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: u32,
        dest: &[BlockRef],
    ) -> Result<PullStats> {
        self.pull_timeout(remote_ctrl, transfer_id, epoch, dest, self.pull_timeout)
            .await
    }

    /// [`Reader::pull`] with an overall time limit: at `limit` the pull's
    /// sockets are shut down and its writers stopped, and only then does it
    /// fail. With tcp and ucx, once this returns (whatever it returns) nothing
    /// writes into `dest` any more and the blocks may go back to the engine.
    /// Mooncake cannot cancel a read: a failed pull may return while reads
    /// are still queued, and its destination stays claimed until the engine
    /// reports them ended; ask [`Reader::writing_into`] before giving blocks
    /// back. A holder that trickles bytes is cut at the limit too. Dropping
    /// the future instead stops the writers as soon as they notice; the
    /// destination stays claimed (no other pull may write it) until they have.
    pub async fn pull_timeout(
        &self,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: u32,
        dest: &[BlockRef],
        limit: Duration,
    ) -> Result<PullStats> {
        self.pull_blocks(remote_ctrl, transfer_id, epoch, None, dest, limit)
            .await
    }

    /// [`Reader::pull_timeout`] of only the hold's blocks `select` (indices
    /// into its blocks, increasing) when given: `dest` then matches those
    /// blocks. A decoder that has the start of a prompt cached pulls only
    /// the blocks it lacks; the bytes moved and `PullStats` count only them.
    pub async fn pull_blocks(
        &self,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: u32,
        select: Option<&[u32]>,
        dest: &[BlockRef],
        limit: Duration,
    ) -> Result<PullStats> {
        let started = Instant::now();
        // A limit past what an Instant can hold (say, from Python) is "a year".
        let deadline = started
            .checked_add(limit)
            .unwrap_or(started + Duration::from_secs(365 * 86_400));
        let timeout = || TransferError::Timeout {
            what: "pulling a hold",
            after: limit,
        };
        let spans = self.regions.claim(dest)?;
        let _admitted = tokio::time::timeout_at(deadline.into(), self.admission.enter(remote_ctrl))
            .await
            .map_err(|_| timeout())?;
        let window = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
        let descriptor = tokio::time::timeout_at(
            deadline.into(),
            self.ctrl.describe(
                remote_ctrl,
                transfer_id,
                epoch,
                self.backend.kind().code(),
                window,
                deadline,
            ),
        )
        .await
        .map_err(|_| timeout())??;
        let (descriptor, ranges) = match select {
            None => {
                let total = descriptor.blocks.iter().map(|b| b.len).sum();
                (descriptor, vec![(0, total)])
            }
            Some(select) => match selected(descriptor, select, transfer_id) {
                Ok(part) => part,
                Err(err) => {
                    self.end_one_sided(remote_ctrl, transfer_id).await;
                    return Err(err);
                }
            },
        };
        if let Some(mismatch) = mismatch(&descriptor, &spans, transfer_id) {
            self.end_one_sided(remote_ctrl, transfer_id).await;
            return Err(TransferError::SizeMismatch(mismatch));
        }
        let bytes: u64 = descriptor.blocks.iter().map(|b| b.len).sum();
        let fence = Arc::new(PullFence::default());
        let cut_if_dropped = CutOnDrop(Some(fence.clone()));
        let fetched = self
            .backend
            .fetch(Fetch {
                ctrl: &self.ctrl,
                remote_ctrl,
                transfer_id,
                epoch,
                descriptor: &descriptor,
                dest: spans,
                ranges,
                io_timeout: self.ctrl.config().io_timeout,
                deadline,
                fence,
                max_streams: self.max_streams,
            })
            .await;
        cut_if_dropped.disarm();
        if fetched.is_err() {
            self.end_one_sided(remote_ctrl, transfer_id).await;
        }
        let streams = fetched.map_err(|err| match err {
            TransferError::Timeout { .. } if Instant::now() >= deadline => timeout(),
            other => other,
        })?;
        tokio::time::timeout_at(
            deadline.into(),
            self.ctrl
                .done(remote_ctrl, transfer_id, epoch, bytes, deadline),
        )
        .await
        .map_err(|_| timeout())??;
        Ok(PullStats {
            bytes,
            blocks: descriptor.blocks.len() as u32,
            streams,
            elapsed: started.elapsed(),
        })
    }

    /// A one-sided pull that will not say `done` (it failed, and its gets
    /// have stopped, or never started): the holder counts it as a read of
    /// the hold until its done or its window ends, so say at once that it is
    /// over and a released hold's blocks go back now. Best effort, briefly:
    /// the window bounds it anyway.
    async fn end_one_sided(&self, remote_ctrl: &str, transfer_id: &str) {
        if self.backend.kind() == BackendKind::Tcp {
            return;
        }
        let abort = self.ctrl.abort(remote_ctrl, transfer_id);
        if let Ok(Err(err)) = tokio::time::timeout(Duration::from_secs(1), abort).await {
            tracing::debug!(%err, "abort of a failed pull");
        }
    }

    /// Releases a hold (idempotent).
    pub async fn release(&self, remote_ctrl: &str, transfer_id: &str) -> Result<bool> {
        self.ctrl.release(remote_ctrl, transfer_id).await
    }

    /// Renews a hold.
    pub async fn renew(
        &self,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: u32,
    ) -> Result<HoldInfo> {
        self.ctrl.renew(remote_ctrl, transfer_id, epoch).await
    }

    /// A hold's state without renewing it.
    pub async fn stat(&self, remote_ctrl: &str, transfer_id: &str) -> Result<Option<HoldInfo>> {
        self.ctrl.stat(remote_ctrl, transfer_id).await
    }
}

/// The descriptor cut down to blocks `select` of the hold, and the runs of
/// hold bytes they cover (consecutive blocks make one run).
fn selected(
    mut descriptor: Descriptor,
    select: &[u32],
    transfer_id: &str,
) -> Result<(Descriptor, Vec<(u64, u64)>)> {
    let all = std::mem::take(&mut descriptor.blocks);
    let mut starts = Vec::with_capacity(all.len());
    let mut at = 0u64;
    for block in &all {
        starts.push(at);
        at += block.len;
    }
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut previous: Option<u32> = None;
    for &index in select {
        let i = index as usize;
        if i >= all.len() || previous.is_some_and(|p| p >= index) {
            return Err(TransferError::InvalidArgument(format!(
                "block selection of hold {transfer_id:?} ({} blocks) must be increasing \
                 indices below its block count; got {index} after {previous:?}",
                all.len()
            )));
        }
        previous = Some(index);
        let (start, len) = (starts[i], all[i].len);
        descriptor.blocks.push(all[i]);
        match ranges.last_mut() {
            Some(run) if run.0 + run.1 == start => run.1 += len,
            _ => ranges.push((start, len)),
        }
    }
    Ok((descriptor, ranges))
}

/// Why the hold's blocks do not fit the destination, if they do not.
fn mismatch(descriptor: &Descriptor, dest: &[DestSpan], transfer_id: &str) -> Option<String> {
    if descriptor.blocks.len() != dest.len() {
        return Some(format!(
            "hold {transfer_id:?} has {} blocks, destination has {}",
            descriptor.blocks.len(),
            dest.len()
        ));
    }
    let (i, (remote, local)) = descriptor
        .blocks
        .iter()
        .zip(dest)
        .enumerate()
        .find(|(_, (r, l))| r.len != l.len as u64)?;
    Some(format!(
        "block {i} of hold {transfer_id:?} has {} bytes, destination block {}",
        remote.len, local.len
    ))
}
