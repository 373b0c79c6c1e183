//! The UCX backend: one-sided `ucp_get_nbx` reads with packed rkeys.
//!
//! Holder: one UCX context and worker; every registered region is mapped
//! (`ucp_mem_map`) and its packed rkey travels in the descriptor, with this
//! host's identity and the worker's address as the endpoint. A progress
//! thread drives the worker, because on the transports of a machine without
//! RDMA (TCP, shared memory on ordinary memory) UCX emulates gets with
//! messages that the holder must answer.
//!
//! Reader: its own context and worker, an endpoint per holder (cached), rkeys
//! unpacked per pull, a window of gets in flight, progressed by the pulling
//! thread itself (tokio's blocking pool) until done, failed, or no get
//! finished for one I/O timeout. The endpoint's error mode depends on where
//! the holder is:
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
#![allow(unsafe_code)]

use super::{Backend, Exposure, Fetch, PullFence, Role};
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::region::{DestSpan, RegionEntry};
use connex_ucx_sys as sys;
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Gets in flight at once per pull.
const WINDOW: usize = 64;

fn status_text(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any status.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}

fn fail(what: &str, status: sys::ucs_status_t) -> TransferError {
    TransferError::Backend {
        backend: "ucx",
        message: format!("{what}: {}", status_text(status)),
    }
}

fn check(what: &str, status: sys::ucs_status_t) -> Result<()> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(fail(what, status))
    }
}

/// A UCX context and one worker on it.
struct Ucx {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
}

// SAFETY: the context is created with `mt_workers_shared` (its calls are
// thread-safe); the worker is used by one thread at a time (the holder's
// progress thread, or a reader under its mutex), as its thread mode allows.
unsafe impl Send for Ucx {}
// SAFETY: as above.
unsafe impl Sync for Ucx {}

impl Ucx {
    fn new() -> Result<Self> {
        // SAFETY: plain C initialisation; every out-pointer is a local, the
        // param structs are zeroed C structs with only the masked fields set.
        unsafe {
            let mut config = std::ptr::null_mut();
            check(
                "ucp_config_read",
                sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config),
            )?;
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask =
                (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
            params.features = sys::UCP_FEATURE_RMA as u64;
            params.mt_workers_shared = 1;
            let mut context = std::ptr::null_mut();
            let status = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut context,
            );
            sys::ucp_config_release(config);
            check("ucp_init", status)?;
            let mut wparams: sys::ucp_worker_params_t = std::mem::zeroed();
            wparams.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wparams.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
            let mut worker = std::ptr::null_mut();
            if let Err(err) = check(
                "ucp_worker_create",
                sys::ucp_worker_create(context, &wparams, &mut worker),
            ) {
                sys::ucp_cleanup(context);
                return Err(err);
            }
            Ok(Self { context, worker })
        }
    }

    fn address(&self) -> Result<Vec<u8>> {
        // SAFETY: the worker is live; the address is copied, then released.
        unsafe {
            let mut addr = std::ptr::null_mut();
            let mut len = 0usize;
            check(
                "ucp_worker_get_address",
                sys::ucp_worker_get_address(self.worker, &mut addr, &mut len),
            )?;
            let bytes = std::slice::from_raw_parts(addr.cast::<u8>(), len).to_vec();
            sys::ucp_worker_release_address(self.worker, addr);
            Ok(bytes)
        }
    }

    fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used by this thread alone now.
        unsafe { sys::ucp_worker_progress(self.worker) }
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        // SAFETY: nothing uses the worker or context any more (we own them).
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

/// A mapped region; unmapped on drop (before the region's memory goes).
struct Mapping {
    ucx: Arc<Ucx>,
    memh: sys::ucp_mem_h,
}

// SAFETY: a memh is an opaque handle; unmap is a context call (thread-safe).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `expose` on this context, unmapped once.
        let status = unsafe { sys::ucp_mem_unmap(self.ucx.context, self.memh) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %status_text(status), "ucp_mem_unmap");
        }
    }
}

/// The holder's progress thread; stopped and joined on drop.
struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A reader's worker and its endpoints (by holder worker address). Pulls
/// take turns on it under the reader's mutex.
struct ReaderState {
    /// Created on first use; dropped (worker destroyed) after a pull that
    /// could not be cleanly cancelled.
    ucx: Option<Ucx>,
    eps: HashMap<Vec<u8>, (sys::ucp_ep_h, ErrMode)>,
}

// SAFETY: endpoints and the worker are only used under the reader's mutex.
unsafe impl Send for ReaderState {}

pub(crate) struct ReaderSide {
    state: Mutex<ReaderState>,
}

/// The holder's side: its worker (driven by a progress thread), the
/// endpoint readers connect to, and the stall fault switch.
pub(crate) struct HolderSide {
    ucx: Arc<Ucx>,
    /// This host's identity + the worker address.
    endpoint: Vec<u8>,
    /// Fault switch: stop progressing once a pull starts.
    stall_on_pull: bool,
    stalled: Arc<AtomicBool>,
    _progress: Progress,
}

pub(crate) enum UcxBackend {
    Holder(HolderSide),
    Reader(Arc<ReaderSide>),
}

impl UcxBackend {
    pub(crate) fn new(role: Role<'_>) -> Result<Self> {
        match role {
            Role::Holder { faults } => {
                let ucx = Arc::new(Ucx::new()?);
                let endpoint = HolderEndpoint::encode(&host_identity(), &ucx.address()?);
                let stalled = Arc::new(AtomicBool::new(false));
                let stop = Arc::new(AtomicBool::new(false));
                let thread = {
                    let (ucx, stop, stalled) = (ucx.clone(), stop.clone(), stalled.clone());
                    let trickle = faults.trickle;
                    std::thread::Builder::new()
                        .name("connex-ucx-progress".into())
                        .spawn(move || progress_loop(&ucx, &stop, &stalled, trickle))?
                };
                Ok(Self::Holder(HolderSide {
                    ucx,
                    endpoint,
                    stall_on_pull: faults.stall_after_bytes.is_some(),
                    stalled,
                    _progress: Progress {
                        stop,
                        thread: Some(thread),
                    },
                }))
            }
            Role::Reader => Ok(Self::Reader(Arc::new(ReaderSide {
                state: Mutex::new(ReaderState {
                    ucx: None,
                    eps: HashMap::new(),
                }),
            }))),
        }
    }

    fn holder(&self) -> Result<&HolderSide> {
        match self {
            Self::Holder(holder) => Ok(holder),
            Self::Reader(_) => Err(TransferError::Protocol(
                "a ucx reader cannot expose memory".into(),
            )),
        }
    }
}

/// Drives the holder's worker: busy while there is work, then backing off to
/// short sleeps so an idle holder costs little CPU.
/// With the trickle fault, one progress call per interval.
fn progress_loop(ucx: &Ucx, stop: &AtomicBool, stalled: &AtomicBool, trickle: Option<Duration>) {
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        if stalled.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        if let Some(every) = trickle {
            ucx.progress();
            std::thread::sleep(every);
            continue;
        }
        if ucx.progress() > 0 {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 2000 {
                std::thread::sleep(Duration::from_micros(200));
            } else if idle > 100 {
                std::thread::yield_now();
            }
        }
    }
}

impl Backend for UcxBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Ucx
    }

    fn expose(&self, region: &RegionEntry) -> Result<Exposure> {
        if region.region.is_empty() {
            return Ok(Exposure::default());
        }
        let ucx = &self.holder()?.ucx;
        // SAFETY: the region's memory is valid while the entry lives, and the
        // mapping (its keepalive) is dropped before the memory.
        unsafe {
            let mut params: sys::ucp_mem_map_params_t = std::mem::zeroed();
            params.field_mask =
                (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            params.address = region.region.addr() as *mut std::ffi::c_void;
            params.length = region.region.len();
            let mut memh = std::ptr::null_mut();
            check(
                "ucp_mem_map",
                sys::ucp_mem_map(ucx.context, &params, &mut memh),
            )?;
            let mapping = Mapping {
                ucx: ucx.clone(),
                memh,
            };
            let mut buf = std::ptr::null_mut();
            let mut len = 0usize;
            check(
                "ucp_rkey_pack",
                sys::ucp_rkey_pack(ucx.context, memh, &mut buf, &mut len),
            )?;
            let key = std::slice::from_raw_parts(buf.cast::<u8>(), len).to_vec();
            sys::ucp_rkey_buffer_release(buf);
            Ok(Exposure {
                key: Some(key),
                keepalive: Some(Box::new(mapping)),
            })
        }
    }

    fn pull_started(&self) {
        if let Self::Holder(holder) = self {
            if holder.stall_on_pull {
                holder.stalled.store(true, Ordering::Relaxed);
            }
        }
    }

    fn endpoint(&self) -> Vec<u8> {
        match self {
            Self::Holder(holder) => holder.endpoint.clone(),
            Self::Reader(_) => Vec::new(),
        }
    }

    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
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
            let Self::Reader(side) = self else {
                return Err(TransferError::Protocol("a ucx holder cannot pull".into()));
            };
            let side = side.clone();
            tokio::task::spawn_blocking(move || side.run_gets(&endpoint, &keys, gets, &limits))
                .await
                .map_err(|e| TransferError::Protocol(format!("ucx pull task: {e}")))?
        })
    }
}

/// When a pull's gets must stop.
struct Limits {
    /// No get completed for this long: the holder is gone or stuck.
    io: Duration,
    /// The pull's overall deadline.
    deadline: Instant,
    /// Cut when the pull is abandoned.
    fence: Arc<PullFence>,
}

/// One block to fetch.
struct Get {
    dest: DestSpan,
    remote: u64,
    key: usize,
}

/// How a reader's endpoint treats a holder's failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ErrMode {
    /// UCX reports a dead peer and a force close cancels every get. On UCX
    /// 1.13 this mode leaves out the shared-memory transports.
    Peer,
    /// Shared memory is used; a dead holder's gets can never complete nor be
    /// cancelled, so a failed pull destroys the whole reader worker (which
    /// purges them) before its destinations are given back.
    None,
}

impl ErrMode {
    /// Same host (and IPC namespace) as the holder: shared memory is
    /// reachable, so mode "none", unless `CONNEX_UCX_ERR_MODE=peer` says
    /// otherwise. Another host: mode "peer" (on RDMA a dead peer in mode
    /// "none" is a fatal UCX error).
    fn for_holder(holder_host: &[u8]) -> Self {
        match std::env::var("CONNEX_UCX_ERR_MODE").as_deref() {
            Ok("peer") => Self::Peer,
            Ok("none") => Self::None,
            _ if holder_host == host_identity().as_slice() => Self::None,
            _ => Self::Peer,
        }
    }

    fn ucx(self) -> sys::ucp_err_handling_mode_t {
        match self {
            Self::Peer => sys::UCP_ERR_HANDLING_MODE_PEER,
            Self::None => sys::UCP_ERR_HANDLING_MODE_NONE,
        }
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

/// How a pull on an endpoint ended.
enum Ending {
    /// Every get completed or was cancelled: the endpoint is reusable unless
    /// the pull failed.
    Settled,
    /// Some gets may still write into their destinations: the worker must be
    /// destroyed before the destinations are given back.
    Outstanding,
}

impl ReaderSide {
    /// Issues the gets (a window at a time) and progresses until all are done.
    fn run_gets(
        &self,
        endpoint: &[u8],
        keys: &[Vec<u8>],
        mut gets: Vec<Get>,
        limits: &Limits,
    ) -> Result<u32> {
        let (host, address) = HolderEndpoint::decode(endpoint)?;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *state;
        let ucx = match &mut state.ucx {
            Some(ucx) => ucx,
            none => none.insert(Ucx::new()?),
        };
        let (ep, mode) = match state.eps.get(address) {
            Some(&found) => found,
            None => {
                let mode = ErrMode::for_holder(host);
                let ep = connect(ucx, address, mode)?;
                state.eps.insert(address.to_vec(), (ep, mode));
                (ep, mode)
            }
        };
        let (result, ending) = gets_on(ucx, ep, mode, keys, &mut gets, limits);
        match ending {
            Ending::Outstanding => {
                // Destroying the worker purges its endpoints and every get
                // still outstanding; only then may the destinations go.
                state.eps.clear();
                state.ucx = None;
                tracing::warn!(
                    ?mode,
                    "ucx pull failed with gets outstanding: reader worker reset"
                );
            }
            Ending::Settled if result.is_err() => {
                // The endpoint may be broken (peer gone): start afresh next time.
                if let Some((ep, _)) = state.eps.remove(address) {
                    close(ucx, ep);
                }
            }
            Ending::Settled => {}
        }
        drop(gets);
        result
    }
}

fn connect(ucx: &Ucx, address: &[u8], mode: ErrMode) -> Result<sys::ucp_ep_h> {
    // SAFETY: the address bytes are a worker address from the holder
    // (UCX validates them); the params struct is zeroed with masked fields set.
    unsafe {
        let mut params: sys::ucp_ep_params_t = std::mem::zeroed();
        params.field_mask = (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64;
        params.address = address.as_ptr().cast();
        params.err_mode = mode.ucx();
        let mut ep = std::ptr::null_mut();
        check(
            "ucp_ep_create",
            sys::ucp_ep_create(ucx.worker, &params, &mut ep),
        )?;
        Ok(ep)
    }
}

/// Force-closes an endpoint in mode "peer" (completing its outstanding
/// gets as cancelled) and waits a bounded time for the close.
fn close(ucx: &Ucx, ep: sys::ucp_ep_h) {
    // SAFETY: the endpoint is ours; its requests are owned by `gets_on`,
    // which waits for them after a close.
    unsafe {
        let mut param: sys::ucp_request_param_t = std::mem::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        let request = sys::ucp_ep_close_nbx(ep, &param);
        if sys::ucs_ptr_is_ptr(request) {
            let deadline = Instant::now() + Duration::from_secs(1);
            while sys::ucp_request_check_status(request) == sys::UCS_INPROGRESS
                && Instant::now() < deadline
            {
                ucx.progress();
            }
            sys::ucp_request_free(request);
        }
    }
}

/// Frees the requests that have completed; returns whether any did and
/// records the first failure.
fn reap(pending: &mut Vec<sys::ucs_status_ptr_t>, failure: &mut Option<TransferError>) -> bool {
    let before = pending.len();
    pending.retain(|&request| {
        // SAFETY: a live request handle of this worker.
        let status = unsafe { sys::ucp_request_check_status(request) };
        if status == sys::UCS_INPROGRESS {
            return true;
        }
        // SAFETY: completed, so ours to free.
        unsafe { sys::ucp_request_free(request) };
        if status != sys::UCS_OK && status != sys::UCS_ERR_CANCELED && failure.is_none() {
            *failure = Some(fail("get", status));
        }
        false
    });
    pending.len() < before
}

fn gets_on(
    ucx: &Ucx,
    ep: sys::ucp_ep_h,
    mode: ErrMode,
    keys: &[Vec<u8>],
    gets: &mut [Get],
    limits: &Limits,
) -> (Result<u32>, Ending) {
    let mut rkeys = Rkeys(Vec::with_capacity(keys.len()));
    for key in keys {
        let mut rkey = std::ptr::null_mut();
        // SAFETY: unpacks a packed rkey copy; destroyed by `Rkeys` drop.
        let status = unsafe { sys::ucp_ep_rkey_unpack(ep, key.as_ptr().cast(), &mut rkey) };
        if status != sys::UCS_OK {
            return (Err(fail("ucp_ep_rkey_unpack", status)), Ending::Settled);
        }
        rkeys.0.push(rkey);
    }
    let mut pending: Vec<sys::ucs_status_ptr_t> = Vec::with_capacity(WINDOW);
    let mut next = 0usize;
    let mut last_progress = Instant::now();
    let mut failure: Option<TransferError> = None;
    while failure.is_none() && (next < gets.len() || !pending.is_empty()) {
        while failure.is_none() && next < gets.len() && pending.len() < WINDOW {
            let get = &mut gets[next];
            let Some(&rkey) = rkeys.0.get(get.key) else {
                failure = Some(TransferError::Protocol(format!(
                    "block key {} out of range",
                    get.key
                )));
                break;
            };
            let dest = get.dest.as_mut();
            // SAFETY: `dest` is a claimed destination that stays valid
            // (owned by the caller) until this request completes or the
            // worker is destroyed; remote address and rkey come from the
            // holder's descriptor.
            let request = unsafe {
                let param: sys::ucp_request_param_t = std::mem::zeroed();
                sys::ucp_get_nbx(
                    ep,
                    dest.as_mut_ptr().cast(),
                    dest.len(),
                    get.remote,
                    rkey,
                    &param,
                )
            };
            next += 1;
            if sys::ucs_ptr_is_ptr(request) {
                pending.push(request);
            } else if sys::ucs_ptr_is_err(request) {
                failure = Some(fail("ucp_get_nbx", sys::ucs_ptr_raw_status(request)));
            }
        }
        if pending.is_empty() {
            continue;
        }
        ucx.progress();
        if reap(&mut pending, &mut failure) {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > limits.io {
            failure = Some(TransferError::Timeout {
                what: "waiting for ucx gets",
                after: limits.io,
            });
        }
        if failure.is_none() && (limits.fence.is_cut() || Instant::now() >= limits.deadline) {
            failure = Some(TransferError::Timeout {
                what: "pulling a hold (deadline)",
                after: limits.io,
            });
        }
    }
    let Some(failure) = failure else {
        return (Ok(WINDOW.min(gets.len()).max(1) as u32), Ending::Settled);
    };
    if pending.is_empty() {
        return (Err(failure), Ending::Settled);
    }
    if mode == ErrMode::Peer {
        // A force close completes every get still outstanding (cancelled).
        close(ucx, ep);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !pending.is_empty() && Instant::now() < deadline {
            ucx.progress();
            let mut ignored = None;
            reap(&mut pending, &mut ignored);
        }
    }
    let ending = if pending.is_empty() {
        Ending::Settled
    } else {
        Ending::Outstanding
    };
    (Err(failure), ending)
}
/// Unpacked rkeys of one pull; destroyed on drop.
struct Rkeys(Vec<sys::ucp_rkey_h>);

impl Drop for Rkeys {
    fn drop(&mut self) {
        for &rkey in &self.0 {
            // SAFETY: unpacked by us, destroyed once, no get uses it any more.
            unsafe { sys::ucp_rkey_destroy(rkey) };
        }
    }
}

impl Drop for ReaderState {
    fn drop(&mut self) {
        if let Some(ucx) = &self.ucx {
            for (_, (ep, _)) in self.eps.drain() {
                close(ucx, ep);
            }
        }
    }
}
