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
use std::sync::atomic::{AtomicI32, Ordering};

/// Threads told to stay parked, by thread id (0: a free slot). Per thread,
/// not one flag: holders of several tests share a process, and one holder
/// stopping must not wake another's parked threads.
static PARKED: [AtomicI32; 256] = [const { AtomicI32::new(0) }; 256];

fn is_parked(tid: libc::pid_t) -> bool {
    PARKED
        .iter()
        .any(|slot| slot.load(Ordering::Relaxed) == tid)
}

extern "C" fn park(_signal: libc::c_int) {
    let nap = libc::timespec {
        tv_sec: 0,
        tv_nsec: 10_000_000,
    };
    // SAFETY: gettid and nanosleep are async-signal-safe; the pointer is to a local.
    let tid = unsafe { libc::gettid() };
    while is_parked(tid) {
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
        let data_threads: Vec<libc::pid_t> = self
            .0
            .iter()
            .copied()
            .filter(|&tid| !in_accept(tid))
            .collect();
        for &tid in &data_threads {
            let free = PARKED.iter().find(|slot| {
                slot.compare_exchange(0, tid, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            });
            if free.is_none() {
                tracing::error!("mooncake stall fault: too many parked threads");
                return;
            }
        }
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
            for &tid in &data_threads {
                libc::syscall(libc::SYS_tgkill, pid, tid, signal);
            }
        }
        tracing::warn!("mooncake stall fault: engine data threads parked");
    }
}

impl Drop for EngineThreads {
    /// The engine is going away (a holder stopped in the test's own process):
    /// its destructor joins these threads, so they must run again.
    fn drop(&mut self) {
        for slot in &PARKED {
            let tid = slot.load(Ordering::Relaxed);
            if tid != 0 && self.0.contains(&tid) {
                slot.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// Whether thread `tid` is blocked in `accept` (the kernel's wait channel).
fn in_accept(tid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan"))
        .is_ok_and(|wchan| wchan.contains("accept"))
}
