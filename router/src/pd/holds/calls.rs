//! The keeper's calls to holders: a release (retried with backoff) and a
//! renewal, each within its time limit, and the bounds of how many go to
//! one holder at once.

use super::hold::Hold;

use connex_transfer::{CtrlClient, TransferError};
use std::time::{Duration, Instant};

/// Most calls in flight to one holder at once (renewals and releases
/// together). Each holder has its own: a holder that accepts connections and
/// never answers ties up only its own calls, never another holder's renewals.
/// Holders are the registered prefills' control addresses (a prefill answer
/// naming another is refused), so at most `--max-instances` times this many
/// calls run at once.
pub(super) const MAX_CALLS_PER_HOLDER: usize = 8;

/// Most release batches (of up to `MAX_RELEASE_BATCH` holds each) waiting
/// for one holder behind its calls in flight. Past it the oldest batch is
/// given up (counted as `dropped`): its holds expire by their leases.
pub(super) const MAX_WAITING_RELEASE_BATCHES: usize = 16;

/// Most queued commands or due renewals the keeper takes in one turn before it
/// looks at its timers and finished calls again.
pub(super) const MAX_COMMANDS_AT_ONCE: usize = 256;

/// How long a release waits for others to the same holder: the requests that
/// end within it cost their holder one `ReleaseMany` call instead of one call
/// each (at a few thousand requests a second, one call in ~20). The router's
/// release is a backstop (the decoder releases the hold on a normal finish,
/// the lease frees it otherwise), so a few ms later costs nothing.
pub(super) const RELEASE_LINGER: Duration = Duration::from_millis(5);

/// Waits before each retry of a release: a holder busy under load (its
/// accept backlog full, a call past the control timeout) gets a few chances
/// over ~2 s; after that the hold's lease frees it anyway.
pub(super) const RELEASE_BACKOFF: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_millis(1500),
];

/// Time limits of the keeper's calls, from `--ctrl-timeout` (which the
/// control client applies to each connect, read and write on its own, so a
/// call of several steps could otherwise last several times it).
#[derive(Debug, Clone, Copy)]
pub(super) struct CallLimits {
    /// One request: a connect and three exchanges (a new connection's two
    /// handshake exchanges, then the request). A renewal also ends at its
    /// hold's expiry, after which it is of no use.
    pub(super) attempt: Duration,
    /// One release, its retries and their waits included.
    pub(super) release: Duration,
}

impl CallLimits {
    pub(super) fn new(ctrl_timeout: Duration) -> Self {
        let attempt = ctrl_timeout.saturating_mul(4);
        let waits: Duration = RELEASE_BACKOFF.iter().sum();
        Self {
            attempt,
            release: attempt.saturating_mul(2).saturating_add(waits),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Renewal {
    Renewed,
    Failed,
    Gone,
}

/// Releases the holds `ids` on `holder`: in one `ReleaseMany` call, or one
/// by one for a single hold or a holder that predates the op; all within
/// `limits.release`.
pub(super) async fn release(
    ctrl: CtrlClient,
    holder: String,
    ids: Vec<String>,
    limits: CallLimits,
) {
    let deadline = Instant::now() + limits.release;
    if ids.len() > 1 {
        match with_backoff(deadline, limits.attempt, || {
            ctrl.release_many(&holder, &ids)
        })
        .await
        {
            Ok(were) => {
                for was in were {
                    count_release(&holder, Ok(was));
                }
                return;
            }
            Err(err) if err.is_unknown_op() => {
                tracing::debug!(%holder, "the holder has no ReleaseMany: releasing one by one");
            }
            Err(err) => {
                for _ in &ids {
                    count_release(&holder, Err(&err));
                }
                return;
            }
        }
    }
    for id in &ids {
        let outcome = with_backoff(deadline, limits.attempt, || ctrl.release(&holder, id)).await;
        count_release(&holder, outcome.as_ref().map(|was| *was));
    }
}

/// A release call, each try bounded by `attempt`, tried again after
/// [`RELEASE_BACKOFF`]'s waits while it fails for a reason that may pass: not
/// a refused connection (the holder is gone, and its holds with it), not an op
/// the holder does not know; nothing starts or waits past `deadline`.
pub(super) async fn with_backoff<T, F, Fut>(
    deadline: Instant,
    attempt: Duration,
    mut call: F,
) -> Result<T, TransferError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransferError>>,
{
    let mut backoff = RELEASE_BACKOFF.iter();
    loop {
        let limit = attempt.min(deadline.saturating_duration_since(Instant::now()));
        let outcome = match tokio::time::timeout(limit, call()).await {
            Ok(outcome) => outcome,
            Err(_) => Err(TransferError::Timeout {
                what: "releasing holds",
                after: limit,
            }),
        };
        match outcome {
            Err(err) if !is_refused(&err) && !err.is_unknown_op() => match backoff.next() {
                Some(wait) if Instant::now() + *wait < deadline => {
                    tokio::time::sleep(*wait).await;
                }
                _ => return Err(err),
            },
            outcome => return outcome,
        }
    }
}

/// One hold's release outcome, in `connex_holds_released_total`.
pub(super) fn count_release(holder: &str, outcome: Result<bool, &TransferError>) {
    match outcome {
        Ok(was_held) => {
            crate::observe::metrics::hold_released(if was_held { "released" } else { "gone" });
        }
        Err(err) => {
            tracing::debug!(%holder, %err, "hold release failed");
            crate::observe::metrics::hold_released("failed");
        }
    }
}

/// A refused connection, or an address the upstream policy refuses: no
/// retry would go through.
pub(super) fn is_refused(err: &TransferError) -> bool {
    use std::io::ErrorKind::{ConnectionRefused, PermissionDenied};
    matches!(err, TransferError::Unreachable { source, .. }
        if matches!(source.kind(), ConnectionRefused | PermissionDenied))
}

/// Renews `hold` at `epoch`, giving up after `limit`.
pub(super) async fn renew(ctrl: CtrlClient, hold: Hold, epoch: u32, limit: Duration) -> Renewal {
    let call = ctrl.renew(&hold.ctrl, &hold.transfer_id, epoch);
    let outcome = match tokio::time::timeout(limit, call).await {
        Ok(outcome) => outcome,
        Err(_) => Err(TransferError::Timeout {
            what: "renewing a hold",
            after: limit,
        }),
    };
    match outcome {
        Ok(_) => {
            crate::observe::metrics::hold_renewed("renewed");
            Renewal::Renewed
        }
        Err(err) => {
            tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold renew failed");
            if err.is_hold_lost() {
                crate::observe::metrics::hold_renewed("gone");
                Renewal::Gone
            } else {
                crate::observe::metrics::hold_renewed("failed");
                Renewal::Failed
            }
        }
    }
}
