//! `/v1/messages` (Anthropic's Messages API), streamed or not: a chat run
//! through prefill/decode (`translated.rs`; `crate::protocols::messages`
//! translates both ways). Every error of the route is in Anthropic's shape.

use super::translated::{serve, Prepared};
use crate::background::translation::Translation;
use crate::edge::app::AppState;
use crate::error::{ApiError, ANTHROPIC_PATH};
use crate::protocols::client_event::{json_of, EventWriter};
use crate::protocols::messages::request::chat_body;
use crate::protocols::messages::stream::MessageEvents;
use crate::protocols::openai::chunk::Chunk;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::value::RawValue;
use serde_json::Value;
use std::sync::Arc;

pub async fn create(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let served = serve(state, ANTHROPIC_PATH, request, async |_, request, _| {
        let (echo, chat) = chat_body(&request)?;
        let stream = echo.stream;
        let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
        Ok(Prepared {
            chat,
            translation: MessageTranslation(MessageEvents::new(id, echo)),
            stream,
            background: None,
        })
    })
    .await;
    served.unwrap_or_else(|error| error.response_for(ANTHROPIC_PATH))
}

/// A message being made from its chat (its events made as JSON values: a
/// Messages stream has a few events per token fewer than a Responses one).
struct MessageTranslation(MessageEvents);

fn write(out: &mut EventWriter, events: Vec<Value>) {
    for event in &events {
        out.value(event);
    }
}

impl Translation for MessageTranslation {
    fn start(&mut self, out: &mut EventWriter) {
        write(out, self.0.start());
    }

    fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut EventWriter) {
        write(out, self.0.chunk(chunk));
    }

    fn finish(&mut self, usage: Value, out: &mut EventWriter) -> Box<RawValue> {
        let (events, whole) = self.0.finish(usage);
        write(out, events);
        json_of(&whole)
    }

    fn fail(&mut self, error: &Value, out: &mut EventWriter) -> Box<RawValue> {
        let (events, whole) = self.0.fail(error);
        write(out, events);
        json_of(&whole)
    }

    fn answer(&self, whole: Box<RawValue>, failed: bool) -> Response {
        if failed {
            return ApiError::Unavailable("the generation failed".into())
                .response_for(ANTHROPIC_PATH);
        }
        Json(whole).into_response()
    }
}
