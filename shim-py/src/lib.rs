//! `connex._transfer`: connex-transfer for Python (the vLLM connector calls
//! Rust for all transfer work).
//!
//! One tokio runtime per process serves every `Holder` and `Reader`. Calls
//! that wait (`pull`, `release`, `renew`, `stat`, `close`) release the GIL
//! while they wait. Errors are raised as `TransferError` or one of its
//! subclasses. Memory is registered by address and length: the caller keeps
//! it alive (a tensor, a `bytearray`, a ctypes buffer).
// The module takes raw addresses from Python; that is its whole job.
#![allow(unsafe_code)]

use connex_transfer as ct;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

create_exception!(
    connex._transfer,
    TransferError,
    PyException,
    "A transfer failed."
);
create_exception!(
    connex._transfer,
    HoldNotFound,
    TransferError,
    "The hold is unknown, released, expired or evicted."
);
create_exception!(
    connex._transfer,
    StaleEpoch,
    TransferError,
    "The hold already served a higher resume epoch."
);
create_exception!(
    connex._transfer,
    EpochOutOfRange,
    StaleEpoch,
    "The resume epoch is above the holder's bound (the hold cannot be resumed that far)."
);
create_exception!(
    connex._transfer,
    Unreachable,
    TransferError,
    "The holder could not be reached."
);
create_exception!(
    connex._transfer,
    Unauthorized,
    TransferError,
    "The transfer handshake failed: this side or the peer lacks the transfer secret or has another."
);
create_exception!(
    connex._transfer,
    TransferTimeout,
    TransferError,
    "A transfer step took longer than its limit."
);

fn to_py(err: ct::TransferError) -> PyErr {
    let text = err.to_string();
    match err {
        ct::TransferError::HoldNotFound { .. } => HoldNotFound::new_err(text),
        ct::TransferError::StaleEpoch { .. } => StaleEpoch::new_err(text),
        ct::TransferError::EpochOutOfRange { .. } => EpochOutOfRange::new_err(text),
        ct::TransferError::Unreachable { .. } => Unreachable::new_err(text),
        ct::TransferError::Timeout { .. } => TransferTimeout::new_err(text),
        ct::TransferError::Unauthorized(_) => Unauthorized::new_err(text),
        _ => TransferError::new_err(text),
    }
}

/// A `secret=` argument: `None` takes `CONNEX_TRANSFER_SECRET`, `""` none.
fn secret(secret: Option<String>) -> Option<ct::Secret> {
    match secret {
        None => ct::Secret::from_env(),
        Some(secret) => ct::Secret::new(secret),
    }
}

/// The process-wide runtime.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("connex-transfer")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| TransferError::new_err(format!("cannot start the runtime: {e}")))
}

fn backend(name: &str) -> PyResult<ct::BackendKind> {
    name.parse().map_err(PyValueError::new_err)
}

fn blocks(list: Vec<(u64, u64, u64)>) -> Vec<ct::BlockRef> {
    list.into_iter()
        .map(|(region, offset, len)| ct::BlockRef::new(ct::RegionId(region), offset, len))
        .collect()
}

/// Caller memory as a region.
fn raw_region(ptr: usize, length: usize) -> PyResult<ct::Region> {
    if ptr == 0 && length > 0 {
        return Err(PyValueError::new_err("null pointer"));
    }
    // SAFETY: the Python caller promises (documented on register_region) that
    // `ptr..ptr+length` stays valid while registered, held or pulled into.
    Ok(unsafe { ct::Region::raw(ptr as *mut u8, length) })
}

fn info_dict<'py>(py: Python<'py>, info: &ct::HoldInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("transfer_id", &info.transfer_id)?;
    d.set_item("blocks", info.blocks)?;
    d.set_item("bytes", info.bytes)?;
    d.set_item("expires_in_s", info.expires_in_ms as f64 / 1000.0)?;
    d.set_item("epoch", info.epoch)?;
    d.set_item("pulls", info.pulls)?;
    Ok(d)
}

fn stats_dict<'py>(py: Python<'py>, s: &ct::HolderStats) -> PyResult<Bound<'py, PyDict>> {
    [
        ("holds", s.holds),
        ("held_bytes", s.held_bytes),
        ("pulls", s.pulls),
        ("releases", s.releases),
        ("expiries", s.expiries),
        ("evictions", s.evictions),
        ("stale_epoch_refusals", s.stale_epoch_refusals),
        ("bytes_served", s.bytes_served),
    ]
    .into_py_dict(py)
}

fn pull_dict<'py>(py: Python<'py>, stats: &ct::PullStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", stats.bytes)?;
    d.set_item("blocks", stats.blocks)?;
    d.set_item("streams", stats.streams)?;
    d.set_item("elapsed_s", stats.elapsed.as_secs_f64())?;
    Ok(d)
}

/// Holds KV blocks for remote readers (a prefill engine).
#[pyclass(module = "connex._transfer")]
struct Holder {
    inner: Mutex<Option<Arc<ct::Holder>>>,
}

impl Holder {
    fn get(&self) -> PyResult<Arc<ct::Holder>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| TransferError::new_err("holder is closed"))
    }
}

#[pymethods]
impl Holder {
    /// `stall_after_bytes` is a fault for tests: the holder stops serving
    /// block bytes after that many (the read stays in flight until fenced).
    #[new]
    #[pyo3(signature = (backend="tcp", listen="127.0.0.1:0", retain_s=60.0, release="on_release", budget_bytes=0, secret=None, max_epoch=ct::DEFAULT_MAX_EPOCH, stall_after_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &str,
        listen: &str,
        retain_s: f64,
        release: &str,
        budget_bytes: u64,
        secret: Option<String>,
        max_epoch: u32,
        stall_after_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let retain = Duration::try_from_secs_f64(retain_s)
            .map_err(|_| PyValueError::new_err("retain_s must be a positive number of seconds"))?;
        let config = ct::HolderConfig {
            listen: listen
                .parse()
                .map_err(|e| PyValueError::new_err(format!("listen {listen:?}: {e}")))?,
            backend: self::backend(backend)?,
            retain,
            release: release.parse().map_err(PyValueError::new_err)?,
            budget_bytes: (budget_bytes > 0).then_some(budget_bytes),
            secret: self::secret(secret),
            max_epoch,
            faults: ct::Faults {
                stall_after_bytes,
                ..ct::Faults::default()
            },
            ..ct::HolderConfig::default()
        };
        let rt = runtime()?;
        let holder = py
            .detach(|| rt.block_on(ct::Holder::start(config)))
            .map_err(to_py)?;
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(holder))),
        })
    }

    /// "host:port" of the control listener (`remote_ctrl`).
    #[getter]
    fn ctrl_addr(&self) -> PyResult<String> {
        Ok(self.get()?.ctrl_addr().to_string())
    }

    /// Whether the backend serves GPU memory directly (UCX built with CUDA);
    /// false: register host memory only.
    #[getter]
    fn moves_device_memory(&self) -> PyResult<bool> {
        Ok(self.get()?.device_memory())
    }

    /// Draining holds: freed, but not reported by `freed()` yet because a
    /// read of them has not stopped.
    fn draining(&self) -> PyResult<usize> {
        Ok(self.get()?.draining())
    }

    /// Registers caller-owned memory (e.g. `tensor.data_ptr()`); it must stay
    /// valid, and its held blocks unwritten, while registered or held.
    fn register_region(&self, ptr: usize, length: usize) -> PyResult<u64> {
        let region = raw_region(ptr, length)?;
        Ok(self.get()?.register_region(region).map_err(to_py)?.0)
    }

    fn unregister_region(&self, region: u64) -> PyResult<bool> {
        Ok(self.get()?.unregister_region(ct::RegionId(region)))
    }

    /// Holds `blocks` = [(region, offset, length), ...] under `transfer_id`,
    /// which must end with 128 random bits in hex (`new_transfer_id()`).
    fn create_hold(&self, transfer_id: &str, blocks: Vec<(u64, u64, u64)>) -> PyResult<()> {
        self.get()?
            .create_hold(transfer_id, self::blocks(blocks))
            .map_err(to_py)
    }

    /// Frees a hold here (idempotent).
    fn release(&self, transfer_id: &str) -> PyResult<bool> {
        Ok(self.get()?.release(transfer_id))
    }

    /// Transfer ids released, expired or evicted since the last call whose
    /// last read has stopped: their blocks may be reused now (a hold freed
    /// while a reader streams it is reported once that read has ended).
    fn freed(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.freed())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.get()?.stats())
    }

    /// Stops serving; idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let holder = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(holder) = holder {
            let rt = runtime()?;
            py.detach(|| rt.block_on(holder.stop()));
        }
        Ok(())
    }
}

/// A pull running in the background.
#[pyclass(module = "connex._transfer")]
struct Pull {
    handle: Mutex<Option<tokio::task::JoinHandle<ct::Result<ct::PullStats>>>>,
    outcome: Mutex<Option<Result<ct::PullStats, String>>>,
}

#[pymethods]
impl Pull {
    /// Whether the pull finished (successfully or not).
    fn done(&self) -> bool {
        if self
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return true;
        }
        self.handle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|h| h.is_finished())
    }

    /// Waits for the pull; returns its stats or raises its error.
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let rt = runtime()?;
            let joined = py.detach(|| rt.block_on(handle));
            let outcome = match joined {
                Ok(Ok(stats)) => Ok(stats),
                Ok(Err(err)) => {
                    // Keep the typed error for this first raise.
                    *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(Err(err.to_string()));
                    return Err(to_py(err));
                }
                Err(err) => Err(format!("pull task failed: {err}")),
            };
            *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        }
        match &*self.outcome.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(stats)) => pull_dict(py, stats),
            Some(Err(message)) => Err(TransferError::new_err(message.clone())),
            None => Err(TransferError::new_err("pull has no result")),
        }
    }
}

/// Pulls holds into registered memory (a decoder).
#[pyclass(module = "connex._transfer")]
struct Reader {
    inner: Arc<ct::Reader>,
}

#[pymethods]
impl Reader {
    #[new]
    #[pyo3(signature = (backend="tcp", secret=None))]
    fn new(backend: &str, secret: Option<String>) -> PyResult<Self> {
        let mut config = ct::ReaderConfig::new(self::backend(backend)?);
        config.client.secret = self::secret(secret);
        Ok(Self {
            inner: Arc::new(ct::Reader::with_config(config).map_err(to_py)?),
        })
    }

    /// Whether the backend writes GPU memory directly (UCX built with CUDA);
    /// false: pull into host memory, then copy to the device.
    #[getter]
    fn moves_device_memory(&self) -> bool {
        self.inner.device_memory()
    }

    /// Registers caller-owned destination memory; it must stay valid while
    /// registered or pulled into, and not be read during a pull.
    fn register_region(&self, ptr: usize, length: usize) -> PyResult<u64> {
        let region = raw_region(ptr, length)?;
        Ok(self.inner.register_region(region).map_err(to_py)?.0)
    }

    fn unregister_region(&self, region: u64) -> PyResult<bool> {
        Ok(self.inner.unregister_region(ct::RegionId(region)))
    }

    /// Whether a pull may still write into `blocks` = [(region, offset,
    /// length), ...]: true while one runs, and after a failed Mooncake pull
    /// until its queued reads have ended (Mooncake cannot cancel a read).
    /// Blocks must not go back to the engine while it is true.
    fn writing_into(&self, blocks: Vec<(u64, u64, u64)>) -> bool {
        self.inner.writing_into(&self::blocks(blocks))
    }

    /// Pulls hold `transfer_id` into `blocks` = [(region, offset, length), ...]
    /// (same count and lengths as the hold's, or as its blocks `select`:
    /// increasing indices into the hold's blocks, when given). Releases the
    /// GIL while it runs. `timeout_s` bounds the whole pull; when it raises
    /// (a timeout or any other error), nothing writes into `blocks` any more
    /// with tcp and ucx; with Mooncake, ask `writing_into` first.
    #[pyo3(signature = (remote_ctrl, transfer_id, epoch, blocks, timeout_s=30.0, select=None))]
    #[allow(clippy::too_many_arguments)]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: &Bound<'_, PyAny>,
        blocks: Vec<(u64, u64, u64)>,
        timeout_s: f64,
        select: Option<Vec<u32>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (limit, epoch) = (timeout(timeout_s)?, self::epoch(epoch)?);
        let (rt, reader, dest) = (runtime()?, self.inner.clone(), self::blocks(blocks));
        let stats = py
            .detach(|| {
                rt.block_on(reader.pull_blocks(
                    remote_ctrl,
                    transfer_id,
                    epoch,
                    select.as_deref(),
                    &dest,
                    limit,
                ))
            })
            .map_err(to_py)?;
        pull_dict(py, &stats)
    }

    /// Starts a pull in the background (arguments as `pull`'s); returns a `Pull`.
    #[pyo3(signature = (remote_ctrl, transfer_id, epoch, blocks, timeout_s=30.0, select=None))]
    fn pull_async(
        &self,
        remote_ctrl: String,
        transfer_id: String,
        epoch: &Bound<'_, PyAny>,
        blocks: Vec<(u64, u64, u64)>,
        timeout_s: f64,
        select: Option<Vec<u32>>,
    ) -> PyResult<Pull> {
        let (limit, epoch) = (timeout(timeout_s)?, self::epoch(epoch)?);
        let (reader, dest) = (self.inner.clone(), self::blocks(blocks));
        // Owned by the returned Pull (its result() joins it); the pull's own
        // timeout bounds it even if nobody asks.
        let handle = runtime()?.spawn(async move {
            reader
                .pull_blocks(
                    &remote_ctrl,
                    &transfer_id,
                    epoch,
                    select.as_deref(),
                    &dest,
                    limit,
                )
                .await
        });
        Ok(Pull {
            handle: Mutex::new(Some(handle)),
            outcome: Mutex::new(None),
        })
    }

    /// Releases a hold at `remote_ctrl` (idempotent): was it held?
    fn release(&self, py: Python<'_>, remote_ctrl: &str, transfer_id: &str) -> PyResult<bool> {
        let (rt, reader) = (runtime()?, self.inner.clone());
        py.detach(|| rt.block_on(reader.release(remote_ctrl, transfer_id)))
            .map_err(to_py)
    }

    /// Renews a hold; returns its info.
    fn renew<'py>(
        &self,
        py: Python<'py>,
        remote_ctrl: &str,
        transfer_id: &str,
        epoch: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (rt, reader, epoch) = (runtime()?, self.inner.clone(), self::epoch(epoch)?);
        let info = py
            .detach(|| rt.block_on(reader.renew(remote_ctrl, transfer_id, epoch)))
            .map_err(to_py)?;
        info_dict(py, &info)
    }

    /// The counters of the holder at `remote_ctrl` (what `Holder.stats()` says
    /// there): for tests, benchmarks and operators outside the holder's process.
    fn stats<'py>(&self, py: Python<'py>, remote_ctrl: &str) -> PyResult<Bound<'py, PyDict>> {
        let (rt, reader) = (runtime()?, self.inner.clone());
        let stats = py
            .detach(|| rt.block_on(reader.ctrl().stats(remote_ctrl)))
            .map_err(to_py)?;
        stats_dict(py, &stats)
    }

    /// A hold's info without renewing it, or None.
    fn stat<'py>(
        &self,
        py: Python<'py>,
        remote_ctrl: &str,
        transfer_id: &str,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let (rt, reader) = (runtime()?, self.inner.clone());
        let info = py
            .detach(|| rt.block_on(reader.stat(remote_ctrl, transfer_id)))
            .map_err(to_py)?;
        info.map(|info| info_dict(py, &info)).transpose()
    }
}

/// A transfer id nobody can guess: `cx-` and 128 bits from the operating
/// system's CSPRNG in hex. Holders refuse ids without such an ending.
#[pyfunction]
fn new_transfer_id() -> String {
    ct::new_transfer_id()
}

/// A resume epoch from Python: any int outside `u32` (negative, 2**32 and up)
/// is a `ValueError`, like every other bad argument, not an `OverflowError`.
fn epoch(value: &Bound<'_, PyAny>) -> PyResult<u32> {
    value.extract::<u32>().map_err(|_| {
        PyValueError::new_err(format!("resume epoch must be an int in 0..={}", u32::MAX))
    })
}

fn timeout(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err("timeout_s must be a positive number of seconds"))
}

#[pymodule]
fn _transfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Holder>()?;
    m.add_class::<Reader>()?;
    m.add_class::<Pull>()?;
    m.add_function(wrap_pyfunction!(new_transfer_id, m)?)?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("HoldNotFound", py.get_type::<HoldNotFound>())?;
    m.add("StaleEpoch", py.get_type::<StaleEpoch>())?;
    m.add("EpochOutOfRange", py.get_type::<EpochOutOfRange>())?;
    m.add("Unreachable", py.get_type::<Unreachable>())?;
    m.add("TransferTimeout", py.get_type::<TransferTimeout>())?;
    m.add("Unauthorized", py.get_type::<Unauthorized>())?;
    Ok(())
}
