//! The holder's listener (`remote_ctrl`): control ops and the TCP data path.
//!
//! One task per connection, all owned by the accept loop's `JoinSet` and
//! stopped by the holder's cancellation token. Connections are kept open for
//! many requests (readers and the router pool them). A frame whose payload is
//! bad gets an error reply and the connection goes on; a header that cannot be
//! trusted (bad magic, unknown version, oversized) gets an error reply and the
//! connection is closed. Nothing a peer sends can stop the listener.
//!
//! With a transfer secret, a connection must complete the handshake (`auth`)
//! within [`HANDSHAKE_TIMEOUT`] of being accepted, before any op; a failed
//! or late one closes it. One peer address holds at most
//! `max_connections_per_peer` connections, and a connection still unproven
//! after [`UNPROVEN_GRACE`] gives its slot up when the holder needs one, so
//! hosts without the secret cannot keep readers out.

mod answer;
mod connection;
mod handshake;
mod stream;

use crate::backend::Backend;
use crate::config::{Faults, Secret};
use crate::hold_table::HoldTable;
use crate::inbound_idle::IdleConns;
use crate::region::RegionTable;
use connection::Connection;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long a connection may sit idle between frames.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connection to a holder with a secret may take to prove it.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection may hold a slot unproven before the holder, out of
/// slots, may close it for a new one (so addresses that never prove anything
/// cannot keep every slot for the whole handshake timeout, again and again).
pub(crate) const UNPROVEN_GRACE: Duration = Duration::from_millis(250);
/// Largest frame payload read before the handshake is done.
pub(crate) const MAX_HANDSHAKE_PAYLOAD: u32 = 256;

/// What every connection of a holder shares.
pub(crate) struct Shared {
    pub(crate) holds: HoldTable,
    pub(crate) regions: RegionTable,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) io_timeout: Duration,
    pub(crate) faults: Faults,
    /// Block bytes written so far (for the stall fault).
    pub(crate) streamed: AtomicU64,
    /// Proven (ops `hello`, `proof`) before any other op of a connection.
    pub(crate) secret: Option<Secret>,
    /// Most connections served at once ([`crate::HolderConfig::max_connections`]).
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_peer: usize,
    /// One permit per connection served (`max_connections` of them).
    pub(crate) slots: Arc<Semaphore>,
    /// The connections between frames, to close one when out of slots.
    pub(crate) idle: Arc<IdleConns>,
}

impl Shared {
    /// Connections served now, and how many of them sit idle.
    pub(crate) fn connections(&self) -> crate::stats::ConnectionCounts {
        crate::stats::ConnectionCounts {
            open: self.max_connections - self.slots.available_permits(),
            idle: self.idle.count(),
        }
    }
}

/// Open connections per peer address.
#[derive(Default)]
struct Peers(Mutex<HashMap<IpAddr, usize>>);

impl Peers {
    /// A slot for one more connection of `peer`, if under `max`.
    fn take(self: &Arc<Self>, peer: IpAddr, max: usize) -> Option<PeerSlot> {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(peer).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            peer,
        })
    }
}

/// One connection's place in its peer's count; given back on drop.
pub(crate) struct PeerSlot {
    peers: Arc<Peers>,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.peers.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// Accepts connections until `shutdown`, then stops every connection task.
/// At `max_connections` a new connection is held, unserved, while the one
/// idle longest is closed to make room (readers pool idle connections), or
/// until one ends; further ones wait in the listen backlog: a burst of pulls
/// queues instead of failing.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut connections = JoinSet::new();
    let (limit, idle) = (&shared.slots, &shared.idle);
    let peers = Arc::new(Peers::default());
    let mut logs = LimitLogs::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let Some(slot) = peers.take(peer.ip(), shared.max_connections_per_peer) else {
            tracing::debug!(%peer, "per-peer connection limit reached; closing");
            continue;
        };
        let permit = match limit.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let Some(permit) = make_room(&shared, &shutdown, &mut logs).await else {
                    break;
                };
                permit
            }
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(%err, "set_nodelay");
        }
        let conn = Connection::new(
            shared.clone(),
            shutdown.clone(),
            idle.register(),
            (permit, slot),
        );
        connections.spawn(conn.serve(stream));
    }
    connections.shutdown().await;
}

/// How long a holder at its limit waits for a connection to end before it
/// closes an idle one (one about to end frees its slot without a close).
const MAKE_ROOM_GRACE: Duration = Duration::from_millis(5);
/// How often it closes another idle connection while no slot frees (the one
/// told to close took a frame at the same moment, or none was idle).
const MAKE_ROOM_EVERY: Duration = Duration::from_millis(50);

/// When the limit's log lines were last written: at most one of each kind
/// per [`LimitLogs::EVERY`].
#[derive(Default)]
struct LimitLogs {
    busy: Option<Instant>,
    closing: Option<Instant>,
}

impl LimitLogs {
    const EVERY: Duration = Duration::from_secs(10);

    fn due(last: &mut Option<Instant>) -> bool {
        let due = last.is_none_or(|at| at.elapsed() >= Self::EVERY);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

/// Waits for a connection slot, closing idle connections to free one. None:
/// shutting down.
async fn make_room(
    shared: &Shared,
    shutdown: &CancellationToken,
    logs: &mut LimitLogs,
) -> Option<OwnedSemaphorePermit> {
    let (limit, idle) = (&shared.slots, &shared.idle);
    let since = Instant::now();
    let mut wait = MAKE_ROOM_GRACE;
    let mut closed = 0usize;
    let permit = loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            permit = limit.clone().acquire_owned() => break permit.ok()?,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = MAKE_ROOM_EVERY;
        if idle.close_longest_idle() {
            closed += 1;
        } else if LimitLogs::due(&mut logs.busy) {
            tracing::warn!(
                max = shared.max_connections,
                "connection limit reached with every connection busy; new connections wait"
            );
        }
    };
    if closed > 0 && LimitLogs::due(&mut logs.closing) {
        tracing::info!(
            max = shared.max_connections,
            closed,
            waited_ms = since.elapsed().as_millis() as u64,
            "connection limit reached: idle connections closed for new ones \
             (raise max_connections if this goes on)"
        );
    }
    Some(permit)
}
