//! Leases on background responses (one writer per response: a replica's
//! token, renewed with every write; fenced writes once another replica
//! claimed it) and the set of running responses whose keys are kept alive.

use super::connection::RedisStore;
use crate::store::stored::StoreResult;
use std::time::Duration;

/// Running responses one renewal call covers.
const RENEW_BATCH: usize = 256;

/// A new lease token: a replica's own claim on a generation, sent with
/// every write (ten times a second), so short: 64 bits of a random UUID,
/// which no other replica's token shares.
pub fn lease_token() -> String {
    format!("{:016x}", uuid::Uuid::new_v4().as_u128() as u64)
}

impl RedisStore {
    /// Claims up to `most` running responses whose lease expired, for
    /// `token`, leaving `own` alone (the claimer's own generations); returns
    /// the ids won (no other replica wins them).
    pub async fn claim_expired(
        &self,
        token: &str,
        most: usize,
        own: &[String],
    ) -> StoreResult<Vec<String>> {
        let mut invocation = self.scripts.claim.prepare_invoke();
        invocation
            .key(self.running_key())
            .arg(token)
            .arg(self.lease_ms())
            .arg(&self.settings.prefix)
            .arg(most);
        for id in own {
            invocation.arg(id);
        }
        let won: Vec<String> = self
            .call("claim", async |conn| invocation.invoke_async(conn).await)
            .await?;
        // Read back from the store: held to what a client's id is held to
        // before it names a key (the script drops such ids already; this
        // holds whatever answered as Redis to the same).
        Ok(won
            .into_iter()
            .filter(|id| {
                let valid = crate::protocols::responses::valid_response_id(id);
                if !valid {
                    tracing::warn!(
                        bytes = id.len(),
                        "an id that cannot be a response's among the running ones; ignored"
                    );
                }
                valid
            })
            .collect())
    }

    /// Lets the lease `token` holds on `id` go, for another replica to claim.
    pub async fn release_lease(&self, id: &str, token: &str) -> StoreResult<()> {
        let mut invocation = self.scripts.release.prepare_invoke();
        invocation
            .key(self.key(id, "lease"))
            .key(self.running_key())
            .arg(token)
            .arg(id);
        self.call("release", async |conn| {
            invocation.invoke_async::<i64>(conn).await.map(|_| ())
        })
        .await
    }

    /// Renews the lease `token` holds on `id`; false when it holds it no
    /// longer (another replica claimed it, or it ran out).
    pub async fn renew_lease(&self, id: &str, token: &str) -> StoreResult<bool> {
        let mut invocation = self.scripts.renew_lease.prepare_invoke();
        invocation
            .key(self.key(id, "lease"))
            .key(self.running_key())
            .arg(token)
            .arg(self.lease_ms())
            .arg(id);
        let renewed: i64 = self
            .call("lease", async |conn| invocation.invoke_async(conn).await)
            .await?;
        Ok(renewed == 1)
    }

    /// Renews the TTL of every key of every running response (those any
    /// replica generates), in batches; returns how many there were.
    pub async fn renew_running(&self) -> StoreResult<usize> {
        let mut renewed = 0;
        loop {
            let mut invocation = self.scripts.renew.prepare_invoke();
            invocation
                .key(self.running_key())
                .arg(&self.settings.prefix)
                .arg(self.ttl_s())
                .arg(renewed)
                .arg(renewed + RENEW_BATCH - 1);
            let batch: usize = self
                .call_bulk("renew", async |conn| invocation.invoke_async(conn).await)
                .await?;
            renewed += batch;
            if batch < RENEW_BATCH {
                return Ok(renewed);
            }
        }
    }

    /// How often the running responses' TTLs are renewed: several times per
    /// TTL, so that none lapses between renewals.
    pub fn renew_every(&self) -> Duration {
        (self.settings.ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
    }

    /// Removes `id` from the running responses (its keys are gone).
    pub async fn forget_running(&self, id: &str) -> StoreResult<()> {
        let (running, lease) = (self.running_key(), self.key(id, "lease"));
        self.call("forget", async |conn| {
            redis::pipe()
                .zrem(running, id)
                .del(lease)
                .query_async::<()>(conn)
                .await
        })
        .await
    }
}
