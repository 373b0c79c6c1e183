//! One Mooncake Transfer Engine per backend instance, configured from the
//! environment, and the memory registrations made with it.

use super::fail;
use crate::backend::Exposure;
use crate::error::Result;
use crate::region::RegionEntry;
use connex_mooncake_sys as sys;
use std::ffi::{CStr, CString};
use std::sync::Arc;

/// The address peers reach this process's engine at (it becomes the host
/// part of the segment name readers open).
pub(crate) const HOST_ENV: &str = "CONNEX_MOONCAKE_HOST";
/// Mooncake's own variable: the address its TCP transport listens on. Used
/// as the host when [`HOST_ENV`] is unset.
pub(crate) const TCP_BIND_ENV: &str = "MC_TCP_BIND_ADDRESS";
/// Where registered memory lives, as Mooncake names it (`cpu:0`, `cuda:1`);
/// `*` (the default) lets the engine find out per buffer (the NUMA node of
/// host memory, the GPU of device memory in a CUDA build).
pub(crate) const LOCATION_ENV: &str = "CONNEX_MOONCAKE_LOCATION";

/// How this process's engine is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    pub host: String,
    pub location: String,
}

impl Settings {
    pub(crate) fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let host = get(HOST_ENV)
            // A wildcard bind address says where to listen, not where to be reached.
            .or_else(|| get(TCP_BIND_ENV).filter(|a| !matches!(a.trim(), "0.0.0.0" | "::")))
            .unwrap_or_else(|| {
                tracing::warn!(
                    "mooncake: neither {HOST_ENV} nor {TCP_BIND_ENV} is set: this engine \
                     publishes 127.0.0.1, which peers on other hosts cannot reach"
                );
                "127.0.0.1".into()
            });
        let location = get(LOCATION_ENV).unwrap_or_else(|| "*".into());
        Self {
            host: host.trim().to_string(),
            location: location.trim().to_string(),
        }
    }
}

pub(crate) fn cstring(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| fail(format!("{text:?} contains a NUL byte")))
}

/// One engine; destroyed when the last user (the backend, a registration or
/// an unfinished batch) lets go of it.
pub(crate) struct Engine {
    raw: sys::transfer_engine_t,
    location: CString,
}

// SAFETY: the engine's C API is thread-safe for the calls made here (Mooncake
// serves them from several threads itself); the handle is only an address.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

impl Engine {
    /// An engine with P2P handshake metadata (no metadata server: a segment is
    /// named by its engine's `ip:port`) and the transports it discovers: RDMA
    /// where the library and the NICs have it, else TCP (`MC_FORCE_TCP=1`
    /// forces TCP; the library reads it).
    pub(crate) fn new(settings: &Settings) -> Result<Self> {
        let (meta, host) = (cstring("P2PHANDSHAKE")?, cstring(&settings.host)?);
        let location = cstring(&settings.location)?;
        // SAFETY: the strings outlive the call (the API copies them). With
        // P2PHANDSHAKE only the host of `local_server_name` counts: the
        // engine picks a free port itself.
        let raw =
            unsafe { sys::createTransferEngine(meta.as_ptr(), host.as_ptr(), host.as_ptr(), 0, 1) };
        if raw.is_null() {
            return Err(fail(format!(
                "createTransferEngine failed (P2PHANDSHAKE on host {:?}: set {HOST_ENV} to an \
                 address of this machine; the TCP transport needs Debian's libibverbs1)",
                settings.host
            )));
        }
        Ok(Self { raw, location })
    }

    pub(crate) fn raw(&self) -> sys::transfer_engine_t {
        self.raw
    }

    /// The segment name readers open: this engine's `ip:port`.
    pub(crate) fn segment_name(&self) -> Result<String> {
        let mut buf = vec![0 as std::os::raw::c_char; 256];
        // SAFETY: `buf` is writable for its length; the result is NUL-terminated.
        unsafe {
            if sys::getLocalIpAndPort(self.raw, buf.as_mut_ptr(), buf.len()) != 0 {
                return Err(fail("getLocalIpAndPort failed"));
            }
            Ok(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
        }
    }

    /// Registers a region with the engine (holders: so that readers may read
    /// it; readers: Mooncake reads only into registered memory).
    pub(crate) fn register(self: &Arc<Self>, region: &RegionEntry) -> Result<Exposure> {
        if region.region.is_empty() {
            return Ok(Exposure::default());
        }
        let addr = region.region.addr() as *mut std::ffi::c_void;
        // SAFETY: the region's memory is valid while the entry lives; the
        // registration (its keepalive) is dropped before the memory.
        let rc = unsafe {
            sys::registerLocalMemory(
                self.raw,
                addr,
                region.region.len(),
                self.location.as_ptr(),
                1,
            )
        };
        if rc != 0 {
            return Err(fail(format!(
                "registerLocalMemory of {} bytes at location {:?} failed ({rc})",
                region.region.len(),
                self.location
            )));
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
        unsafe { sys::destroyTransferEngine(self.raw) };
    }
}

/// A registered region; unregistered on drop (before its memory goes).
struct Registration {
    engine: Arc<Engine>,
    addr: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: registered by `Engine::register` at this address.
        unsafe { sys::unregisterLocalMemory(self.engine.raw, self.addr as *mut std::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Settings {
        Settings::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn host_and_location_come_from_the_environment() {
        assert_eq!(
            settings(&[]),
            Settings {
                host: "127.0.0.1".into(),
                location: "*".into()
            }
        );
        let bind_only = settings(&[(TCP_BIND_ENV, "10.1.2.3")]);
        assert_eq!(bind_only.host, "10.1.2.3");
        assert_eq!(settings(&[(TCP_BIND_ENV, "0.0.0.0")]).host, "127.0.0.1");
        let both = settings(&[
            (TCP_BIND_ENV, "0.0.0.0"),
            (HOST_ENV, "decode-7.example"),
            (LOCATION_ENV, "cuda:1"),
        ]);
        assert_eq!(
            both,
            Settings {
                host: "decode-7.example".into(),
                location: "cuda:1".into()
            }
        );
    }
}
