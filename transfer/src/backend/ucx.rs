//! The UCX backend: one-sided `ucp_get_nbx` reads with packed rkeys.
//!
//! Holder: one UCX context and worker; every registered region is mapped
//! (`ucp_mem_map`) and its packed rkey travels in the descriptor, with the
//! worker's address as the endpoint. A progress thread drives the worker,
//! because on the transports of a machine without RDMA (TCP, shared memory on
//! ordinary memory) UCX emulates gets with messages that the holder must
//! answer. Reader: its own context and worker, an endpoint per holder
//! (cached, error mode "peer"), rkeys unpacked per pull, a window of gets in
//! flight, progressed by the pulling thread itself (tokio's blocking pool)
//! until done, failed, or no get finished for one I/O timeout, in which case
//! the gets are cancelled and the endpoint is force-closed.
#![allow(unsafe_code)]

use super::{Backend, Exposure, Fetch, Role};
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

/// A reader's endpoints, by holder worker address.
struct Endpoints(HashMap<Vec<u8>, sys::ucp_ep_h>);

// SAFETY: endpoints are only used under the reader's mutex.
unsafe impl Send for Endpoints {}

/// The reader's worker and endpoints; pulls take turns on them.
struct ReaderSide {
    ucx: Arc<Ucx>,
    eps: Mutex<Endpoints>,
}

pub(crate) struct UcxBackend {
    ucx: Arc<Ucx>,
    /// Holder: the worker address readers connect to.
    address: Vec<u8>,
    reader: Arc<ReaderSide>,
    /// Holder fault switch: stop progressing once a pull starts.
    stall_on_pull: bool,
    stalled: Arc<AtomicBool>,
    _progress: Option<Progress>,
}

impl UcxBackend {
    pub(crate) fn new(role: Role<'_>) -> Result<Self> {
        let ucx = Arc::new(Ucx::new()?);
        let address = ucx.address()?;
        let stalled = Arc::new(AtomicBool::new(false));
        let (progress, stall_on_pull) = match role {
            Role::Holder { faults } => {
                let stop = Arc::new(AtomicBool::new(false));
                let thread = {
                    let (ucx, stop, stalled) = (ucx.clone(), stop.clone(), stalled.clone());
                    std::thread::Builder::new()
                        .name("connex-ucx-progress".into())
                        .spawn(move || progress_loop(&ucx, &stop, &stalled))?
                };
                (
                    Some(Progress {
                        stop,
                        thread: Some(thread),
                    }),
                    faults.stall_after_bytes.is_some(),
                )
            }
            Role::Reader => (None, false),
        };
        Ok(Self {
            ucx: ucx.clone(),
            address,
            reader: Arc::new(ReaderSide {
                ucx: ucx.clone(),
                eps: Mutex::new(Endpoints(HashMap::new())),
            }),
            stall_on_pull,
            stalled,
            _progress: progress,
        })
    }
}

/// Drives the holder's worker: busy while there is work, then backing off to
/// short sleeps so an idle holder costs little CPU.
fn progress_loop(ucx: &Ucx, stop: &AtomicBool, stalled: &AtomicBool) {
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        if stalled.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
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
                sys::ucp_mem_map(self.ucx.context, &params, &mut memh),
            )?;
            let mapping = Mapping {
                ucx: self.ucx.clone(),
                memh,
            };
            let mut buf = std::ptr::null_mut();
            let mut len = 0usize;
            check(
                "ucp_rkey_pack",
                sys::ucp_rkey_pack(self.ucx.context, memh, &mut buf, &mut len),
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
        if self.stall_on_pull {
            self.stalled.store(true, Ordering::Relaxed);
        }
    }

    fn endpoint(&self) -> Vec<u8> {
        self.address.clone()
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
            let (endpoint, keys, io) = (d.endpoint.clone(), d.keys.clone(), job.io_timeout);
            // The task owns everything it touches (a dropped pull future
            // leaves it to finish on its own, bounded by `io`).
            let side = self.reader.clone();
            tokio::task::spawn_blocking(move || side.run_gets(&endpoint, &keys, gets, io))
                .await
                .map_err(|e| TransferError::Protocol(format!("ucx pull task: {e}")))?
        })
    }
}

/// One block to fetch.
struct Get {
    dest: DestSpan,
    remote: u64,
    key: usize,
}

impl ReaderSide {
    /// Issues the gets (a window at a time) and progresses until all are done.
    fn run_gets(
        &self,
        endpoint: &[u8],
        keys: &[Vec<u8>],
        gets: Vec<Get>,
        io: Duration,
    ) -> Result<u32> {
        let mut eps = self.eps.lock().unwrap_or_else(|e| e.into_inner());
        let ep = match eps.0.get(endpoint) {
            Some(ep) => *ep,
            None => {
                let ep = self.connect(endpoint)?;
                eps.0.insert(endpoint.to_vec(), ep);
                ep
            }
        };
        let mut closed = false;
        let result = self.gets_on(ep, keys, gets, io, &mut closed);
        if result.is_err() {
            // The endpoint may be broken (peer gone, cancelled gets): start afresh next time.
            eps.0.remove(endpoint);
            if !closed {
                self.close(ep);
            }
        }
        result
    }

    fn connect(&self, endpoint: &[u8]) -> Result<sys::ucp_ep_h> {
        // SAFETY: the address bytes are a worker address from the holder
        // (UCX validates them); the params struct is zeroed with masked fields set.
        unsafe {
            let mut params: sys::ucp_ep_params_t = std::mem::zeroed();
            // Error mode "peer": a dead holder fails the gets, and a force
            // close completes every outstanding get (cancelled), so a failed
            // pull never leaves UCX writing into its destination. The price
            // on UCX 1.13: no shared-memory transports in this mode (RMA goes
            // over tcp/lo, emulated with messages). In mode "none" shared
            // memory is used (several times faster here) but gets to a dead
            // peer can never be completed or revoked. See docs/transfer.md.
            params.field_mask = (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64;
            params.address = endpoint.as_ptr().cast();
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            let mut ep = std::ptr::null_mut();
            check(
                "ucp_ep_create",
                sys::ucp_ep_create(self.ucx.worker, &params, &mut ep),
            )?;
            Ok(ep)
        }
    }

    fn close(&self, ep: sys::ucp_ep_h) {
        // SAFETY: the endpoint is ours and no request on it is outstanding
        // (gets_on waits for or cancels every one of them).
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
                    self.ucx.progress();
                }
                sys::ucp_request_free(request);
            }
        }
    }

    fn gets_on(
        &self,
        ep: sys::ucp_ep_h,
        keys: &[Vec<u8>],
        mut gets: Vec<Get>,
        io: Duration,
        closed: &mut bool,
    ) -> Result<u32> {
        let mut rkeys = Rkeys(Vec::with_capacity(keys.len()));
        for key in keys {
            let mut rkey = std::ptr::null_mut();
            // SAFETY: unpacks a packed rkey copy; destroyed by `Rkeys` drop.
            check("ucp_ep_rkey_unpack", unsafe {
                sys::ucp_ep_rkey_unpack(ep, key.as_ptr().cast(), &mut rkey)
            })?;
            rkeys.0.push(rkey);
        }
        let mut pending: Vec<sys::ucs_status_ptr_t> = Vec::with_capacity(WINDOW);
        let mut next = 0usize;
        let mut last_progress = Instant::now();
        let mut failure: Option<TransferError> = None;
        while next < gets.len() || !pending.is_empty() {
            while failure.is_none() && next < gets.len() && pending.len() < WINDOW {
                let get = &mut gets[next];
                let rkey = *rkeys.0.get(get.key).ok_or_else(|| {
                    TransferError::Protocol(format!("block key {} out of range", get.key))
                })?;
                let dest = get.dest.as_mut();
                // SAFETY: `dest` is a claimed destination that stays valid
                // (owned by `gets`) until this request completes; the remote
                // address and rkey come from the holder's descriptor.
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
                if failure.is_some() {
                    break;
                }
                continue;
            }
            self.ucx.progress();
            let before = pending.len();
            pending.retain(|&request| {
                // SAFETY: a live request handle of this worker.
                let status = unsafe { sys::ucp_request_check_status(request) };
                if status == sys::UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: completed, so ours to free.
                unsafe { sys::ucp_request_free(request) };
                if status != sys::UCS_OK && failure.is_none() {
                    failure = Some(fail("get", status));
                }
                false
            });
            if pending.len() < before {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > io || failure.is_some() {
                // Nothing finished for a whole I/O timeout (or a get failed):
                // force-close the endpoint, which completes every get still
                // outstanding on it (cancelled), and wait for that.
                self.close(ep);
                *closed = true;
                let deadline = Instant::now() + Duration::from_secs(2);
                while !pending.is_empty() && Instant::now() < deadline {
                    self.ucx.progress();
                    pending.retain(|&request| {
                        // SAFETY: as above.
                        let done = unsafe { sys::ucp_request_check_status(request) }
                            != sys::UCS_INPROGRESS;
                        if done {
                            // SAFETY: completed (cancelled), ours to free.
                            unsafe { sys::ucp_request_free(request) };
                        }
                        !done
                    });
                }
                if !pending.is_empty() {
                    // UCX would still write into these destinations: keep them
                    // (and their claims) forever rather than risk it.
                    std::mem::forget(gets);
                    return Err(TransferError::Timeout {
                        what: "waiting for ucx gets (some never completed)",
                        after: io,
                    });
                }
                return Err(failure.unwrap_or(TransferError::Timeout {
                    what: "waiting for ucx gets",
                    after: io,
                }));
            }
        }
        match failure {
            Some(err) => Err(err),
            None => Ok(WINDOW.min(gets.len()).max(1) as u32),
        }
    }
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

impl Drop for ReaderSide {
    fn drop(&mut self) {
        let eps = std::mem::take(&mut self.eps.get_mut().unwrap_or_else(|e| e.into_inner()).0);
        for (_, ep) in eps {
            self.close(ep);
        }
    }
}
