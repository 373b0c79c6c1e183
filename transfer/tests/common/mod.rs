//! What the transfer crate's test binaries share: holders, in this process
//! (a hold over given bytes) or in a process of their own
//! (`connex-transfer-holder`, which a test can kill as a machine would die).
//! Each binary compiles this module and uses a part of it.
#![allow(dead_code)]

use connex_transfer::{BackendKind, BlockRef, Holder, Region, RegionId};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Holds `bytes` on `holder` under `id`, as `blocks` blocks of equal size in
/// order; returns the region (the hold keeps it alive after it is unregistered).
pub fn create_hold(holder: &Holder, id: &str, bytes: Vec<u8>, blocks: u64) -> RegionId {
    let size = bytes.len() as u64 / blocks;
    let region = holder.register_region(Region::owned(bytes)).unwrap();
    let refs = (0..blocks)
        .map(|b| BlockRef::new(region, b * size, size))
        .collect();
    holder.create_hold(id, refs).unwrap();
    region
}

/// A holder in its own process (`connex-transfer-holder --backend KIND ARGS`),
/// killed on drop; `addr` is its control address (its first line, "ctrl ADDR").
pub struct HolderProcess {
    child: Child,
    pub addr: String,
}

impl HolderProcess {
    pub fn start(kind: BackendKind, args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_connex-transfer-holder"))
            .args(["--backend", kind.name()])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .strip_prefix("ctrl ")
            .expect("ctrl line")
            .trim()
            .to_string();
        Self { child, addr }
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (`STOP`, `CONT`) to the holder's process. A STOP
    /// returns once every thread has stopped: kill(2) wakes one thread to take
    /// the stop, and until it gets a CPU (two busy cores) the others run on
    /// and answer requests (a describe answered 1 ms after the STOP was sent).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id();
        let sent = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -{signal}");
        if signal == "STOP" {
            let started = std::time::Instant::now();
            while !every_thread_stopped(pid) {
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(30),
                    "holder {pid} not stopped 30 s after SIGSTOP"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// Whether each thread of `pid` is stopped (state `T` in its
/// `/proc/PID/task/TID/stat`, the field after the parenthesised name).
fn every_thread_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
                Some(state == 'T')
            })
            .unwrap_or(false)
    })
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
