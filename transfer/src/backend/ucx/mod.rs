//! The UCX backend: one-sided `ucp_get_nbx` reads with packed rkeys.
//!
//! - `ffi.rs`: safe wrappers over the UCX calls (all the `unsafe`).
//! - `holder.rs`: one UCX context and worker; every registered region is
//!   mapped (`ucp_mem_map`) and its packed rkey travels in the descriptor,
//!   with this host's identity and the worker's address as the endpoint. A
//!   progress thread drives the worker, because on the transports of a
//!   machine without RDMA (TCP, shared memory on ordinary memory) UCX
//!   emulates gets with messages that the holder must answer.
//! - `reader.rs`: its own context and worker, an endpoint per holder
//!   (cached), rkeys unpacked per pull, a window of gets in flight,
//!   progressed by the pulling thread itself (tokio's blocking pool) until
//!   done, failed, cut or past the pull's deadline, or no get finished for
//!   one I/O timeout.
//!
//! The reader's endpoint error mode depends on where the holder is:
//! - same host and IPC namespace: mode "none", because UCX 1.13 leaves its
//!   shared-memory transports out of mode "peer" (gets then go over tcp/lo,
//!   5-8x slower here). A dead holder's gets in this mode never complete and
//!   cannot be cancelled, so a failed pull destroys the reader's whole worker
//!   (which purges them) before its destinations are given back; the next
//!   pull starts a fresh one.
//! - another host: mode "peer" (on RDMA a dead peer in mode "none" is fatal):
//!   a failed pull force-closes the endpoint, which cancels its gets.
//!
//! `CONNEX_UCX_ERR_MODE=peer|none` overrides the choice.

mod ffi;
mod holder;
mod reader;

use super::{Backend, Exposure, Fetch, Role};
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::region::RegionEntry;
use futures_util::future::BoxFuture;
use holder::HolderSide;
use reader::{Get, Limits, ReaderSide};
use std::sync::Arc;

pub(crate) enum UcxBackend {
    Holder(HolderSide),
    Reader(Arc<ReaderSide>),
}

impl UcxBackend {
    pub(crate) fn new(role: Role<'_>) -> Result<Self> {
        match role {
            Role::Holder { faults } => Ok(Self::Holder(HolderSide::new(faults)?)),
            Role::Reader => Ok(Self::Reader(Arc::new(ReaderSide::new()))),
        }
    }
}

impl Backend for UcxBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Ucx
    }

    fn device_memory(&self) -> bool {
        ffi::cuda_memory_supported()
    }

    fn expose(&self, region: &RegionEntry) -> Result<Exposure> {
        match self {
            Self::Holder(holder) => holder.expose(region),
            Self::Reader(_) => Err(TransferError::Protocol(
                "a ucx reader cannot expose memory".into(),
            )),
        }
    }

    fn pull_started(&self) {
        if let Self::Holder(holder) = self {
            holder.pull_started();
        }
    }

    fn endpoint(&self) -> Vec<u8> {
        match self {
            Self::Holder(holder) => holder.endpoint(),
            Self::Reader(_) => Vec::new(),
        }
    }

    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let Self::Reader(side) = self else {
                return Err(TransferError::Protocol("a ucx holder cannot pull".into()));
            };
            let d = job.descriptor;
            let gets: Vec<Get> = d
                .blocks
                .iter()
                .zip(job.dest)
                .filter(|(b, _)| b.len > 0)
                .map(|(b, dest)| Get {
                    dest,
                    remote: b.addr,
                    key: usize::from(b.key),
                })
                .collect();
            let (endpoint, keys) = (d.endpoint.clone(), d.keys.clone());
            let limits = Limits {
                io: job.io_timeout,
                deadline: job.deadline,
                fence: job.fence.clone(),
            };
            // The task owns everything it touches (a dropped pull future
            // cuts the fence, which the task notices between two progress
            // calls; it settles or purges its gets before it ends).
            let side = side.clone();
            tokio::task::spawn_blocking(move || side.run_gets(&endpoint, &keys, gets, &limits))
                .await
                .map_err(|e| TransferError::Protocol(format!("ucx pull task: {e}")))?
        })
    }
}

/// What identifies "this host, this IPC namespace" (shared memory between
/// two processes needs both): the kernel boot id and the IPC namespace.
fn host_identity() -> Vec<u8> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ipc = std::fs::read_link("/proc/self/ns/ipc")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{}/{ipc}", boot.trim()).into_bytes()
}

/// The endpoint bytes a holder publishes: `[host len: u8][host][worker address]`.
struct HolderEndpoint;

impl HolderEndpoint {
    fn encode(host: &[u8], address: &[u8]) -> Vec<u8> {
        let host = &host[..host.len().min(usize::from(u8::MAX))];
        let mut out = Vec::with_capacity(1 + host.len() + address.len());
        out.push(host.len() as u8);
        out.extend_from_slice(host);
        out.extend_from_slice(address);
        out
    }

    fn decode(bytes: &[u8]) -> Result<(&[u8], &[u8])> {
        let (&len, rest) = bytes
            .split_first()
            .ok_or_else(|| TransferError::Protocol("empty ucx endpoint".into()))?;
        let len = usize::from(len);
        if rest.len() <= len {
            return Err(TransferError::Protocol("truncated ucx endpoint".into()));
        }
        Ok(rest.split_at(len))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn holder_endpoints_round_trip_and_bad_ones_are_refused() {
        let bytes = HolderEndpoint::encode(b"host", b"worker-address");
        assert_eq!(
            HolderEndpoint::decode(&bytes).unwrap(),
            (&b"host"[..], &b"worker-address"[..])
        );
        assert!(HolderEndpoint::decode(&[]).is_err());
        assert!(HolderEndpoint::decode(&[4, b'h', b'o', b's', b't']).is_err());
    }
}
