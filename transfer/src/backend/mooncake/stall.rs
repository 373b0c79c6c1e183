//! The stall fault for a Mooncake holder (tests only: `Faults`).
//!
//! Mooncake serves reads from threads of its own, which no API can pause.
//! To make a holder that is alive but stops serving (the conformance suite
//! kills it mid-pull, or lets a reader time out on it), the threads the
//! engine started are parked in a signal handler when a pull starts. They are
//! told apart as the threads that appeared while the engine was created.
//! The one waiting in `accept` is the handshake listener: it is left running,
//! so that the reader opens the segment and submits its reads, which then
//! never end (the data threads are parked) until the holder is killed. Parked
//! threads wait in `epoll_wait`, holding no lock our own threads need, and
//! the control listener (tokio) goes on answering.

#![allow(unsafe_code)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

static PARKED: AtomicBool = AtomicBool::new(false);

extern "C" fn park(_signal: libc::c_int) {
    let nap = libc::timespec {
        tv_sec: 0,
        tv_nsec: 10_000_000,
    };
    while PARKED.load(Ordering::Relaxed) {
        // SAFETY: nanosleep is async-signal-safe; the pointer is to a local.
        unsafe { libc::nanosleep(&nap, std::ptr::null_mut()) };
    }
}

fn threads() -> HashSet<libc::pid_t> {
    std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The engine's threads, found by creating it between two looks at ours.
pub(crate) struct EngineThreads(Vec<libc::pid_t>);

impl EngineThreads {
    pub(crate) fn around<T>(create: impl FnOnce() -> T) -> (T, Self) {
        let before = threads();
        let made = create();
        let mut new: Vec<_> = threads().difference(&before).copied().collect();
        new.sort_unstable();
        (made, Self(new))
    }

    /// Parks the engine's threads but its handshake listener, for good (the
    /// process is killed or exits).
    pub(crate) fn park(&self) {
        let signal = libc::SIGRTMIN() + 5;
        PARKED.store(true, Ordering::Relaxed);
        // SAFETY: a handler that only sleeps, for a real-time signal nothing
        // else here uses; tgkill addresses threads of this process only.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = park as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                tracing::error!("mooncake stall fault: sigaction failed");
                return;
            }
            let pid = libc::getpid();
            for &tid in self.0.iter().filter(|&&tid| !in_accept(tid)) {
                libc::syscall(libc::SYS_tgkill, pid, tid, signal);
            }
        }
        tracing::warn!("mooncake stall fault: engine data threads parked");
    }
}

/// Whether thread `tid` is blocked in `accept` (the kernel's wait channel).
fn in_accept(tid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan"))
        .is_ok_and(|wchan| wchan.contains("accept"))
}
