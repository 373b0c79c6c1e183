//! A client protocol's translation of a chat, as the relay drives it: the
//! `Translation` each translated protocol implements (its events from the
//! chat's chunks, its whole answer), and the `TranslationDriver` that runs
//! one for a request: the relay feeds it (it is the relay's
//! `TranslatedOutput`), it writes the events to their `Destination` (a
//! streaming client, a background response's log, or nowhere: a non-stream
//! client gets the whole answer) and keeps the chat's end for whoever
//! answers. The translated
//! routes (`edge/routes/translated.rs`) and the background generations
//! (`run.rs`, `takeover.rs`) share it.

use crate::error::ApiError;
use crate::protocols::client_event::{Destination, EventWriter};
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::openai::translated_output::TranslatedOutput;
use crate::store::live::Live;
use crate::store::stored::Stored;
use axum::response::Response;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, MutexGuard};

/// A protocol's side of one request: its events from the chat's chunks,
/// written to `out` (for their `Destination`).
pub trait Translation: Send + 'static {
    /// The events before the first chunk.
    fn start(&mut self, out: &mut EventWriter);
    /// The events of one chat chunk.
    fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut EventWriter);
    /// The last events of a chat that ended (`usage`: the router's count);
    /// returns the whole answer (as its JSON: written once, for the client,
    /// the store and a background response's readers alike).
    fn finish(&mut self, usage: Value, out: &mut EventWriter) -> Box<RawValue>;
    /// The last events of a chat that failed (`error`: an OpenAI error
    /// object); returns the whole answer as it stands.
    fn fail(&mut self, error: &Value, out: &mut EventWriter) -> Box<RawValue>;
    /// The non-stream answer from the whole answer `finish` or `fail` made.
    fn answer(&self, whole: Box<RawValue>, failed: bool) -> Response;
    /// The last events of a generation cancelled by its client; returns the
    /// whole answer as it stands (background responses only).
    fn cancel(&mut self, out: &mut EventWriter) -> Box<RawValue> {
        self.fail(&json!({"message": "cancelled"}), out)
    }
    /// What must be kept before the last events go out (a stored response,
    /// so that a client that read them can at once continue from it).
    fn keep(&mut self) -> Option<BoxFuture<'static, ()>> {
        None
    }
    /// What `keep` would store, taken instead: a background response's
    /// writer stores it under its lease in the shared store (`mirror.rs`).
    fn take_kept(&mut self) -> Option<Stored> {
        None
    }
    /// What of the translation never changes, for a replica that takes a
    /// background generation over (`takeover.rs`).
    fn origin(&self) -> Value {
        Value::Null
    }
    /// The translation's state as of its last events, for the same.
    fn checkpoint(&self) -> Value {
        Value::Null
    }
}

/// A translation's state as the relay drives it.
pub struct DriverState<T> {
    pub(crate) translation: T,
    to: Destination<Arc<Live>>,
    /// Whether its first events were made (a generation taken over from
    /// another replica had them there).
    started: bool,
    /// The last events and the whole answer of the chat's end, until they go
    /// out (after what the translation keeps), and whether it failed.
    ending: Option<(EventWriter, Box<RawValue>, bool)>,
    /// Whether its last events were made (by the chat's end or a cut).
    ended: bool,
}

impl<T: Translation> DriverState<T> {
    /// Where the next events are written, for their destination.
    pub(crate) fn out(&self) -> EventWriter {
        EventWriter::new(self.to.kind())
    }

    /// What the translation keeps as it ends: with a shared store, a
    /// background response's writer stores it under its lease (nothing to
    /// wait for here: readers get the last events once it is stored).
    pub(crate) fn keeping(&mut self) -> Option<BoxFuture<'static, ()>> {
        if let Destination::Log(live) = &self.to {
            if live.is_shared() {
                if let Some(stored) = self.translation.take_kept() {
                    live.keep(stored);
                }
                return None;
            }
        }
        self.translation.keep()
    }

    /// The events written to `out` sent to their destination; a streaming
    /// client's bytes.
    fn send(&self, out: EventWriter) -> Option<Bytes> {
        match &self.to {
            Destination::Client => Some(out.into_frames())
                .filter(|f| !f.is_empty())
                .map(Bytes::from),
            Destination::Log(live) => {
                let events = out.into_events();
                if !events.is_empty() {
                    live.push(events, None);
                }
                None
            }
            Destination::Nowhere => None,
        }
    }
}

/// One request's translation as the relay drives it, shared by the relay,
/// which feeds it, and the route, which answers from it (a whole answer, a
/// background response's checkpoints).
pub struct TranslationDriver<T>(Arc<Mutex<DriverState<T>>>);

impl<T> Clone for TranslationDriver<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Translation> TranslationDriver<T> {
    pub fn new(translation: T, to: Destination<Arc<Live>>, started: bool) -> Self {
        Self(Arc::new(Mutex::new(DriverState {
            translation,
            to,
            started,
            ending: None,
            ended: false,
        })))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, DriverState<T>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The chat's end, once it came: its last events, the whole answer and
    /// whether it failed (taken: they go out once).
    pub(crate) fn take_ending(&self) -> Option<(EventWriter, Box<RawValue>, bool)> {
        self.lock().ending.take()
    }

    /// The relay's handle on it: the relay's output for this client.
    pub fn as_output(&self) -> Box<dyn TranslatedOutput> {
        Box::new(self.clone())
    }

    /// The last bytes of a streaming client's stream cut at the end of the
    /// shutdown grace (`gate::StreamEnding`): the chat's own end when it came
    /// and has not gone out yet (it waited on what the translation keeps),
    /// else the translation's failure events, numbered on from its last
    /// (Responses: `error` and `response.failed`; Messages: its open block
    /// closed and Anthropic's `error` event; `error`: the OpenAI error
    /// object). Nothing when the end went out.
    pub fn cut(&self, error: &Value) -> Bytes {
        let mut driver = self.lock();
        if let Some((out, _, _)) = driver.ending.take() {
            return driver.send(out).unwrap_or_default();
        }
        if std::mem::replace(&mut driver.ended, true) {
            return Bytes::new();
        }
        let mut out = driver.out();
        driver.translation.fail(error, &mut out);
        driver.send(out).unwrap_or_default()
    }
}

impl<T: Translation> TranslatedOutput for TranslationDriver<T> {
    fn start(&mut self) -> Option<Bytes> {
        let mut driver = self.lock();
        if std::mem::replace(&mut driver.started, true) {
            return None;
        }
        let mut out = driver.out();
        driver.translation.start(&mut out);
        driver.send(out)
    }

    fn chunk(&mut self, chunk: &Chunk<'_>) -> Option<Bytes> {
        let mut driver = self.lock();
        let mut out = driver.out();
        driver.translation.chunk(chunk, &mut out);
        driver.send(out)
    }

    fn finish(&mut self, usage: Value) -> Option<BoxFuture<'static, ()>> {
        let mut driver = self.lock();
        let mut out = driver.out();
        let whole = driver.translation.finish(usage, &mut out);
        driver.ending = Some((out, whole, false));
        driver.ended = true;
        driver.keeping()
    }

    fn fail(&mut self, error: &ApiError) {
        let mut driver = self.lock();
        let mut out = driver.out();
        let whole = driver.translation.fail(&error.body()["error"], &mut out);
        driver.ending = Some((out, whole, true));
        driver.ended = true;
    }

    fn last(&mut self) -> Option<Bytes> {
        let mut driver = self.lock();
        // Only a streaming client's go out here: the route takes the others'.
        if driver.to.kind() != Destination::Client {
            return None;
        }
        let (out, _, _) = driver.ending.take()?;
        driver.send(out)
    }
}

/// The end of a chat whose session ended without one (it always makes one:
/// its last events or its error's).
pub(crate) fn no_ending<T: Translation>(
    driver: &TranslationDriver<T>,
) -> (EventWriter, Box<RawValue>, bool) {
    let error = json!({"message": "the generation ended before its end"});
    let mut driver = driver.lock();
    let mut out = driver.out();
    let whole = driver.translation.fail(&error, &mut out);
    (out, whole, true)
}
