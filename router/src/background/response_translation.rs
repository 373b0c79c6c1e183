//! The Responses protocol's translation of a chat (`Translation`): its
//! events (`protocols/responses/stream.rs`), and the response kept in the
//! store once it ends. Here rather than beside the route: a background
//! response taken over from another replica (`takeover.rs`) is rebuilt from
//! its checkpoint as one.

use super::translation::Translation;
use crate::error::ApiError;
use crate::protocols::client_event::EventWriter;
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::responses::output::as_input;
use crate::protocols::responses::stream::ResponseEvents;
use crate::store::stored::{Stored, TenantQuota};
use crate::store::ResponseStores;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::Arc;

/// A response being made from its chat.
pub struct ResponseTranslation {
    stores: Arc<ResponseStores>,
    events: ResponseEvents,
    store: bool,
    /// The conversation up to this response (stored with its output).
    items: Vec<Value>,
    tenant: String,
    /// What its tenant may keep in the store.
    quota: TenantQuota,
    /// The response to store once it has ended (by `keep`).
    keeping: Option<(String, Stored)>,
}

impl Translation for ResponseTranslation {
    fn start(&mut self, out: &mut EventWriter) {
        self.events.start(out);
    }

    fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut EventWriter) {
        self.events.chunk(chunk, out);
    }

    fn finish(&mut self, usage: Value, out: &mut EventWriter) -> Box<RawValue> {
        let whole = self.events.finish(usage, out);
        if self.store {
            let mut conversation = std::mem::take(&mut self.items);
            conversation.extend(as_input(self.events.items()));
            self.keep_as(&whole, &conversation);
        }
        whole
    }

    fn fail(&mut self, error: &Value, out: &mut EventWriter) -> Box<RawValue> {
        self.events.fail(error, out)
    }

    fn cancel(&mut self, out: &mut EventWriter) -> Box<RawValue> {
        let whole = self.events.cancel(out);
        // A cancelled background response stays readable as cancelled.
        self.keep_as(&whole, &[]);
        whole
    }

    fn keep(&mut self) -> Option<BoxFuture<'static, ()>> {
        let (id, stored) = self.keeping.take()?;
        let stores = self.stores.clone();
        Some(Box::pin(async move {
            match stores.stored.put(&id, stored).await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(id, "response larger than the whole store; not stored"),
                Err(err) => tracing::warn!(id, %err, "response not stored"),
            }
        }))
    }

    fn take_kept(&mut self) -> Option<Stored> {
        self.keeping.take().map(|(_, stored)| stored)
    }

    fn origin(&self) -> Value {
        json!({"store": self.store, "items": self.items})
    }

    fn checkpoint(&self) -> Value {
        serde_json::to_value(&self.events).unwrap_or_default()
    }

    fn answer(&self, whole: Box<RawValue>, failed: bool) -> Response {
        if failed {
            let whole: Value = serde_json::from_str(whole.get()).unwrap_or_default();
            let message = whole["error"]["message"].as_str().unwrap_or_default();
            return ApiError::Unavailable(message.to_string()).into_response();
        }
        Json(whole).into_response()
    }
}

impl ResponseTranslation {
    /// A new response's translation: `items` the conversation up to it,
    /// kept with its output when `store`; `quota` what its tenant may keep.
    pub fn new(
        stores: Arc<ResponseStores>,
        events: ResponseEvents,
        store: bool,
        items: Vec<Value>,
        tenant: &str,
        quota: TenantQuota,
    ) -> Self {
        Self {
            stores,
            events,
            store,
            items,
            tenant: tenant.to_string(),
            quota,
            keeping: None,
        }
    }

    /// The translation of a generation taken over from another replica:
    /// `origin` and `checkpoint` as that replica wrote them; `quota`: what
    /// its tenant may keep, as configured here.
    pub fn resumed(
        stores: Arc<ResponseStores>,
        origin: &Value,
        checkpoint: Value,
        tenant: &str,
        quota: TenantQuota,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            stores,
            events: serde_json::from_value(checkpoint)?,
            store: origin["store"].as_bool().unwrap_or(true),
            items: serde_json::from_value(origin["items"].clone())?,
            tenant: tenant.to_string(),
            quota,
            keeping: None,
        })
    }

    /// Keeps `whole` (with `conversation`) once the last events are made.
    fn keep_as(&mut self, whole: &RawValue, conversation: &[Value]) {
        let id = self.events.id().to_string();
        let stored =
            Stored::new(whole.to_owned(), conversation, self.tenant.clone()).with_quota(self.quota);
        self.keeping = Some((id, stored));
    }
}
