//! The Mooncake backend: reads through Mooncake Transfer Engine's C API.
//!
//! Holder and reader each run an engine with P2P handshake metadata (no
//! metadata server; a segment is named by its engine's `ip:port`) and the TCP
//! transport (RDMA where the library and the NICs have it). The holder
//! registers its regions with the engine; the descriptor carries the segment
//! name as endpoint and the blocks' virtual addresses. The reader registers
//! its destination regions, opens the holder's segment once, and submits a
//! batch of READ requests, polling their status until done, failed, or no
//! request finished for one I/O timeout.
//!
//! Built only with the `mooncake` feature against a library the user
//! provides (see mooncake-sys/build.rs); not run in this project's CI, which
//! has no such library. docs/transfer.md says so.
#![allow(unsafe_code)]

use super::{Backend, Exposure, Fetch, Role};
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::region::{DestSpan, RegionEntry};
use connex_mooncake_sys as sys;
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn fail(message: impl Into<String>) -> TransferError {
    TransferError::Backend {
        backend: "mooncake",
        message: message.into(),
    }
}

fn cstring(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| fail(format!("{text:?} contains a NUL byte")))
}

/// One engine; destroyed on drop.
struct Engine(sys::transfer_engine_t);

// SAFETY: the engine's C API is documented thread-safe for these calls; the
// reader additionally serialises its batches under a mutex.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

impl Engine {
    fn new() -> Result<Self> {
        let (meta, host) = (cstring("P2PHANDSHAKE")?, cstring("127.0.0.1")?);
        // SAFETY: the strings outlive the calls (the API copies them).
        unsafe {
            let engine =
                sys::createTransferEngine(meta.as_ptr(), host.as_ptr(), host.as_ptr(), 0, 0);
            if engine.is_null() {
                return Err(fail(
                    "createTransferEngine failed (P2PHANDSHAKE on 127.0.0.1)",
                ));
            }
            let engine = Engine(engine);
            let tcp = cstring("tcp")?;
            if sys::installTransport(engine.0, tcp.as_ptr(), std::ptr::null_mut()).is_null() {
                return Err(fail(
                    "installTransport(tcp) failed (is libibverbs1 installed?)",
                ));
            }
            Ok(engine)
        }
    }

    /// The segment name readers open: this engine's `ip:port`.
    fn segment_name(&self) -> Result<String> {
        let mut buf = vec![0 as std::os::raw::c_char; 256];
        // SAFETY: `buf` is writable for its length; the result is NUL-terminated.
        unsafe {
            if sys::getLocalIpAndPort(self.0, buf.as_mut_ptr(), buf.len()) != 0 {
                return Err(fail("getLocalIpAndPort failed"));
            }
            Ok(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
        }
    }

    fn register(self: &Arc<Self>, region: &RegionEntry) -> Result<Exposure> {
        if region.region.is_empty() {
            return Ok(Exposure::default());
        }
        let location = cstring("cpu:0")?;
        let addr = region.region.addr() as *mut std::ffi::c_void;
        // SAFETY: the region's memory is valid while the entry lives; the
        // registration (its keepalive) is dropped before the memory.
        let rc = unsafe {
            sys::registerLocalMemory(self.0, addr, region.region.len(), location.as_ptr(), 1)
        };
        if rc != 0 {
            return Err(fail(format!("registerLocalMemory failed ({rc})")));
        }
        Ok(Exposure {
            key: None,
            keepalive: Some(Box::new(Registration {
                engine: self.clone(),
                addr: addr as usize,
            })),
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: created by createTransferEngine, destroyed once.
        unsafe { sys::destroyTransferEngine(self.0) };
    }
}

/// A registered region; unregistered on drop.
struct Registration {
    engine: Arc<Engine>,
    addr: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: registered by `Engine::register` at this address.
        unsafe { sys::unregisterLocalMemory(self.engine.0, self.addr as *mut std::ffi::c_void) };
    }
}

pub(crate) struct MooncakeBackend {
    engine: Arc<Engine>,
    segment_name: String,
    /// Reader: opened segments by name; batches take turns.
    segments: Arc<Mutex<HashMap<String, sys::segment_id_t>>>,
}

impl MooncakeBackend {
    pub(crate) fn new(_role: Role<'_>) -> Result<Self> {
        let engine = Arc::new(Engine::new()?);
        let segment_name = engine.segment_name()?;
        Ok(Self {
            engine,
            segment_name,
            segments: Arc::new(Mutex::new(HashMap::new())),
        })
    }
}

impl Backend for MooncakeBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Mooncake
    }

    fn expose(&self, region: &RegionEntry) -> Result<Exposure> {
        self.engine.register(region)
    }

    fn register_local(&self, region: &RegionEntry) -> Result<Exposure> {
        self.engine.register(region)
    }

    fn endpoint(&self) -> Vec<u8> {
        self.segment_name.clone().into_bytes()
    }

    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let name = String::from_utf8(job.descriptor.endpoint.clone()).map_err(|_| {
                TransferError::Protocol("mooncake segment name is not UTF-8".into())
            })?;
            let reads: Vec<(DestSpan, u64)> = job
                .descriptor
                .blocks
                .iter()
                .zip(job.dest)
                .filter(|(b, _)| b.len > 0)
                .map(|(b, dest)| (dest, b.addr))
                .collect();
            let (engine, segments, io) =
                (self.engine.clone(), self.segments.clone(), job.io_timeout);
            tokio::task::spawn_blocking(move || read_batch(&engine, &segments, &name, reads, io))
                .await
                .map_err(|e| TransferError::Protocol(format!("mooncake pull task: {e}")))?
        })
    }
}

fn read_batch(
    engine: &Engine,
    segments: &Mutex<HashMap<String, sys::segment_id_t>>,
    name: &str,
    mut reads: Vec<(DestSpan, u64)>,
    io: Duration,
) -> Result<u32> {
    let mut segments = segments.lock().unwrap_or_else(|e| e.into_inner());
    let segment = match segments.get(name) {
        Some(id) => *id,
        None => {
            let cname = cstring(name)?;
            // SAFETY: the name outlives the call.
            let id = unsafe { sys::openSegment(engine.0, cname.as_ptr()) };
            if id < 0 {
                return Err(fail(format!("openSegment({name}) failed ({id})")));
            }
            segments.insert(name.to_string(), id);
            id
        }
    };
    if reads.is_empty() {
        return Ok(0);
    }
    let mut requests: Vec<sys::transfer_request> = reads
        .iter_mut()
        .map(|(dest, remote)| {
            let dest = dest.as_mut();
            sys::transfer_request {
                opcode: sys::OPCODE_READ,
                source: dest.as_mut_ptr().cast(),
                target_id: segment,
                file_id: 0,
                target_offset: *remote,
                length: dest.len() as u64,
            }
        })
        .collect();
    // SAFETY: the batch and requests are ours; every destination is a claimed
    // range kept alive by `reads` until the batch is finished or abandoned.
    unsafe {
        let batch = sys::allocateBatchID(engine.0, requests.len());
        if batch == sys::INVALID_BATCH {
            return Err(fail("allocateBatchID failed"));
        }
        let rc = sys::submitTransfer(engine.0, batch, requests.as_mut_ptr(), requests.len());
        if rc != 0 {
            sys::freeBatchID(engine.0, batch);
            return Err(fail(format!("submitTransfer failed ({rc})")));
        }
        let mut done = vec![false; requests.len()];
        let (mut left, mut last_progress) = (requests.len(), Instant::now());
        while left > 0 {
            let before = left;
            for (task, finished) in done.iter_mut().enumerate() {
                if *finished {
                    continue;
                }
                let mut status = sys::transfer_status::default();
                if sys::getTransferStatus(engine.0, batch, task, &mut status) != 0 {
                    segments.remove(name);
                    std::mem::forget(reads);
                    return Err(fail("getTransferStatus failed"));
                }
                match status.status {
                    sys::STATUS_COMPLETED => {
                        *finished = true;
                        left -= 1;
                    }
                    sys::STATUS_WAITING | sys::STATUS_PENDING => {}
                    other => {
                        segments.remove(name);
                        // The engine may still touch the other destinations:
                        // keep them (and their claims) rather than risk it.
                        std::mem::forget(reads);
                        return Err(fail(format!("read {task} ended with status {other}")));
                    }
                }
            }
            if left < before {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > io {
                segments.remove(name);
                std::mem::forget(reads);
                return Err(TransferError::Timeout {
                    what: "waiting for mooncake reads",
                    after: io,
                });
            } else {
                std::thread::yield_now();
            }
        }
        sys::freeBatchID(engine.0, batch);
    }
    Ok(requests.len() as u32)
}
