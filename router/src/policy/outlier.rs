//! Outlier detection on the request path: which decoders new requests should
//! avoid for a while, and which decoders are visibly delivering tokens.
//!
//! A decoder is *suspect* after a connect to it failed (refused, or timed out
//! because its accept backlog overflowed): new requests and resumes try others
//! first, while its streams in flight are left alone: a connect timeout says
//! the decoder is busy, not gone. Suspicion is bounded as Envoy bounds ejection
//! (`max_ejection_percent`, panic threshold): when avoiding the suspects would
//! leave fewer than half the candidates, every candidate stays in play.
//!
//! The *delivery clock* of a decoder is when one of its streams last brought
//! tokens: the health checks do not declare dead a decoder whose streams
//! deliver, however its probes fare on a saturated machine.

use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Suspects, delivery clocks and broken streams, keyed by instance id.
#[derive(Debug)]
pub struct Outliers {
    suspects: DashMap<String, Instant>,
    clocks: DashMap<String, DeliveryClock>,
    /// When the first of a decoder's recent broken streams broke, and how
    /// many broke since.
    breaks: DashMap<String, (Instant, u32)>,
    /// How long a failed connect keeps a decoder suspect.
    suspect_for: Duration,
    origin: Instant,
}

impl Default for Outliers {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

/// Broken streams of one decoder, within [`BREAK_WINDOW`], that are evidence
/// its process is gone (with none of its streams left).
pub const BREAKS_FOR_EVIDENCE: u32 = 2;
pub const BREAK_WINDOW: Duration = Duration::from_secs(1);

/// Most of a candidate list suspicion may exclude, in percent.
pub const MAX_EJECTION_PERCENT: usize = 50;

impl Outliers {
    pub fn new(suspect_for: Duration) -> Self {
        Self {
            suspects: DashMap::new(),
            clocks: DashMap::new(),
            breaks: DashMap::new(),
            suspect_for,
            origin: Instant::now(),
        }
    }

    /// A connect to `id` failed.
    pub fn suspect(&self, id: &str) {
        self.suspects.insert(id.to_string(), Instant::now());
    }

    /// `id` accepted a request: no longer suspect.
    pub fn clear(&self, id: &str) {
        if self.suspects.contains_key(id) {
            self.suspects.remove(id);
        }
    }

    pub fn is_suspect(&self, id: &str) -> bool {
        let Some(since) = self.suspects.get(id).map(|s| *s) else {
            return false;
        };
        if since.elapsed() < self.suspect_for {
            return true;
        }
        self.suspects.remove(id);
        false
    }

    /// Of `ids` (the candidates), those new requests should avoid: the
    /// suspects, unless avoiding them would exclude more than
    /// [`MAX_EJECTION_PERCENT`] of the candidates (then none).
    pub fn avoid<'a>(&self, ids: impl Iterator<Item = &'a str>) -> Vec<String> {
        if self.suspects.is_empty() {
            return Vec::new();
        }
        let mut total = 0;
        let suspects: Vec<String> = ids
            .inspect(|_| total += 1)
            .filter(|id| self.is_suspect(id))
            .map(str::to_string)
            .collect();
        if ejection_allowed(total, suspects.len()) {
            suspects
        } else {
            Vec::new()
        }
    }

    /// The delivery clock of `id` (shared by all its streams).
    pub fn clock(&self, id: &str) -> DeliveryClock {
        if let Some(clock) = self.clocks.get(id) {
            return clock.clone();
        }
        self.clocks
            .entry(id.to_string())
            .or_insert_with(|| DeliveryClock {
                origin: self.origin,
                last_ms: Arc::new(AtomicU64::new(0)),
            })
            .clone()
    }

    /// Whether a stream of `id` delivered tokens within `window`.
    pub fn delivered_within(&self, id: &str, window: Duration) -> bool {
        self.clocks
            .get(id)
            .and_then(|c| c.since_last())
            .is_some_and(|since| since <= window)
    }

    /// A stream of `id` broke (its connection reset). True when this is
    /// evidence that the decoder's process is gone: at least
    /// [`BREAKS_FOR_EVIDENCE`] of its streams broke within [`BREAK_WINDOW`] and
    /// none delivered a token since the first one broke. (The caller also
    /// checks that none of its streams is left.)
    pub fn stream_broke(&self, id: &str) -> bool {
        let now = Instant::now();
        let mut entry = self.breaks.entry(id.to_string()).or_insert((now, 0));
        if now.duration_since(entry.0) > BREAK_WINDOW {
            *entry = (now, 0);
        }
        entry.1 += 1;
        let (first, count) = *entry;
        drop(entry);
        let delivered_since = self
            .clocks
            .get(id)
            .and_then(|c| c.since_last())
            .is_some_and(|since| since < now.duration_since(first));
        count >= BREAKS_FOR_EVIDENCE && !delivered_since
    }

    /// Forgets instances that are gone from the registry.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        self.suspects.retain(|id, _| live(id));
        self.clocks.retain(|id, _| live(id));
        self.breaks.retain(|id, _| live(id));
    }
}

/// Whether `ejected` of `total` candidates may be excluded.
pub fn ejection_allowed(total: usize, ejected: usize) -> bool {
    ejected * 100 <= total * MAX_EJECTION_PERCENT
}

/// When a decoder's streams last brought tokens.
#[derive(Debug, Clone)]
pub struct DeliveryClock {
    origin: Instant,
    /// Milliseconds after `origin`, plus one (0: never).
    last_ms: Arc<AtomicU64>,
}

impl DeliveryClock {
    /// A stream of this decoder brought tokens now.
    pub fn tick(&self) {
        let ms = self.origin.elapsed().as_millis() as u64 + 1;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn since_last(&self) -> Option<Duration> {
        let last = self.last_ms.load(Ordering::Relaxed);
        if last == 0 {
            return None;
        }
        let now = self.origin.elapsed().as_millis() as u64 + 1;
        Some(Duration::from_millis(now.saturating_sub(last)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suspects_are_avoided_within_the_ejection_bound() {
        let outliers = Outliers::default();
        let ids = ["d0", "d1", "d2", "d3"];
        assert!(outliers.avoid(ids.iter().copied()).is_empty());
        outliers.suspect("d1");
        outliers.suspect("d2");
        assert_eq!(outliers.avoid(ids.iter().copied()), vec!["d1", "d2"]);
        // Three of four suspect: too few would remain, every one stays in play.
        outliers.suspect("d3");
        assert!(outliers.avoid(ids.iter().copied()).is_empty());
        // A single decoder is never avoided.
        assert!(outliers.avoid(["d1"].iter().copied()).is_empty());
        outliers.clear("d1");
        outliers.clear("d3");
        assert_eq!(outliers.avoid(ids.iter().copied()), vec!["d2"]);
    }

    #[test]
    fn streams_breaking_together_are_evidence_one_is_not() {
        let outliers = Outliers::default();
        assert!(
            !outliers.stream_broke("d0"),
            "one broken stream proves nothing"
        );
        assert!(outliers.stream_broke("d0"), "two within the window do");
        // A decoder still delivering is not gone, however many streams broke.
        outliers.clock("d1").tick();
        std::thread::sleep(Duration::from_millis(5));
        assert!(!outliers.stream_broke("d1"));
        outliers.clock("d1").tick();
        assert!(!outliers.stream_broke("d1"));
    }

    #[test]
    fn suspicion_expires() {
        let outliers = Outliers::new(Duration::ZERO);
        outliers.suspect("d0");
        assert!(!outliers.is_suspect("d0"));
    }

    #[test]
    fn the_delivery_clock_says_who_delivered_recently() {
        let outliers = Outliers::default();
        assert!(!outliers.delivered_within("d0", Duration::from_secs(5)));
        outliers.clock("d0").tick();
        assert!(outliers.delivered_within("d0", Duration::from_secs(5)));
        assert!(!outliers.delivered_within("d1", Duration::from_secs(5)));
    }
}
