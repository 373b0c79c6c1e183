//! The holder's connections that sit between frames, so that a holder at its
//! connection limit can close the one idle longest to serve a new one.
//!
//! Readers pool their control connections (16 per holder each, for a minute),
//! so a few dozen decode processes can hold every slot of a prefill's holder
//! while sending nothing: without this a new reader's pull would wait in the
//! backlog until an idle connection timed out, past its pull deadline. An idle
//! connection is closed only before any byte of its next frame was read, so
//! no request is lost: a pooled connection found closed is retried once on a
//! fresh one by the client (as HTTP keep-alive races are).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// Connections idle between frames, each with how to tell it to close.
#[derive(Default)]
pub(crate) struct IdleConns {
    idle: Mutex<HashMap<u64, (Instant, Arc<Notify>)>>,
    next_id: AtomicU64,
}

impl IdleConns {
    /// A new connection's handle.
    pub(crate) fn register(self: &Arc<Self>) -> ConnIdle {
        ConnIdle {
            conns: self.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            closing: Arc::new(Notify::new()),
        }
    }

    /// Tells the connection idle longest to close; false when none is idle.
    pub(crate) fn close_longest_idle(&self) -> bool {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let Some(id) = idle
            .iter()
            .min_by_key(|(_, (since, _))| *since)
            .map(|(id, _)| *id)
        else {
            return false;
        };
        if let Some((_, closing)) = idle.remove(&id) {
            // A stored permit if the connection is not waiting yet: it
            // cannot be missed.
            closing.notify_one();
        }
        true
    }

    /// How many connections are idle now.
    pub(crate) fn count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// One connection's place among the idle ones.
pub(crate) struct ConnIdle {
    conns: Arc<IdleConns>,
    id: u64,
    closing: Arc<Notify>,
}

impl ConnIdle {
    /// Marks the connection idle until [`IdleMark::busy`] or the mark drops.
    pub(crate) fn idle(&self) -> IdleMark<'_> {
        let mut idle = self.conns.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.insert(self.id, (Instant::now(), self.closing.clone()));
        IdleMark { conn: self }
    }

    /// Takes the connection off the idle ones; false if it was not there
    /// (told to close, or never marked).
    fn unmark(&self) -> bool {
        let mut idle = self.conns.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.remove(&self.id).is_some()
    }
}

/// While it lives, its connection may be told to close.
pub(crate) struct IdleMark<'a> {
    conn: &'a ConnIdle,
}

impl IdleMark<'_> {
    /// Resolves when the holder wants this connection closed.
    pub(crate) async fn closing(&self) {
        self.conn.closing.notified().await
    }

    /// The connection has a frame to read. False: it was told to close at
    /// the same moment, and must (its frame is left unread, so the peer
    /// retries it elsewhere).
    pub(crate) fn busy(self) -> bool {
        self.conn.unmark()
    }
}

impl Drop for IdleMark<'_> {
    fn drop(&mut self) {
        self.conn.unmark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn the_connection_idle_longest_is_told_to_close() {
        let conns = Arc::new(IdleConns::default());
        let (first, second) = (conns.register(), conns.register());
        let first_mark = first.idle();
        tokio::time::sleep(Duration::from_millis(2)).await;
        let second_mark = second.idle();
        assert_eq!(conns.count(), 2);
        assert!(conns.close_longest_idle());
        tokio::time::timeout(Duration::from_secs(1), first_mark.closing())
            .await
            .expect("the older one is told");
        assert!(!first_mark.busy(), "told to close: it may not take a frame");
        assert!(second_mark.busy(), "the newer one goes on");
        assert_eq!(conns.count(), 0);
        assert!(!conns.close_longest_idle(), "none idle: nothing to close");
    }

    #[tokio::test]
    async fn a_busy_or_gone_connection_is_never_chosen() {
        let conns = Arc::new(IdleConns::default());
        let (busy, gone) = (conns.register(), conns.register());
        assert!(busy.idle().busy());
        drop(gone.idle());
        assert!(!conns.close_longest_idle());
    }
}
