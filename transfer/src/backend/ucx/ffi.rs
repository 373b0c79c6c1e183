//! Safe wrappers over the UCX calls the backend makes: a context with one
//! worker, memory mappings and their packed rkeys, endpoints, unpacked
//! rkeys, gets and their requests. All of the backend's `unsafe` lives here,
//! each block with the reason it is sound; `holder.rs` and `reader.rs` are
//! safe code over these types.
#![allow(unsafe_code)]

use crate::error::{Result, TransferError};
use connex_ucx_sys as sys;
use std::ffi::CStr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn status_text(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any status.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}

pub(super) fn fail(what: &str, status: sys::ucs_status_t) -> TransferError {
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
pub(super) struct Ucx {
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
    pub(super) fn new() -> Result<Self> {
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

    /// The worker's address, as a remote endpoint needs it.
    pub(super) fn address(&self) -> Result<Vec<u8>> {
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

    /// One round of the worker's progress; how many events it handled.
    pub(super) fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used by this thread alone now.
        unsafe { sys::ucp_worker_progress(self.worker) }
    }

    /// Maps `len` bytes at `addr` for remote reads; returns the mapping
    /// (unmapped on drop) and its packed rkey.
    ///
    /// The memory must stay valid until the mapping is dropped: the region
    /// table keeps the mapping as the region's keepalive, which it drops
    /// before the region's memory.
    pub(super) fn map(self: &Arc<Self>, addr: u64, len: usize) -> Result<(Mapping, Vec<u8>)> {
        // SAFETY: the params struct is zeroed with only the masked fields
        // set; UCX only records the range here (it is read remotely later,
        // while the caller keeps it valid as documented above).
        let memh = unsafe {
            let mut params: sys::ucp_mem_map_params_t = std::mem::zeroed();
            params.field_mask =
                (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
            params.address = addr as *mut std::ffi::c_void;
            params.length = len;
            let mut memh = std::ptr::null_mut();
            check(
                "ucp_mem_map",
                sys::ucp_mem_map(self.context, &params, &mut memh),
            )?;
            memh
        };
        let mapping = Mapping {
            ucx: self.clone(),
            memh,
        };
        // SAFETY: `memh` is a live mapping of this context; the packed key
        // is copied, then its buffer released.
        let key = unsafe {
            let mut buf = std::ptr::null_mut();
            let mut len = 0usize;
            check(
                "ucp_rkey_pack",
                sys::ucp_rkey_pack(self.context, memh, &mut buf, &mut len),
            )?;
            let key = std::slice::from_raw_parts(buf.cast::<u8>(), len).to_vec();
            sys::ucp_rkey_buffer_release(buf);
            key
        };
        Ok((mapping, key))
    }

    /// An endpoint to the worker at `address` (from a holder's descriptor).
    pub(super) fn connect(&self, address: &[u8], mode: ErrMode) -> Result<Endpoint> {
        // SAFETY: the address bytes are a worker address from the holder
        // (UCX validates them); the params struct is zeroed with masked
        // fields set; UCX copies what it needs before returning.
        unsafe {
            let mut params: sys::ucp_ep_params_t = std::mem::zeroed();
            params.field_mask = (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64;
            params.address = address.as_ptr().cast();
            params.err_mode = match mode {
                ErrMode::Peer => sys::UCP_ERR_HANDLING_MODE_PEER,
                ErrMode::None => sys::UCP_ERR_HANDLING_MODE_NONE,
            };
            let mut ep = std::ptr::null_mut();
            check(
                "ucp_ep_create",
                sys::ucp_ep_create(self.worker, &params, &mut ep),
            )?;
            Ok(Endpoint(ep))
        }
    }
}

/// Whether the UCX library loaded here moves CUDA memory (it was built with
/// CUDA and found the CUDA driver): asked once of a context of our own, as
/// its supported memory types. Without it, UCX treats every address as host
/// memory, so a device pointer must never reach it.
pub(super) fn cuda_memory_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let Ok(ucx) = Ucx::new() else {
            return false;
        };
        // SAFETY: the context is live; attr is a zeroed C struct with only
        // the masked field asked for.
        unsafe {
            let mut attr: sys::ucp_context_attr_t = std::mem::zeroed();
            attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64;
            if sys::ucp_context_query(ucx.context, &mut attr) != sys::UCS_OK {
                return false;
            }
            attr.memory_types & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0
        }
    })
}

impl Drop for Ucx {
    fn drop(&mut self) {
        // SAFETY: nothing uses the worker or context any more (we own them,
        // and mappings hold an Arc of this).
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

/// A mapped region; unmapped on drop (before the region's memory goes).
pub(super) struct Mapping {
    ucx: Arc<Ucx>,
    memh: sys::ucp_mem_h,
}

// SAFETY: a memh is an opaque handle; unmap is a context call (thread-safe).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `Ucx::map` on this context, unmapped once.
        let status = unsafe { sys::ucp_mem_unmap(self.ucx.context, self.memh) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %status_text(status), "ucp_mem_unmap");
        }
    }
}

/// How an endpoint treats its peer's failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ErrMode {
    /// UCX reports a dead peer and a force close cancels every get. On UCX
    /// 1.13 this mode leaves out the shared-memory transports.
    Peer,
    /// Shared memory is used; a dead holder's gets can never complete nor be
    /// cancelled, so a failed pull destroys the whole reader worker (which
    /// purges them) before its destinations are given back.
    None,
}

/// An endpoint of a reader's worker. A plain handle: the reader closes it
/// (or destroys its worker, which purges it) exactly once.
#[derive(Clone, Copy)]
pub(super) struct Endpoint(sys::ucp_ep_h);

// SAFETY: endpoints are only used by whoever holds the reader's mutex.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Force-closes the endpoint (in mode "peer" this completes its
    /// outstanding gets as cancelled) and waits a bounded time for the close.
    pub(super) fn close(self, ucx: &Ucx) {
        // SAFETY: the endpoint belongs to `ucx`'s worker and is closed once;
        // its requests are owned by the caller, which reaps them afterwards.
        unsafe {
            let mut param: sys::ucp_request_param_t = std::mem::zeroed();
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
            let request = sys::ucp_ep_close_nbx(self.0, &param);
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

    /// Unpacks a pull's packed rkeys for this endpoint.
    pub(super) fn unpack(self, keys: &[Vec<u8>]) -> Result<Rkeys> {
        let mut rkeys = Rkeys(Vec::with_capacity(keys.len()));
        for key in keys {
            let mut rkey = std::ptr::null_mut();
            // SAFETY: unpacks a copy of a packed rkey (UCX validates it);
            // destroyed by `Rkeys`'s drop.
            let status = unsafe { sys::ucp_ep_rkey_unpack(self.0, key.as_ptr().cast(), &mut rkey) };
            if status != sys::UCS_OK {
                return Err(fail("ucp_ep_rkey_unpack", status));
            }
            rkeys.0.push(rkey);
        }
        Ok(rkeys)
    }

    /// Starts a get of `dest.len()` bytes at `remote` into `dest`.
    /// `Ok(None)`: done already; `Ok(Some(request))`: in flight.
    ///
    /// `dest` must stay valid and unread until the request completes, is
    /// cancelled, or the worker is destroyed: the reader's claimed
    /// destinations guarantee it (see `reader.rs`).
    pub(super) fn get(
        self,
        dest: &mut [u8],
        remote: u64,
        rkeys: &Rkeys,
        key: usize,
    ) -> Result<Option<Request>> {
        let Some(&rkey) = rkeys.0.get(key) else {
            return Err(TransferError::Protocol(format!(
                "block key {key} out of range"
            )));
        };
        // SAFETY: `dest` stays valid as documented above; remote address and
        // rkey come from the holder's descriptor (UCX checks the range
        // against the rkey); the params struct is zeroed (no callbacks).
        let request = unsafe {
            let param: sys::ucp_request_param_t = std::mem::zeroed();
            sys::ucp_get_nbx(
                self.0,
                dest.as_mut_ptr().cast(),
                dest.len(),
                remote,
                rkey,
                &param,
            )
        };
        if sys::ucs_ptr_is_ptr(request) {
            Ok(Some(Request(request)))
        } else if sys::ucs_ptr_is_err(request) {
            Err(fail("ucp_get_nbx", sys::ucs_ptr_raw_status(request)))
        } else {
            Ok(None)
        }
    }
}

/// Unpacked rkeys of one pull; destroyed on drop.
pub(super) struct Rkeys(Vec<sys::ucp_rkey_h>);

impl Drop for Rkeys {
    fn drop(&mut self) {
        for &rkey in &self.0 {
            // SAFETY: unpacked by us, destroyed once. The reader drops the
            // rkeys after its gets have ended, or, when some are still
            // outstanding, just before it destroys the worker without
            // progressing it again, so no get touches them afterwards.
            unsafe { sys::ucp_rkey_destroy(rkey) };
        }
    }
}

/// A get in flight.
pub(super) struct Request(sys::ucs_status_ptr_t);

/// Frees the requests that have completed; returns whether any did and
/// records the first failure (a cancelled get is not one).
pub(super) fn reap(pending: &mut Vec<Request>, failure: &mut Option<TransferError>) -> bool {
    let before = pending.len();
    pending.retain(|request| {
        // SAFETY: a live request handle of this worker, not freed yet.
        let status = unsafe { sys::ucp_request_check_status(request.0) };
        if status == sys::UCS_INPROGRESS {
            return true;
        }
        // SAFETY: completed, so ours to free, once (it leaves the list).
        unsafe { sys::ucp_request_free(request.0) };
        if status != sys::UCS_OK && status != sys::UCS_ERR_CANCELED && failure.is_none() {
            *failure = Some(fail("get", status));
        }
        false
    });
    pending.len() < before
}
