//! An engine's own model list (`GET {url}/v1/models`), read with a deadline and
//! a size cap. Two readers: the discovery of the model a static instance
//! serves (`statics`), and the router's `/v1/models`, which shows each model as
//! an engine describes it (`max_model_len`, `owned_by`...).

use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest engine model list read.
pub const MAX_MODEL_LIST: usize = 256 * 1024;

/// Why an engine's model list could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelListError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Transport(String),
    #[error("HTTP {0}")]
    Status(u16),
    #[error("larger than {MAX_MODEL_LIST} bytes")]
    TooLarge,
    #[error("not an OpenAI model list: {0}")]
    Invalid(String),
}

/// The entries of the engine's model list that have a string `id`, in its
/// order, within `timeout` (the whole call: connect, headers and body).
pub async fn fetch(
    client: &crate::engines::probe::ProbeClient,
    base_url: &str,
    timeout: Duration,
) -> Result<Vec<Map<String, Value>>, ModelListError> {
    let url = format!("{}/v1/models", base_url.trim_end_matches('/'));
    let call = async {
        let mut response = client
            .get(&url, timeout)
            .await
            .map_err(|e| ModelListError::Transport(e.to_string()))?;
        if !(200..300).contains(&response.status) {
            return Err(ModelListError::Status(response.status));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response
            .body
            .chunk()
            .await
            .map_err(|e| ModelListError::Transport(e.to_string()))?
        {
            if body.len() + chunk.len() > MAX_MODEL_LIST {
                return Err(ModelListError::TooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        parse(&body)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| ModelListError::Timeout(timeout))?
}

/// The model entries of an OpenAI list body (`{"data": [{"id": ...}, ...]}`).
fn parse(body: &[u8]) -> Result<Vec<Map<String, Value>>, ModelListError> {
    let list: Value =
        serde_json::from_slice(body).map_err(|e| ModelListError::Invalid(e.to_string()))?;
    let data = list
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| ModelListError::Invalid("no `data` array".into()))?;
    Ok(data
        .iter()
        .filter_map(Value::as_object)
        .filter(|entry| entry.get("id").is_some_and(Value::is_string))
        .cloned()
        .collect())
}

/// Most models cached (the registry bounds the models served; this bounds
/// the cache whatever it holds).
const MAX_CACHED: usize = 1024;

/// A model's entry as last read, and until when it is served as is.
pub struct Cached {
    pub entry: Value,
    pub until: Instant,
}

pub type ModelCacheSlot = Arc<tokio::sync::Mutex<Option<Cached>>>;

/// What `/v1/models` needs: the membership (which models are served, by
/// whom), the cache of their entries, and the engine client that reads them.
pub struct ModelLists {
    pub cache: ModelCache,
    pub client: crate::engines::probe::ProbeClient,
    pub registry: Arc<crate::membership::registry::Registry>,
}

/// The router's `/v1/models` cache: each served model's entry, as its
/// engines last described it (filled by `edge::routes::models`).
#[derive(Default)]
pub struct ModelCache {
    slots: Mutex<HashMap<String, ModelCacheSlot>>,
}

impl ModelCache {
    /// The slot of `id` (none when the cache is full), after dropping the
    /// slots of models not in `served`.
    pub fn slot(&self, id: &str, served: &[String]) -> Option<ModelCacheSlot> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if slots.len() >= MAX_CACHED || !slots.contains_key(id) {
            slots.retain(|model, _| served.contains(model));
        }
        if let Some(slot) = slots.get(id) {
            return Some(slot.clone());
        }
        (slots.len() < MAX_CACHED).then(|| {
            let slot = ModelCacheSlot::default();
            slots.insert(id.to_string(), slot.clone());
            slot
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keeps_the_entries_with_an_id_in_order() {
        let body =
            br#"{"object":"list","data":[{"id":"a","max_model_len":8},{"x":1},"s",{"id":"b"}]}"#;
        let ids: Vec<_> = parse(body)
            .unwrap()
            .into_iter()
            .map(|e| e["id"].clone())
            .collect();
        assert_eq!(ids, ["a", "b"]);
    }

    #[test]
    fn a_body_that_is_no_list_is_an_error() {
        assert!(matches!(parse(b"[]"), Err(ModelListError::Invalid(_))));
        assert!(matches!(parse(b"nope"), Err(ModelListError::Invalid(_))));
    }
}
