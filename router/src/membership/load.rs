//! What an engine reports of its own load with each heartbeat: requests
//! running and waiting in its scheduler, and how full its KV cache is. The
//! router's own in-flight count only knows what this replica sent; these
//! numbers include everything the engine has (other replicas' requests too).

use serde::Serialize;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Load stats of one heartbeat (every field optional in the body: absent is 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineLoad {
    /// Requests the engine is running (decoding or prefilling) now.
    pub running: u32,
    /// Requests queued in the engine, not yet scheduled.
    pub waiting: u32,
    /// Fraction of the KV cache in use, 0 to 1.
    pub kv_usage: f64,
}

/// A heartbeat body whose load stats cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("heartbeat `{field}` must be {expected}")]
pub struct BadLoad {
    pub field: &'static str,
    pub expected: &'static str,
}

impl EngineLoad {
    /// Reads the stats of a heartbeat body (`null`: none). Keys it does not
    /// know are ignored, so that agents may send more than this router reads;
    /// `inflight` (what older agents send) counts as `running` when that is
    /// absent.
    pub fn from_heartbeat(body: &Value) -> Result<Option<Self>, BadLoad> {
        let object = match body {
            Value::Null => return Ok(None),
            Value::Object(object) => object,
            _ => {
                return Err(BadLoad {
                    field: "body",
                    expected: "a JSON object",
                })
            }
        };
        let count = |field: &'static str| -> Result<Option<u32>, BadLoad> {
            match object.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_u64()
                    .map(|n| Some(n.min(u64::from(u32::MAX)) as u32))
                    .ok_or(BadLoad {
                        field,
                        expected: "a non-negative integer",
                    }),
            }
        };
        let kv_usage = match object.get("kv_usage") {
            None | Some(Value::Null) => 0.0,
            Some(value) => value
                .as_f64()
                .filter(|u| (0.0..=1.0).contains(u))
                .ok_or(BadLoad {
                    field: "kv_usage",
                    expected: "a number from 0 to 1",
                })?,
        };
        let running = match count("running")? {
            Some(running) => running,
            None => count("inflight")?.unwrap_or(0),
        };
        Ok(Some(Self {
            running,
            waiting: count("waiting")?.unwrap_or(0),
            kv_usage,
        }))
    }
}

/// The last load an instance reported, and when.
#[derive(Debug, Clone, Copy)]
pub struct Reported {
    pub load: EngineLoad,
    pub at: Instant,
}

impl Reported {
    /// The load, unless older than `max_age` (an engine that stopped
    /// reporting is judged by this router's in-flight count alone).
    pub fn fresh(&self, max_age: Duration) -> Option<EngineLoad> {
        (self.at.elapsed() <= max_age).then_some(self.load)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn heartbeat_bodies_are_read_leniently_but_typed() {
        assert_eq!(EngineLoad::from_heartbeat(&Value::Null), Ok(None));
        let load = EngineLoad::from_heartbeat(
            &json!({"running": 3, "waiting": 7, "kv_usage": 0.5, "other": "x"}),
        )
        .unwrap()
        .unwrap();
        assert_eq!((load.running, load.waiting, load.kv_usage), (3, 7, 0.5));
        let legacy = EngineLoad::from_heartbeat(&json!({"inflight": 4}))
            .unwrap()
            .unwrap();
        assert_eq!(legacy.running, 4);
        assert_eq!(
            EngineLoad::from_heartbeat(&json!({"waiting": -1}))
                .unwrap_err()
                .field,
            "waiting"
        );
        assert_eq!(
            EngineLoad::from_heartbeat(&json!({"kv_usage": 1.5}))
                .unwrap_err()
                .field,
            "kv_usage"
        );
        assert!(EngineLoad::from_heartbeat(&json!([1])).is_err());
    }
}
