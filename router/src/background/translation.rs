//! A client protocol's translation of a chat, as the relay drives it: the
//! `Translation` each translated protocol implements (its events from the
//! chat's chunks, its whole answer), and the driver that writes those events
//! where they go (`Sink`): a streaming client, nowhere (a non-stream client
//! gets the whole answer), or a background response's log. The translated
//! routes (`edge/routes/translated.rs`) and the background generations
//! (`run.rs`, `takeover.rs`) share it.

use crate::error::ApiError;
use crate::protocols::event::Out;
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::openai::translator::Translator;
use crate::store::live::Live;
use crate::store::stored::Stored;
use axum::response::Response;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, MutexGuard};

/// A protocol's side of one request: its events from the chat's chunks,
/// written to `out` (where they go: `Out`'s kinds).
pub trait Translation: Send + 'static {
    /// The events before the first chunk.
    fn start(&mut self, out: &mut Out);
    /// The events of one chat chunk.
    fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut Out);
    /// The last events of a chat that ended (`usage`: the router's count);
    /// returns the whole answer (as its JSON: written once, for the client,
    /// the store and a background response's readers alike).
    fn finish(&mut self, usage: Value, out: &mut Out) -> Box<RawValue>;
    /// The last events of a chat that failed (`error`: an OpenAI error
    /// object); returns the whole answer as it stands.
    fn fail(&mut self, error: &Value, out: &mut Out) -> Box<RawValue>;
    /// The non-stream answer from the whole answer `finish` or `fail` made.
    fn answer(&self, whole: Box<RawValue>, failed: bool) -> Response;
    /// The last events of a generation cancelled by its client; returns the
    /// whole answer as it stands (background responses only).
    fn cancel(&mut self, out: &mut Out) -> Box<RawValue> {
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

/// Where a translation's events go.
pub enum Sink {
    /// A streaming client's stream.
    Client,
    /// Nowhere: a non-stream client gets the whole answer.
    Whole,
    /// A background response's log (its last events and checkpoints are
    /// written by `run.rs`).
    Live(Arc<Live>),
}

/// A translation as the relay drives it.
pub struct Driver<T> {
    pub(crate) translation: T,
    sink: Sink,
    /// Whether its first events were made (a generation taken over from
    /// another replica had them there).
    started: bool,
    /// The last events and the whole answer of the chat's end, until they go
    /// out (after what the translation keeps), and whether it failed.
    ending: Option<(Out, Box<RawValue>, bool)>,
    /// Whether its last events were made (by the chat's end or a cut).
    ended: bool,
}

impl<T: Translation> Driver<T> {
    /// Where the next events are written, for the sink.
    pub(crate) fn out(&self) -> Out {
        match &self.sink {
            Sink::Client => Out::Frames(Vec::new()),
            Sink::Whole => Out::Nowhere,
            Sink::Live(_) => Out::Events(Vec::new()),
        }
    }

    /// What the translation keeps as it ends: with a shared store, a
    /// background response's writer stores it under its lease (nothing to
    /// wait for here: readers get the last events once it is stored).
    pub(crate) fn keeping(&mut self) -> Option<BoxFuture<'static, ()>> {
        if let Sink::Live(live) = &self.sink {
            if live.is_shared() {
                if let Some(stored) = self.translation.take_kept() {
                    live.keep(stored);
                }
                return None;
            }
        }
        self.translation.keep()
    }

    /// The events written to `out` to the sink; a streaming client's bytes.
    fn send(&self, out: Out) -> Option<Bytes> {
        match (&self.sink, out) {
            (Sink::Client, Out::Frames(frames)) if !frames.is_empty() => Some(frames.into()),
            (Sink::Live(live), Out::Events(events)) if !events.is_empty() => {
                live.push(events, None);
                None
            }
            _ => None,
        }
    }
}

/// A driver shared by the relay, which feeds it, and the route, which
/// answers from it (a whole answer, a background response's checkpoints).
pub struct Shared<T>(Arc<Mutex<Driver<T>>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Translation> Shared<T> {
    pub fn new(translation: T, sink: Sink, started: bool) -> Self {
        Self(Arc::new(Mutex::new(Driver {
            translation,
            sink,
            started,
            ending: None,
            ended: false,
        })))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Driver<T>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The chat's end, once it came: its last events, the whole answer and
    /// whether it failed (taken: they go out once).
    pub(crate) fn take_ending(&self) -> Option<(Out, Box<RawValue>, bool)> {
        self.lock().ending.take()
    }

    /// The relay's handle on it.
    pub fn translator(&self) -> Box<dyn Translator> {
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

impl<T: Translation> Translator for Shared<T> {
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
        if !matches!(driver.sink, Sink::Client) {
            return None;
        }
        let (out, _, _) = driver.ending.take()?;
        driver.send(out)
    }
}

/// The end of a chat whose session ended without one (it always makes one:
/// its last events or its error's).
pub(crate) fn no_ending<T: Translation>(driver: &Shared<T>) -> (Out, Box<RawValue>, bool) {
    let error = json!({"message": "the generation ended before its end"});
    let mut driver = driver.lock();
    let mut out = driver.out();
    let whole = driver.translation.fail(&error, &mut out);
    (out, whole, true)
}
