//! Idle keep-alive connections per peer address: the router's connections to
//! engines (HTTP) and the hold control client's to holders. An idle
//! connection is only its socket: no task watches it and no buffer stays
//! allocated with it (with 10k streams, the router's memory is mostly its
//! connections). A connection the peer closed while idle is found when it is
//! taken (a non-blocking read sees its end) and dropped; a sweeper owned by
//! the pool closes those idle past the timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_util::task::AbortOnDropHandle;

/// The idle connections.
pub struct IdlePool {
    shared: Arc<Shared>,
}

struct Shared {
    entries: Mutex<HashMap<Box<str>, Entry>>,
    max_per_host: usize,
    idle_timeout: Duration,
    /// Started with the first connection given back; stops with the pool.
    sweeper: OnceLock<AbortOnDropHandle<()>>,
}

/// One address's idle connections (oldest first) and the callers waiting for
/// one to be given back (first come, first served).
#[derive(Default)]
struct Entry {
    idle: VecDeque<Idle>,
    waiters: VecDeque<oneshot::Sender<TcpStream>>,
    /// Waiters after the last pruning of those gone (pruned again at twice
    /// as many: amortised, however many wait).
    pruned_at: usize,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.idle.is_empty() && self.waiters.is_empty()
    }
}

struct Idle {
    stream: TcpStream,
    since: Instant,
}

impl IdlePool {
    /// At most `max_per_host` idle connections per address, each kept at most
    /// `idle_timeout`.
    pub fn new(max_per_host: usize, idle_timeout: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                entries: Mutex::new(HashMap::new()),
                max_per_host,
                idle_timeout,
                sweeper: OnceLock::new(),
            }),
        }
    }

    /// A live idle connection to `addr`, the most recently used first (older
    /// ones age out).
    pub fn take(&self, addr: &str) -> Option<TcpStream> {
        loop {
            let idle = {
                let mut map = self.shared.lock();
                let entry = map.get_mut(addr)?;
                let idle = entry.idle.pop_back();
                if entry.is_empty() {
                    map.remove(addr);
                }
                idle?
            };
            if idle.since.elapsed() < self.shared.idle_timeout && is_open(&idle.stream) {
                return Some(idle.stream);
            }
        }
    }

    /// The next connection to `addr` given back, handed over instead of
    /// pooled: a caller that must otherwise open a new connection waits on
    /// this and on its connect at once, and takes whichever comes first (a
    /// burst of requests then reuses connections as they free up rather
    /// than opening one each). Dropping the receiver gives up the place.
    pub fn wait(&self, addr: &str) -> oneshot::Receiver<TcpStream> {
        let (tx, rx) = oneshot::channel();
        let mut map = self.shared.lock();
        let entry = map.entry(addr.into()).or_default();
        if entry.waiters.len() >= 2 * entry.pruned_at.max(32) {
            entry.waiters.retain(|w| !w.is_closed());
            entry.pruned_at = entry.waiters.len();
        }
        entry.waiters.push_back(tx);
        rx
    }

    /// Gives back a connection to `addr` whose exchange ended cleanly: to the
    /// first caller waiting for one, else to the pool.
    pub fn put(&self, addr: &str, mut stream: TcpStream) {
        let evicted = {
            let mut map = self.shared.lock();
            let entry = map.entry(addr.into()).or_default();
            while let Some(waiter) = entry.waiters.pop_front() {
                match waiter.send(stream) {
                    Ok(()) => {
                        if entry.is_empty() {
                            map.remove(addr);
                        }
                        return;
                    }
                    // That caller went on with a connection of its own.
                    Err(back) => stream = back,
                }
            }
            if self.shared.max_per_host == 0 {
                if entry.is_empty() {
                    map.remove(addr);
                }
                return;
            }
            // At the bound the oldest goes: it would expire first.
            let evicted = (entry.idle.len() >= self.shared.max_per_host)
                .then(|| entry.idle.pop_front())
                .flatten();
            entry.idle.push_back(Idle {
                stream,
                since: Instant::now(),
            });
            evicted
        };
        // Closed outside the lock.
        drop(evicted);
        if self.shared.sweeper.get().is_none() {
            // Outside a runtime (a connection given back from blocking code)
            // the sweeper starts with the next one; expired connections are
            // never taken meanwhile.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                self.shared.sweeper.get_or_init(|| {
                    let shared = Arc::downgrade(&self.shared);
                    let every = (self.shared.idle_timeout / 2).max(Duration::from_millis(100));
                    AbortOnDropHandle::new(runtime.spawn(sweep(shared, every)))
                });
            }
        }
    }

    /// How many idle connections are kept (for tests and diagnostics).
    pub fn idle_count(&self) -> usize {
        self.shared.lock().values().map(|e| e.idle.len()).sum()
    }

    /// How many idle connections to `addr` are kept.
    pub fn idle_to(&self, addr: &str) -> usize {
        self.shared.lock().get(addr).map_or(0, |e| e.idle.len())
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Entry>> {
        // A panic while holding the lock leaves a map of sockets, still valid.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Closes idle connections past the timeout, and forgets callers that stopped
/// waiting, every `every`, while the pool lives.
async fn sweep(shared: Weak<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let expired: Vec<Idle> = {
            let mut map = shared.lock();
            let mut expired = Vec::new();
            map.retain(|_, entry| {
                // Given back in time order: the expired ones are a prefix.
                let keep = entry
                    .idle
                    .partition_point(|i| i.since.elapsed() >= shared.idle_timeout);
                expired.extend(entry.idle.drain(..keep));
                entry.waiters.retain(|w| !w.is_closed());
                entry.pruned_at = entry.waiters.len();
                !entry.is_empty()
            });
            expired
        };
        // Closed outside the lock.
        drop(expired);
    }
}

/// Whether an idle connection is still open: nothing to read yet. A
/// connection the peer closed reads its end; one with bytes waiting is out of
/// step (an answer nobody asked for) and is not used either. Asked of the
/// socket itself (a non-blocking peek): tokio's `try_read` answers from the
/// readiness it last saw, and would miss a close that came since.
fn is_open(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    matches!(
        socket2::SockRef::from(stream).peek(&mut byte),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    /// A connected pair: (the client's end, the server's end).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (client, server)
    }

    #[tokio::test]
    async fn an_idle_connection_is_taken_again_newest_first() {
        let pool = IdlePool::new(8, Duration::from_secs(10));
        let (a, _a) = pair().await;
        let (b, _b) = pair().await;
        let b_port = b.local_addr().expect("addr").port();
        pool.put("e:1", a);
        pool.put("e:1", b);
        assert!(pool.take("e:2").is_none(), "pooled per engine address");
        let taken = pool.take("e:1").expect("pooled");
        assert_eq!(taken.local_addr().expect("addr").port(), b_port);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_connection_the_engine_closed_is_not_taken() {
        let pool = IdlePool::new(8, Duration::from_secs(10));
        let (a, server) = pair().await;
        pool.put("e:1", a);
        drop(server);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take("e:1").is_none());
        let (b, mut server) = pair().await;
        pool.put("e:1", b);
        server
            .write_all(b"HTTP/1.1 200 OK\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take("e:1").is_none(), "unasked bytes: out of step");
    }

    #[tokio::test]
    async fn idle_connections_are_bounded_and_expire() {
        let pool = IdlePool::new(2, Duration::from_millis(300));
        let mut servers = Vec::new();
        for _ in 0..3 {
            let (client, server) = pair().await;
            pool.put("e:1", client);
            servers.push(server);
        }
        assert_eq!(pool.idle_count(), 2, "at most max_per_host");
        // The sweeper closes them past the timeout, with no request coming.
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(pool.idle_count(), 0);
        let mut byte = [0u8; 1];
        let mut server = servers.pop().expect("server");
        let read = tokio::io::AsyncReadExt::read(&mut server, &mut byte).await;
        assert_eq!(read.expect("read"), 0, "the router closed it");
        assert_eq!(IdlePool::new(0, Duration::from_secs(1)).idle_count(), 0);
    }

    #[tokio::test]
    async fn a_connection_given_back_goes_to_the_first_caller_still_waiting() {
        let pool = IdlePool::new(8, Duration::from_secs(10));
        let gone = pool.wait("e:1");
        let first = pool.wait("e:1");
        let second = pool.wait("e:1");
        drop(gone);
        let (a, _a) = pair().await;
        let a_port = a.local_addr().expect("addr").port();
        pool.put("e:1", a);
        let handed = first.await.expect("handed over");
        assert_eq!(handed.local_addr().expect("addr").port(), a_port);
        assert_eq!(pool.idle_count(), 0, "handed over, not pooled");
        drop(second);
        let (b, _b) = pair().await;
        pool.put("e:1", b);
        assert_eq!(pool.idle_count(), 1, "nobody waits any more: pooled");
        assert!(pool.take("e:1").is_some());
        assert!(pool.shared.lock().is_empty(), "nothing left behind");
    }

    #[tokio::test]
    async fn the_sweeper_stops_with_the_pool() {
        let pool = IdlePool::new(2, Duration::from_millis(200));
        let (client, _server) = pair().await;
        pool.put("e:1", client);
        let shared = Arc::downgrade(&pool.shared);
        drop(pool);
        assert!(shared.upgrade().is_none(), "nothing keeps the pool alive");
    }
}
