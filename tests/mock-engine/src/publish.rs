//! The prefix cache's KV events over ZMQ, as vLLM's `ZmqEventPublisher`
//! sends them (vllm/distributed/kv_events.py), so that any reader of vLLM's
//! feed (vllm-router's `kv_aware` with `--pd-kv-events`, Connex's agent,
//! vLLM's example subscriber) reads the mock's too: a PUB socket; each batch
//! one multipart message (topic, 8-byte big-endian sequence number, msgpack
//! payload). The payload is a `KVEventBatch`, array-like: `[ts, events]`
//! (`data_parallel_rank` is left out, as msgspec omits a default); each event a
//! map tagged with its class name under `type`, with vLLM's field names.
//!
//! A ZMQ PUB socket drops messages for a subscriber that cannot keep up, and
//! has nobody to send to before one connects: as with vLLM, the sequence
//! number is what tells a subscriber it missed events.

use crate::api::EngineState;
use serde_json::Value;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// A bound publisher, not yet publishing.
pub struct Publisher {
    socket: zeromq::PubSocket,
    /// Where it is bound (the resolved port when bound to port 0).
    pub endpoint: String,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot publish KV events on {endpoint}: {source}")]
pub struct BindError {
    endpoint: String,
    source: zeromq::ZmqError,
}

impl Publisher {
    /// Binds `endpoint` (e.g. `tcp://127.0.0.1:5557`).
    pub async fn bind(endpoint: &str) -> Result<Self, BindError> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket.bind(endpoint).await.map_err(|source| BindError {
            endpoint: endpoint.to_string(),
            source,
        })?;
        Ok(Self {
            socket,
            endpoint: bound.to_string(),
        })
    }

    /// Publishes the prefix cache's events as they come, until `shutdown`.
    pub async fn run(mut self, state: Arc<EngineState>, shutdown: CancellationToken) {
        let Some(prefix) = &state.prefix else {
            return;
        };
        let mut seq: u64 = 0;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = state.published_ready.notified() => {}
            }
            let events = prefix
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take_published();
            if events.is_empty() {
                continue;
            }
            let message = match encode(&events, seq) {
                Ok(message) => message,
                Err(err) => {
                    tracing::error!(%err, "KV event batch not encodable");
                    continue;
                }
            };
            // A sequence number per batch, sent or not (a gap tells a loss).
            seq += 1;
            if let Err(err) = self.socket.send(message).await {
                tracing::warn!(%err, "KV event batch not published");
            }
        }
        self.socket.close().await;
    }
}

/// One batch as vLLM's publisher frames it.
fn encode(events: &[Value], seq: u64) -> Result<ZmqMessage, rmp_serde::encode::Error> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    // A tuple is a msgpack array; `_named` writes maps with their keys
    // (the events are JSON objects, written as msgpack maps either way).
    let payload = rmp_serde::to_vec_named(&(ts, events))?;
    let mut message = ZmqMessage::from(Vec::<u8>::new());
    message.push_back(seq.to_be_bytes().to_vec().into());
    message.push_back(payload.into());
    Ok(message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn a_batch_is_topic_sequence_and_an_array_of_timestamp_and_tagged_maps() {
        let events = vec![json!({"type": "AllBlocksCleared"})];
        let message = encode(&events, 7).unwrap();
        let frames = message.into_vec();
        assert_eq!(frames.len(), 3);
        assert!(frames[0].is_empty(), "vLLM's default topic is empty");
        assert_eq!(frames[1].as_ref(), &7u64.to_be_bytes());
        let payload = frames[2].as_ref();
        // fixarray of 2, then a float64 timestamp.
        assert_eq!(payload[0], 0x92);
        assert_eq!(payload[1], 0xcb);
        // fixarray of 1 event: a fixmap of 1 entry, "type" -> "AllBlocksCleared".
        assert_eq!(&payload[10..13], &[0x91, 0x81, 0xa4]);
        assert_eq!(&payload[13..17], b"type");
    }
}
