//! Idempotent etcd calls sent again when the first has no answer soon.
//!
//! The etcd client balances calls over the cluster's members. When a member
//! dies, calls routed to it hang until its connection is found dead (the
//! HTTP/2 keep-alive: seconds), and a heartbeat whose lease keep-alive hangs
//! that long can let a short lease lapse: killing one of three members once
//! dropped a live instance from every replica's view. A second call sent
//! after [`hedge_after`] goes to another member; the first answer wins.

use futures_util::future::{select_ok, BoxFuture, FutureExt};
use std::future::Future;
use std::time::Duration;

/// How long a call may go unanswered before a copy is sent: a quarter of the
/// call's timeout (500 ms by default), far above a healthy member's answer.
pub fn hedge_after(timeout: Duration) -> Duration {
    timeout / 4
}

/// `call()` now and again after `after` if no answer came: the first `Ok`
/// wins (the other is dropped); an error only when both failed (the last).
/// Only for calls that may run twice (a read, a lease keep-alive).
pub async fn hedged<'a, T, E, F>(after: Duration, call: impl Fn() -> F) -> Result<T, E>
where
    F: Future<Output = Result<T, E>> + Send + 'a,
    T: Send + 'a,
    E: Send + 'a,
{
    let first: BoxFuture<'a, Result<T, E>> = call().boxed();
    let again = call();
    let second: BoxFuture<'a, Result<T, E>> = async move {
        tokio::time::sleep(after).await;
        again.await
    }
    .boxed();
    select_ok([first, second]).await.map(|(value, _)| value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    #[tokio::test]
    async fn a_call_that_hangs_is_answered_by_its_copy() {
        let sent = AtomicUsize::new(0);
        let started = Instant::now();
        let answer = hedged(Duration::from_millis(50), || {
            let n = sent.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    // Routed to a dead member: no answer for a long time.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Ok::<_, String>(n)
            }
        })
        .await;
        assert_eq!(answer, Ok(1), "the copy answered");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_prompt_answer_wins_and_an_error_waits_for_the_copy() {
        let fast = hedged(Duration::from_secs(30), || async {
            Ok::<_, String>("first")
        });
        let started = Instant::now();
        assert_eq!(fast.await, Ok("first"));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "not held for the copy"
        );

        let sent = AtomicUsize::new(0);
        let answer = hedged(Duration::from_millis(10), || {
            let n = sent.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err("no leader".to_string())
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(answer, Ok(1));

        let both: Result<(), String> = hedged(Duration::from_millis(10), || async {
            Err("down".to_string())
        })
        .await;
        assert_eq!(both, Err("down".to_string()));
    }
}
