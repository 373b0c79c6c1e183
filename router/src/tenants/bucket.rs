//! A tenant's tokens per minute: a token bucket that admits while its balance
//! is positive, charges a request's estimate on admission and settles it from
//! the request's usage at its end (so one request may take it below zero, and
//! the tenant waits until the refill brings it back).

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct TokenBucket {
    per_minute: u64,
    balance: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(per_minute: u64, now: Instant) -> Self {
        Self {
            per_minute,
            balance: per_minute as f64,
            at: now,
        }
    }

    /// A reload's new rate; the balance carries over (capped by it).
    pub fn set_rate(&mut self, per_minute: u64, now: Instant) {
        self.refill(now);
        self.per_minute = per_minute;
        self.balance = self.balance.min(per_minute as f64);
    }

    fn rate_per_s(&self) -> f64 {
        self.per_minute as f64 / 60.0
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.balance = (self.balance + elapsed * self.rate_per_s()).min(self.per_minute as f64);
        self.at = now;
    }

    /// Charges `estimate` if the balance is positive; otherwise how long until
    /// it is.
    pub fn take(&mut self, estimate: u64, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.balance <= 0.0 {
            let wait = (-self.balance + 1.0) / self.rate_per_s();
            return Err(Duration::from_secs_f64(wait.min(3600.0)));
        }
        self.balance -= estimate as f64;
        Ok(())
    }

    /// Replaces a charged estimate with what the request really used.
    pub fn settle(&mut self, estimate: u64, used: u64, now: Instant) {
        self.refill(now);
        self.balance = (self.balance + estimate as f64 - used as f64).min(self.per_minute as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_while_positive_then_waits_for_the_refill() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(600, start);
        // 600 a minute: 10 a second.
        assert!(bucket.take(500, start).is_ok());
        assert!(
            bucket.take(500, start).is_ok(),
            "the balance was still positive"
        );
        let wait = bucket.take(1, start).expect_err("the balance is spent");
        assert!(
            wait > Duration::from_secs(40) && wait < Duration::from_secs(42),
            "{wait:?}"
        );
        // The second request used 50, not 500: 450 back.
        bucket.settle(500, 50, start);
        assert!(bucket.take(1, start).is_ok());
        // Never more than a minute's worth.
        let later = start + Duration::from_secs(3600);
        bucket.settle(0, 0, later);
        assert!(bucket.take(600, later).is_ok());
        assert!(bucket.take(1, later).is_err());
    }
}
