//! Stop strings, owned by the router. The decoders never see `stop` (they keep
//! `stop_token_ids`): an engine that matches stop strings itself holds back the
//! characters that could start one, and loses them if it dies then. The router
//! matches on the text it relays instead, as vLLM does (the stops in the order
//! given, the first found wins; `include_stop_str_in_output` keeps the stop),
//! holds back at most the longest stop string minus one character (none when
//! the stop is kept), and across a resume the held characters stay here.
//!
//! A chunk is edited before anything else reads it: its text is what the client
//! may have now, and the choice that stops gets `finish_reason: "stop"` and the
//! stop string as `stop_reason`. Chunks of a stopped choice are dropped; when
//! every choice stopped, the relay ends the decoder's stream (which aborts it).

use super::client_body::ClientBody;
use serde_json::{json, Map, Value};

/// The stop strings of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStrings {
    pub stops: Vec<String>,
    /// `include_stop_str_in_output`.
    pub include: bool,
    /// Characters of text that could be the start of a stop string (the
    /// longest stop minus one), computed once.
    reach: usize,
}

impl StopStrings {
    /// The request's stop strings, when it has any the router can own (a
    /// string or a list of strings; anything else is left to the engine).
    pub fn of(body: &ClientBody) -> Option<Self> {
        let stops: Vec<String> = match body.get("stop")? {
            Value::String(stop) => vec![stop.clone()],
            Value::Array(items) => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<_>>()?,
            _ => return None,
        };
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        if stops.is_empty() {
            return None;
        }
        let include = body
            .get("include_stop_str_in_output")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let reach = stops.iter().map(|s| s.chars().count()).max().unwrap_or(1) - 1;
        Some(Self {
            stops,
            include,
            reach,
        })
    }

    /// The first stop string (in the order given) found in `buffer`, with the
    /// byte offset where it starts: what an engine finds in one token's text.
    fn first_in<'s>(&'s self, buffer: &str) -> Option<(usize, &'s str)> {
        self.stops
            .iter()
            .find_map(|stop| buffer.find(stop.as_str()).map(|at| (at, stop.as_str())))
    }

    /// The stop string found in `buffer` that ends first (in the order given
    /// among those that end together), with the byte offset where it starts:
    /// in the text of several tokens, an engine checking each token stops at
    /// the earliest token that completes any stop.
    fn earliest_in<'s>(&'s self, buffer: &str) -> Option<(usize, &'s str)> {
        self.stops
            .iter()
            .filter_map(|stop| buffer.find(stop.as_str()).map(|at| (at, stop.as_str())))
            .min_by_key(|(at, stop)| at + stop.len())
    }

    /// Characters of text that could be the start of a stop string.
    fn reach(&self) -> usize {
        self.reach
    }

    /// Characters held back: what could be the start of a stop string, unless
    /// the stop is kept in the output anyway.
    fn holdback(&self) -> usize {
        if self.include {
            0
        } else {
            self.reach()
        }
    }
}

/// One choice's matching state.
#[derive(Debug, Default, Clone)]
struct StopMatch {
    /// The end of the text already emitted, as long as a stop string could
    /// start in it (when the stop is kept, nothing is held back, yet a stop
    /// may begin in text the client has).
    tail: String,
    held: String,
    stopped: bool,
}

/// The matching of one request, across every decoder that serves it.
#[derive(Debug)]
pub struct Matcher {
    strings: StopStrings,
    choices: Vec<StopMatch>,
}

/// What feeding text gave.
#[derive(Debug, PartialEq, Eq)]
struct Fed {
    /// Text the client may have now.
    emit: String,
    /// The stop string that ended the choice, if one did.
    stopped: Option<String>,
}

impl Matcher {
    pub fn new(strings: StopStrings, choices: usize) -> Self {
        Self {
            strings,
            choices: vec![StopMatch::default(); choices.max(1)],
        }
    }

    /// Characters of choice `index`'s text held back now.
    pub fn held_chars(&self, index: usize) -> usize {
        self.choices
            .get(index)
            .map_or(0, |c| c.held.chars().count())
    }

    /// Whether every choice stopped on a stop string.
    #[cfg(test)]
    pub fn all_stopped(&self) -> bool {
        self.choices.iter().all(|c| c.stopped)
    }

    /// Feeds choice `index` new text.
    fn feed(&mut self, index: usize, text: &str) -> Fed {
        let holdback = self.strings.holdback();
        let Some(state) = self.choices.get_mut(index) else {
            return Fed {
                emit: text.to_string(),
                stopped: None,
            };
        };
        let base = state.tail.len();
        let buffer = std::mem::take(&mut state.tail) + &std::mem::take(&mut state.held) + text;
        if let Some((at, stop)) = self.strings.first_in(&buffer) {
            state.stopped = true;
            let end = if self.strings.include {
                at + stop.len()
            } else {
                at
            };
            return Fed {
                emit: buffer
                    .get(base..end.max(base))
                    .unwrap_or_default()
                    .to_string(),
                stopped: Some(stop.to_string()),
            };
        }
        let keep_from = char_boundary_from_end(&buffer, holdback).max(base);
        state.held = buffer[keep_from..].to_string();
        let tail_from = char_boundary_from_end(&buffer[..keep_from], self.strings.reach());
        state.tail = buffer[tail_from..keep_from].to_string();
        Fed {
            emit: buffer[base..keep_from].to_string(),
            stopped: None,
        }
    }

    /// When the new `text` of several tokens would end choice `index` on a
    /// stop string: how many characters of `text` the stop that ends first
    /// takes to complete (the text after them is never the client's). Feeds
    /// nothing.
    pub fn stop_end(&self, index: usize, text: &str) -> Option<usize> {
        let state = self.choices.get(index).filter(|c| !c.stopped)?;
        let base = state.tail.len() + state.held.len();
        let buffer = format!("{}{}{text}", state.tail, state.held);
        let (at, stop) = self.strings.earliest_in(&buffer)?;
        let end = (at + stop.len()).saturating_sub(base).min(text.len());
        Some(text.get(..end).map_or(0, |t| t.chars().count()))
    }

    /// Choice `index`'s held text, at its end.
    fn flush(&mut self, index: usize) -> String {
        self.choices
            .get_mut(index)
            .map(|c| std::mem::take(&mut c.held))
            .unwrap_or_default()
    }

    /// The chunk as the client may have it (see the module comment); `None`
    /// when it is not JSON (the relay's checks refused it already).
    pub fn edit(&mut self, data: &[u8]) -> Option<Vec<u8>> {
        let mut chunk: Value = serde_json::from_slice(data).ok()?;
        let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) else {
            return Some(data.to_vec());
        };
        let mut kept = Vec::with_capacity(choices.len());
        for mut choice in std::mem::take(choices) {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            if self.choices.get(index).is_some_and(|c| c.stopped) {
                continue;
            }
            if let Some(map) = choice.as_object_mut() {
                self.edit_choice(index, map);
            }
            kept.push(choice);
        }
        *choices = kept;
        serde_json::to_vec(&chunk).ok()
    }

    fn edit_choice(&mut self, index: usize, choice: &mut Map<String, Value>) {
        let chat = choice.contains_key("delta");
        let text = if chat {
            choice.get("delta").and_then(|d| d.get("content"))
        } else {
            choice.get("text")
        }
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
        let finished = choice.get("finish_reason").is_some_and(|r| !r.is_null());
        let fed = self.feed(index, &text);
        let mut emit = fed.emit;
        if let Some(stop) = fed.stopped {
            choice.insert("finish_reason".into(), json!("stop"));
            choice.insert("stop_reason".into(), json!(stop));
        } else if finished {
            // The decoder ended the choice (length, a stop token): what was held
            // cannot start a stop string any more.
            emit.push_str(&self.flush(index));
        }
        let had_text = !text.is_empty() || !emit.is_empty();
        if chat {
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                if had_text || delta.contains_key("content") {
                    delta.insert("content".into(), json!(emit));
                }
            }
        } else {
            choice.insert("text".into(), json!(emit));
        }
    }
}

/// The byte offset where the last `chars` characters of `text` start.
fn char_boundary_from_end(text: &str, chars: usize) -> usize {
    if chars == 0 {
        return text.len();
    }
    text.char_indices()
        .rev()
        .nth(chars - 1)
        .map_or(0, |(at, _)| at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str], include: bool) -> Matcher {
        let strings = StopStrings::of(&ClientBody::of(json!({
            "stop": stops,
            "include_stop_str_in_output": include,
        })))
        .expect("stops");
        Matcher::new(strings, 1)
    }

    fn text_of(chunk: &[u8]) -> (String, Value, Value) {
        let value: Value = serde_json::from_slice(chunk).expect("JSON");
        let choice = &value["choices"][0];
        (
            choice["text"].as_str().unwrap_or_default().to_string(),
            choice["finish_reason"].clone(),
            choice["stop_reason"].clone(),
        )
    }

    fn chunk(text: &str) -> Vec<u8> {
        json!({"id":"x","choices":[{"index":0,"text":text,"finish_reason":null}]})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn holds_back_a_possible_start_and_stops_across_chunks() {
        let mut m = matcher(&["END"], false);
        let (text, ..) = text_of(&m.edit(&chunk("abc E")).expect("edited"));
        assert_eq!(text, "abc", "' E' could start END");
        let (text, finish, stop) = text_of(&m.edit(&chunk("ND tail")).expect("edited"));
        assert_eq!(text, " ");
        assert_eq!(finish, "stop");
        assert_eq!(stop, "END");
        assert!(m.all_stopped());
        // Later chunks of the stopped choice are dropped.
        let after: Value =
            serde_json::from_slice(&m.edit(&chunk("more")).expect("edited")).expect("JSON");
        assert_eq!(after["choices"], json!([]));
    }

    #[test]
    fn a_kept_stop_may_start_in_text_already_emitted() {
        let mut m = matcher(&["ab"], true);
        let (text, ..) = text_of(&m.edit(&chunk("xa")).expect("edited"));
        assert_eq!(text, "xa", "nothing held back when the stop is kept");
        let (text, finish, _) = text_of(&m.edit(&chunk("bz")).expect("edited"));
        assert_eq!((text.as_str(), finish), ("b", json!("stop")));
    }

    #[test]
    fn the_first_stop_listed_wins_and_include_keeps_it() {
        let mut m = matcher(&["b", "a"], true);
        let (text, _, stop) = text_of(&m.edit(&chunk("xaxb")).expect("edited"));
        assert_eq!((text.as_str(), stop), ("xaxb", json!("b")));
    }

    #[test]
    fn a_decoder_finish_flushes_what_was_held() {
        let mut m = matcher(&["STOP"], false);
        let (text, ..) = text_of(&m.edit(&chunk("hello ST")).expect("edited"));
        assert_eq!(text, "hello");
        let last = json!({"choices":[{"index":0,"text":"!","finish_reason":"length"}]}).to_string();
        let (text, finish, _) = text_of(&m.edit(last.as_bytes()).expect("edited"));
        assert_eq!((text.as_str(), finish), (" ST!", json!("length")));
    }

    #[test]
    fn stop_end_counts_the_new_text_a_stop_takes() {
        let mut m = matcher(&["é!", "zz"], false);
        m.edit(&chunk("abc é")).expect("edited");
        assert_eq!(m.held_chars(0), 1, "'é' could start 'é!'");
        // The held 'é' and the new '!' complete the first stop: one character.
        assert_eq!(m.stop_end(0, "!ab"), Some(1));
        assert_eq!(m.stop_end(0, "xyzz q"), Some(4));
        assert_eq!(m.stop_end(0, "zz!"), Some(2), "the stop that ends first");
        assert_eq!(m.stop_end(0, "nothing"), None);
        // Nothing was fed: the same text still stops the choice.
        let (text, finish, _) = text_of(&m.edit(&chunk("!ab")).expect("edited"));
        assert_eq!((text.as_str(), finish), ("", json!("stop")));
        assert_eq!(m.stop_end(0, "zz"), None, "a stopped choice takes nothing");
    }

    #[test]
    fn only_strings_are_owned() {
        assert!(StopStrings::of(&ClientBody::of(json!({"stop": 5}))).is_none());
        assert!(StopStrings::of(&ClientBody::of(json!({"stop": ""}))).is_none());
        assert_eq!(
            StopStrings::of(&ClientBody::of(
                json!({"stop": ["a", "bc"], "include_stop_str_in_output": true})
            )),
            Some(StopStrings {
                stops: vec!["a".into(), "bc".into()],
                include: true,
                reach: 1,
            })
        );
    }
}
