//! The mock engine's KV cache, held and pulled for real through connex-transfer.
//!
//! A prompt's KV bytes are a pure function of its token ids ([`kv_bytes`]:
//! each token's bytes depend on the whole prefix up to it, as real KV does).
//! A prefill holds them in a buffer served by its [`Holder`]; a decoder given
//! `do_remote_prefill` pulls `remote_num_tokens` worth with its [`Reader`],
//! checks every byte against what it computes itself, and releases the hold
//! when its request finishes normally (not when it is cut off: the router may
//! be resuming it elsewhere from the same hold).

use crate::config::MockConfig;
use crate::model::ContextHash;
use connex_transfer::{
    BackendKind, BlockRef, Holder, HolderConfig, HolderStats, Reader, ReaderConfig, Region, Secret,
    TransferError,
};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::task::JoinSet;

/// Tokens per KV block (vLLM's default block size).
pub const BLOCK_TOKENS: usize = 16;

/// The KV bytes of `prompt_ids`: `bytes_per_token` bytes per token.
pub fn kv_bytes(prompt_ids: &[u32], bytes_per_token: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(prompt_ids.len() * bytes_per_token);
    let mut context = ContextHash::default();
    for (i, &id) in prompt_ids.iter().enumerate() {
        context.absorb(id);
        let seed = ((i as u64) << 32) | u64::from(context.next_token());
        connex_transfer::extend_pattern(&mut out, seed, bytes_per_token);
    }
    out
}

/// Block lengths of `tokens` tokens' KV.
fn block_lens(tokens: usize, bytes_per_token: usize) -> Vec<u64> {
    (0..tokens.div_ceil(BLOCK_TOKENS))
        .map(|b| ((tokens - b * BLOCK_TOKENS).min(BLOCK_TOKENS) * bytes_per_token) as u64)
        .collect()
}

/// A hold this decoder pulled, to release when its request finishes.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub remote_ctrl: String,
    pub transfer_id: String,
    pub bytes: u64,
}

/// Holder + reader of one engine.
pub struct KvState {
    holder: Holder,
    reader: Reader,
    /// The reader's time limit for a whole pull (also for a partial one).
    pull_timeout: Duration,
    bytes_per_token: usize,
    lease_s: u64,
    /// Releases in flight (each bounded by the client's timeouts).
    releases: std::sync::Mutex<JoinSet<()>>,
}

impl KvState {
    /// Starts the holder on the engine's host (`--kv-port`, else any free port).
    pub async fn start(config: &MockConfig) -> Result<Self, TransferError> {
        let secret = config.transfer_secret.clone().and_then(Secret::new);
        let holder = Holder::start(HolderConfig {
            listen: SocketAddr::new(config.listen.ip(), config.kv_port),
            backend: config.transfer_backend,
            retain: Duration::from_secs(config.retain_s),
            release: config.hold_release,
            budget_bytes: config.hold_budget_bytes,
            secret: secret.clone(),
            max_connections_per_peer: config.holder_max_connections_per_peer,
            ..HolderConfig::default()
        })
        .await?;
        let mut reader = ReaderConfig::new(config.transfer_backend);
        reader.client.secret = secret;
        Ok(Self {
            holder,
            pull_timeout: reader.pull_timeout,
            reader: Reader::with_config(reader)?,
            bytes_per_token: config.kv_bytes_per_token,
            lease_s: config.retain_s,
            releases: std::sync::Mutex::new(JoinSet::new()),
        })
    }

    /// The holder's `remote_ctrl` address.
    pub fn ctrl_addr(&self) -> String {
        self.holder.ctrl_addr().to_string()
    }

    pub fn backend(&self) -> BackendKind {
        self.holder.backend()
    }

    pub fn stats(&self) -> HolderStats {
        self.holder.stats()
    }

    /// Prefill: holds the prompt's KV and returns the `kv_transfer_params`
    /// its response carries.
    pub fn hold(&self, prompt_ids: &[u32], engine_id: &str) -> Result<Value, TransferError> {
        let transfer_id = connex_transfer::new_transfer_id();
        let region = self
            .holder
            .register_region(Region::owned(kv_bytes(prompt_ids, self.bytes_per_token)))?;
        let mut offset = 0;
        let blocks: Vec<BlockRef> = block_lens(prompt_ids.len(), self.bytes_per_token)
            .into_iter()
            .map(|len| {
                let block = BlockRef::new(region, offset, len);
                offset += len;
                block
            })
            .collect();
        let held = self.holder.create_hold(&transfer_id, blocks.clone());
        // The hold keeps the buffer alive until it is freed.
        self.holder.unregister_region(region);
        held?;
        Ok(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_id": transfer_id,
            "remote_ctrl": self.ctrl_addr(),
            "remote_engine_id": engine_id,
            "remote_block_ids": (0..blocks.len()).collect::<Vec<_>>(),
            "remote_num_tokens": prompt_ids.len(),
            "backend": self.backend().name(),
            "lease_s": self.lease_s,
            "resume_epoch": 0,
        }))
    }

    /// Decode: pulls the prompt KV named by `params` and checks it equals the
    /// KV of `prompt_ids[..remote_num_tokens]`. The error text is the reason.
    /// The whole blocks of the first `cached` tokens (this decoder's prefix
    /// cache has them) are not pulled, as vLLM's connector pulls only what
    /// the local prefix cache lacks.
    pub async fn load(
        &self,
        params: &Value,
        prompt_ids: &[u32],
        cached: usize,
    ) -> Result<Pulled, String> {
        let text = |key: &str| {
            params
                .get(key)
                .and_then(Value::as_str)
                .ok_or(format!("kv_transfer_params.{key} missing"))
        };
        let (remote_ctrl, transfer_id) = (text("remote_ctrl")?, text("transfer_id")?);
        let tokens = params
            .get("remote_num_tokens")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or("kv_transfer_params.remote_num_tokens missing")?;
        let epoch = params
            .get("resume_epoch")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let epoch = u32::try_from(epoch).map_err(|_| "resume_epoch out of range")?;
        if tokens > prompt_ids.len() {
            return Err(format!(
                "remote_num_tokens {tokens} exceeds the prompt's {} tokens",
                prompt_ids.len()
            ));
        }
        let all = block_lens(tokens, self.bytes_per_token);
        let skip = (cached.min(tokens) / BLOCK_TOKENS).min(all.len());
        let lens = &all[skip..];
        let total: u64 = lens.iter().sum();
        let pulled_from = skip * BLOCK_TOKENS * self.bytes_per_token;
        let region = self
            .reader
            .register_region(Region::owned(vec![0; total as usize]))
            .map_err(|e| e.to_string())?;
        let mut offset = 0;
        let dest: Vec<BlockRef> = lens
            .iter()
            .map(|&len| {
                let block = BlockRef::new(region, offset, len);
                offset += len;
                block
            })
            .collect();
        let select: Vec<u32> = (skip..all.len())
            .filter_map(|b| u32::try_from(b).ok())
            .collect();
        let pulled = if select.is_empty() {
            // The whole prompt is cached here: nothing to pull.
            Ok(())
        } else {
            self.reader
                .pull_blocks(
                    remote_ctrl,
                    transfer_id,
                    epoch,
                    Some(&select),
                    &dest,
                    self.pull_timeout,
                )
                .await
                .map(|_| ())
        };
        let got = self.reader.take_region(region).map_err(|e| e.to_string())?;
        pulled.map_err(|e| e.to_string())?;
        let want = kv_bytes(&prompt_ids[..tokens], self.bytes_per_token);
        if got[..] != want[pulled_from..] {
            return Err(format!(
                "pulled KV of hold {transfer_id} does not match the prompt"
            ));
        }
        Ok(Pulled {
            remote_ctrl: remote_ctrl.to_string(),
            transfer_id: transfer_id.to_string(),
            bytes: total,
        })
    }

    /// Releases a pulled hold in the background (the response is not held up).
    pub fn release_later(&self, pulled: &Pulled) {
        let ctrl = self.reader.ctrl().clone();
        let Pulled {
            remote_ctrl,
            transfer_id,
            ..
        } = pulled.clone();
        let mut releases = self.releases.lock().unwrap_or_else(|e| e.into_inner());
        while releases.try_join_next().is_some() {}
        releases.spawn(async move {
            if let Err(err) = ctrl.release(&remote_ctrl, &transfer_id).await {
                tracing::warn!(%err, %transfer_id, "could not release the hold");
            }
        });
    }

    /// Waits for pending releases (bounded by the client's timeouts), then
    /// stops the holder.
    pub async fn stop(&self) {
        let mut releases =
            std::mem::take(&mut *self.releases.lock().unwrap_or_else(|e| e.into_inner()));
        while releases.join_next().await.is_some() {}
        self.holder.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_depends_on_the_whole_prefix() {
        let a = kv_bytes(&[1, 2, 3], 8);
        let b = kv_bytes(&[9, 2, 3], 8);
        assert_eq!(a.len(), 24);
        assert_ne!(a[16..], b[16..], "token 2's KV depends on token 0");
        assert_eq!(kv_bytes(&[1, 2], 8), a[..16]);
        assert_eq!(block_lens(33, 4), [64, 64, 4]);
        assert!(block_lens(0, 4).is_empty());
    }
}
