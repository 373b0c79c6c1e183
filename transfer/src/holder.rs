//! `Holder`: the engine-side half. Owns the registered regions, the hold
//! table, the control listener and the expiry sweeper; `stop` (or drop) ends
//! every task it started.

use crate::backend::{self, Role};
use crate::config::{BackendKind, HolderConfig};
use crate::error::{Result, TransferError};
use crate::hold_table::HoldTable;
use crate::region::{BlockRef, Region, RegionId, RegionTable};
use crate::server::{self, Shared};
use crate::stats::{ConnectionCounts, HoldInfo, HolderStats};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Holds KV blocks for remote readers.
pub struct Holder {
    shared: Arc<Shared>,
    ctrl_addr: SocketAddr,
    shutdown: CancellationToken,
    tasks: Mutex<JoinSet<()>>,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holder")
            .field("ctrl_addr", &self.ctrl_addr)
            .field("backend", &self.shared.backend.kind())
            .finish()
    }
}

impl Holder {
    /// Binds the control listener and starts serving.
    pub async fn start(config: HolderConfig) -> Result<Self> {
        let backend = backend::create(
            config.backend,
            Role::Holder {
                faults: &config.faults,
            },
        )?;
        let listener = crate::net::listen(config.listen)?;
        let ctrl_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            holds: HoldTable::new(config.retain, config.release, config.budget_bytes)
                .with_max_epoch(config.max_epoch),
            regions: RegionTable::default(),
            backend,
            io_timeout: config.io_timeout,
            faults: config.faults.clone(),
            streamed: AtomicU64::new(0),
            secret: config.secret.clone(),
            max_connections: config.max_connections.max(1),
            max_connections_per_peer: config.max_connections_per_peer.max(1),
            slots: Arc::new(Semaphore::new(config.max_connections.max(1))),
            idle: Arc::default(),
        });
        if config.secret.is_none() {
            tracing::warn!(
                listen = %ctrl_addr,
                "KV holder without a transfer secret: anyone who reaches it can read and release holds (set {})",
                crate::SECRET_ENV
            );
        }
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(server::serve(listener, shared.clone(), shutdown.clone()));
        tasks.spawn(sweep(shared.clone(), config.retain, shutdown.clone()));
        Ok(Self {
            shared,
            ctrl_addr,
            shutdown,
            tasks: Mutex::new(tasks),
        })
    }

    /// The `remote_ctrl` address readers and the router use.
    pub fn ctrl_addr(&self) -> SocketAddr {
        self.ctrl_addr
    }

    pub fn backend(&self) -> BackendKind {
        self.shared.backend.kind()
    }

    /// Whether the backend can serve GPU memory directly (else the engine
    /// holds host copies of its device KV).
    pub fn device_memory(&self) -> bool {
        self.shared.backend.device_memory()
    }

    /// Registers memory that holds may then reference.
    pub fn register_region(&self, region: Region) -> Result<RegionId> {
        let entry = self.shared.regions.register(region);
        match self.shared.backend.expose(&entry) {
            Ok(exposure) => {
                entry.keep_alive(exposure.keepalive);
                entry.set_remote_key(exposure.key);
            }
            Err(err) => {
                self.shared.regions.unregister(entry.id);
                return Err(err);
            }
        }
        Ok(entry.id)
    }

    /// Removes a region from the table. Holds already over it keep it (and an
    /// owned buffer) alive until they are freed; no new hold can use it.
    pub fn unregister_region(&self, id: RegionId) -> bool {
        self.shared.regions.unregister(id).is_some()
    }

    /// Holds `blocks` under `transfer_id` for `retain` (renewed by every pull).
    /// The id must carry 128 random bits (see [`crate::new_transfer_id`]):
    /// whoever can guess it could otherwise pull or release another
    /// request's KV.
    pub fn create_hold(&self, transfer_id: &str, blocks: Vec<BlockRef>) -> Result<()> {
        crate::auth::check_id_entropy(transfer_id).map_err(TransferError::InvalidArgument)?;
        let spans = self.shared.regions.spans(&blocks)?;
        self.shared.holds.create(transfer_id, spans, Instant::now())
    }

    /// Frees a hold locally (e.g. the engine aborted the request); idempotent.
    /// The blocks are reported by [`Holder::freed`] once the reads in
    /// flight on them (fenced now) have stopped.
    pub fn release(&self, transfer_id: &str) -> bool {
        self.shared.holds.release(transfer_id, Instant::now())
    }

    /// The hold as it is now, if held.
    pub fn stat(&self, transfer_id: &str) -> Option<HoldInfo> {
        self.shared.holds.stat(transfer_id, Instant::now())
    }

    /// Transfer ids released, expired or evicted since the last call, whose
    /// last read has stopped: the engine may reuse their blocks. A hold freed
    /// during a read is reported only once that read has ended.
    pub fn freed(&self) -> Vec<String> {
        let now = Instant::now();
        self.shared.holds.sweep(now);
        self.shared.holds.take_freed(now)
    }

    /// Holds freed but not yet reported by [`Holder::freed`] because a read
    /// of them has not stopped yet.
    pub fn draining(&self) -> usize {
        self.shared.holds.draining()
    }

    pub fn stats(&self) -> HolderStats {
        self.shared.holds.stats()
    }

    /// The control connections served now and how many sit idle.
    pub fn connections(&self) -> ConnectionCounts {
        self.shared.connections()
    }

    /// Stops the listener and the sweeper and waits for them.
    pub async fn stop(&self) {
        self.shutdown.cancel();
        let mut tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        while tasks.join_next().await.is_some() {}
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // The JoinSet aborts what is left when it drops; cancelling first lets
        // connection tasks end at their next await.
        self.shutdown.cancel();
    }
}

/// Expires holds whose lease ran out, a few times per lease.
async fn sweep(shared: Arc<Shared>, retain: Duration, shutdown: CancellationToken) {
    let every = (retain / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => shared.holds.sweep(Instant::now()),
        }
    }
}
