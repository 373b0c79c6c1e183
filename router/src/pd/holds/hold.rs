//! A prefill's hold as its `kv_transfer_params` name it, and what a resume
//! learns of it.

use serde_json::Value;
use std::time::Duration;

/// A prefill's hold as its `kv_transfer_params` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The holder's control address (`remote_ctrl`).
    pub ctrl: String,
    pub transfer_id: String,
    /// `lease_s`: how long the hold lives without a pull or renew.
    pub lease: Duration,
}

impl Hold {
    /// The hold named by `kv_transfer_params`; `None` when the connector gave no
    /// control address or transfer id (a connector without holds).
    /// A transfer id the control protocol refuses (too long, not printable
    /// ASCII) names no hold either: no holder could renew or release it, and
    /// in a batch of releases it would spoil the others.
    pub fn from_params(kv: &Value) -> Option<Self> {
        let text = |key| kv.get(key).and_then(Value::as_str).map(str::to_string);
        Some(Self {
            ctrl: text("remote_ctrl")?,
            transfer_id: text("transfer_id")
                .filter(|id| connex_transfer::proto::check_transfer_id(id).is_ok())?,
            lease: Duration::from_secs_f64(
                kv.get("lease_s")
                    .and_then(Value::as_f64)
                    .unwrap_or(60.0)
                    .clamp(MIN_LEASE_S, MAX_LEASE_S),
            ),
        })
    }
}

/// The shortest lease the keeper believes. A hold is renewed at half its
/// lease (and retried at an eighth after a failure), so a prefill answering
/// `lease_s: 1e-300` would have the keeper renew it in a tight loop; a
/// hold shorter than this could not last through a resume's check and pull
/// anyway.
const MIN_LEASE_S: f64 = 1.0;
/// The longest: a day.
const MAX_LEASE_S: f64 = 86_400.0;

/// What a resume learns of its hold.
#[derive(Debug)]
pub enum HoldState {
    Held,
    /// Released, expired, evicted, or its holder is unreachable.
    Lost(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hold_comes_from_the_connector_params() {
        let hold =
            Hold::from_params(&json!({"remote_ctrl":"127.0.0.1:9","transfer_id":"t","lease_s":30}))
                .expect("a hold");
        assert_eq!(hold.ctrl, "127.0.0.1:9");
        assert_eq!(hold.lease, Duration::from_secs(30));
        assert_eq!(Hold::from_params(&json!({"transfer_id":"t"})), None);
        for bad in ["", "has space", "é"] {
            let kv = json!({"remote_ctrl":"127.0.0.1:9","transfer_id":bad});
            assert_eq!(Hold::from_params(&kv), None, "{bad:?}");
        }
    }
}
