//! The router-wide budget of request body bytes in flight
//! (`--max-inflight-body-bytes`). A request holds its body's share until it
//! ends (its body is kept: a resume sends it again); a client past the
//! budget is told to come back (503 with `Retry-After`) before more of its
//! body is read. With each body kept once, at its size, and shared by the
//! calls that send it to the engines (`protocols::openai::client_body`,
//! `patch`), this bounds what clients' bodies can cost the router's memory.

use crate::error::ApiError;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The router-wide budget of request body bytes in flight
/// (`--max-inflight-body-bytes`): a request holds its body's bytes of it until
/// it ends.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
    limit: usize,
}

/// Seconds a client refused for want of budget is told to wait.
const BUDGET_RETRY_AFTER_S: u64 = 1;

impl BodyBudget {
    pub fn new(limit: usize) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS))),
            limit,
        }
    }

    /// Bytes of the budget held by requests.
    pub fn held(&self) -> usize {
        self.limit
            .min(Semaphore::MAX_PERMITS)
            .saturating_sub(self.bytes.available_permits())
    }

    /// Takes `bytes` more for `held`, or says the budget is spent (never waits:
    /// a client past it is told to come back, before more of its body is read).
    pub fn take(
        &self,
        held: &mut Option<OwnedSemaphorePermit>,
        bytes: usize,
    ) -> Result<(), ApiError> {
        let spent = || ApiError::BodyBudget {
            limit: self.limit,
            retry_after_s: BUDGET_RETRY_AFTER_S,
        };
        let Ok(count) = u32::try_from(bytes) else {
            return Err(spent());
        };
        if count == 0 {
            return Ok(());
        }
        let permit = self
            .bytes
            .clone()
            .try_acquire_many_owned(count)
            .map_err(|_| spent())?;
        match held {
            Some(held) => held.merge(permit),
            None => *held = Some(permit),
        }
        Ok(())
    }
}
