//! Releases waiting for their batch, by holder: the requests that end
//! within a few ms of each other cost their holder one call.

use super::calls::RELEASE_LINGER;
use super::hold::Hold;
use connex_transfer::proto::MAX_RELEASE_BATCH;
use std::collections::HashMap;
use std::time::Instant;

/// Releases waiting to go out, by holder (its control address).
#[derive(Default)]
pub(super) struct Releases {
    pub(super) waiting: HashMap<String, Vec<String>>,
    /// When the oldest waiting release goes out.
    pub(super) due: Option<Instant>,
}

impl Releases {
    /// Queues `hold`'s release; a holder's batch that is full comes back, to
    /// go out now.
    pub(super) fn add(&mut self, hold: Hold, now: Instant) -> Option<(String, Vec<String>)> {
        self.due.get_or_insert(now + RELEASE_LINGER);
        let ids = match self.waiting.get_mut(&hold.ctrl) {
            Some(ids) => ids,
            None => self.waiting.entry(hold.ctrl.clone()).or_default(),
        };
        ids.push(hold.transfer_id);
        if ids.len() < MAX_RELEASE_BATCH {
            return None;
        }
        let ids = self.waiting.remove(&hold.ctrl).unwrap_or_default();
        if self.waiting.is_empty() {
            self.due = None;
        }
        Some((hold.ctrl, ids))
    }

    /// Every waiting batch, by holder; nothing waits after.
    pub(super) fn take_all(&mut self) -> Vec<(String, Vec<String>)> {
        self.due = None;
        self.waiting.drain().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn releases_wait_by_holder_and_a_full_batch_goes_at_once() {
        let mut releases = Releases::default();
        let now = Instant::now();
        let on = |ctrl: &str, id: &str| Hold {
            ctrl: ctrl.into(),
            transfer_id: id.into(),
            lease: Duration::from_secs(10),
        };
        assert!(releases.add(on("a:1", "x"), now).is_none());
        let later = now + Duration::from_millis(3);
        assert!(releases.add(on("b:1", "y"), later).is_none());
        assert!(releases.add(on("a:1", "z"), later).is_none());
        assert_eq!(
            releases.due,
            Some(now + RELEASE_LINGER),
            "the oldest release sets the time"
        );
        let mut batches = releases.take_all();
        batches.sort();
        assert_eq!(
            batches,
            vec![
                ("a:1".to_string(), vec!["x".to_string(), "z".to_string()]),
                ("b:1".to_string(), vec!["y".to_string()]),
            ]
        );
        assert_eq!(releases.due, None);
        for i in 0..MAX_RELEASE_BATCH - 1 {
            assert!(releases.add(on("a:1", &i.to_string()), now).is_none());
        }
        let (holder, full) = releases.add(on("a:1", "last"), now).expect("full");
        assert_eq!((holder.as_str(), full.len()), ("a:1", MAX_RELEASE_BATCH));
        assert_eq!(releases.due, None, "nothing else waits");
    }
}
