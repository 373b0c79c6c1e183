//! What a generation's tokens become in an answer besides plain text, when the
//! request asks for it: logprobs (`logprobs`/`top_logprobs`), the echoed prompt
//! (`echo`), reasoning (`reasoning_effort`: the first half of the tokens are
//! reasoning) and tool calls (`tools`: the tokens are the arguments of one call
//! per tool, up to two, taking turns). An engine started with
//! `--eos-after-tokens N` answers like a model: its answers end at an
//! end-of-sequence token, the Nth, with `stop` (`tool_calls` once a chat
//! called a tool), and a chat whose last message is a tool's result is
//! answered in text; so an agent's loop (call, result, answer) ends.
//!
//! The stream and the non-stream answer are built here independently, each the
//! way vLLM builds it: the non-stream answer is what a router that assembles a
//! stream must reproduce, so it is never derived from the stream.

use crate::model;
use serde_json::{json, Map, Value};

/// Most tool calls one answer makes.
const MAX_TOOL_CALLS: usize = 2;

/// Where one generated token goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Reasoning,
    Content,
    /// The arguments of tool call `n`.
    Tool(usize),
    /// The end-of-sequence token (`--eos-after-tokens`): no text.
    End,
}

/// The shape of one request's answers.
#[derive(Debug, Clone, Default)]
pub struct Shape {
    chat: bool,
    /// Alternatives per token, when logprobs were asked for.
    logprobs: Option<usize>,
    /// Completions `echo`: the prompt's text and ids.
    echo: Option<(String, Vec<u32>)>,
    /// Whether the echo includes the prompt's text (see [`Shape::new`]).
    echo_text: bool,
    /// The function names called, in call order.
    tools: Vec<String>,
    reasoning_tokens: usize,
    /// The tokens that carry text: `max_tokens`, or those before the
    /// end-of-sequence token when it comes first.
    max_tokens: usize,
    /// The index of the end-of-sequence token, when the answer has one.
    end: Option<usize>,
    /// Stop strings (non-stream answers only: a router owns them for streams)
    /// and `include_stop_str_in_output`.
    stops: Vec<String>,
    include_stop: bool,
}

impl Shape {
    /// The shape of an answer of `max_tokens` to `request`; `eos`: the
    /// engine's `--eos-after-tokens` (the answer ends at that token).
    pub fn new(
        chat: bool,
        request: &Value,
        prompt_ids: &[u32],
        max_tokens: u32,
        eos: Option<u32>,
    ) -> Self {
        let end = eos
            .map(|n| n.max(1) as usize - 1)
            .filter(|&end| end < max_tokens as usize);
        let max_tokens = end.unwrap_or(max_tokens as usize);
        let logprobs = if chat {
            (request.get("logprobs").and_then(Value::as_bool) == Some(true)).then(|| {
                request
                    .get("top_logprobs")
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize
            })
        } else {
            request
                .get("logprobs")
                .and_then(Value::as_u64)
                .map(|k| k as usize)
        };
        let echo =
            (!chat && request.get("echo").and_then(Value::as_bool) == Some(true)).then(|| {
                let text = match request.get("prompt") {
                    Some(Value::String(text)) => text.clone(),
                    _ => model::detokenize(prompt_ids),
                };
                (text, prompt_ids.to_vec())
            });
        // vLLM (0.32) echoes no prompt text, only its ids and logprobs, to a
        // request that asks for token ids.
        let echo_text = echo.is_some()
            && request.get("return_token_ids").and_then(Value::as_bool) != Some(true);
        let tool_choice_none = request.get("tool_choice").and_then(Value::as_str) == Some("none");
        // A model that ends (`--eos-after-tokens`) answers a tool's result in
        // text: the loop of an agent ends.
        let answers_result = eos.is_some()
            && request
                .get("messages")
                .and_then(Value::as_array)
                .and_then(|messages| messages.last())
                .and_then(|last| last.get("role"))
                .and_then(Value::as_str)
                == Some("tool");
        let tools = if chat && !tool_choice_none && !answers_result {
            request
                .get("tools")
                .and_then(Value::as_array)
                .map(|tools| {
                    tools
                        .iter()
                        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
                        .take(MAX_TOOL_CALLS)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let reasoning = chat
            && request
                .get("reasoning_effort")
                .is_some_and(Value::is_string);
        Self {
            chat,
            logprobs,
            echo,
            echo_text,
            tools,
            reasoning_tokens: if reasoning { max_tokens / 2 } else { 0 },
            max_tokens,
            end,
            stops: match request.get("stop") {
                Some(Value::String(stop)) => vec![stop.clone()],
                Some(Value::Array(items)) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect(),
                _ => Vec::new(),
            }
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect(),
            include_stop: request
                .get("include_stop_str_in_output")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }
    }

    /// The stop string the content of `tokens` contains (the first listed
    /// that occurs, as vLLM checks) and where the content ends for it.
    pub fn stop_in(&self, tokens: &[u32]) -> Option<(String, usize)> {
        let content: Vec<u32> = (0..tokens.len())
            .filter(|&i| self.part(i) == Part::Content)
            .map(|i| tokens[i])
            .collect();
        let text = model::detokenize(&content);
        self.stops.iter().find_map(|stop| {
            text.find(stop.as_str()).map(|at| {
                let end = if self.include_stop {
                    at + stop.len()
                } else {
                    at
                };
                (stop.clone(), end)
            })
        })
    }

    /// `choice` (a whole one) with its content cut at `end` bytes.
    pub fn cut(&self, choice: &mut Value, end: usize) {
        let prefix = self.echo.as_ref().map_or(0, |(p, _)| p.len());
        let field = if self.chat {
            choice.pointer_mut("/message/content")
        } else {
            choice.get_mut("text")
        };
        if let Some(Value::String(text)) = field {
            text.truncate(prefix + end);
        }
    }

    /// Where generated token `i` goes.
    pub fn part(&self, i: usize) -> Part {
        if self.end == Some(i) {
            Part::End
        } else if i < self.reasoning_tokens {
            Part::Reasoning
        } else if self.tools.is_empty() {
            Part::Content
        } else {
            Part::Tool((i - self.reasoning_tokens) % self.tools.len())
        }
    }

    /// Whether plain text goes out as it comes (the only case where a split
    /// token's text is held back).
    pub fn is_plain(&self) -> bool {
        self.logprobs.is_none() && self.echo.is_none() && self.tools.is_empty()
    }

    /// Why an answer of `generated` tokens ended: at `max_tokens`, `length`,
    /// tool calls or not (vLLM turns only a `stop` into `tool_calls`; an
    /// answer cut by `max_tokens` inside or after its calls stays `length`);
    /// at its end-of-sequence token (`eos`), `stop`, or `tool_calls` for a
    /// chat that called a tool.
    pub fn finish_reason(&self, generated: usize, eos: bool) -> &'static str {
        let called = || (0..generated).any(|i| matches!(self.part(i), Part::Tool(_)));
        match eos {
            false => "length",
            true if self.chat && called() => "tool_calls",
            true => "stop",
        }
    }

    fn call_id(n: usize) -> String {
        format!("chatcmpl-tool-mock{n}")
    }

    /// The last token of call `n` among `generated` tokens.
    fn last_of_call(&self, n: usize, generated: usize) -> Option<usize> {
        (0..generated)
            .rev()
            .find(|&i| self.part(i) == Part::Tool(n))
    }

    /// The arguments piece token `i` of call `n` adds (a JSON object built
    /// from the tokens' text, split over them).
    fn arguments_piece(&self, i: usize, n: usize, token: u32, generated: usize) -> String {
        let first = (0..i).all(|j| self.part(j) != Part::Tool(n));
        let mut piece = String::new();
        if first {
            piece.push_str("{\"words\": \"");
        }
        piece.push_str(&model::token_text(token));
        if self.last_of_call(n, generated) == Some(i) {
            piece.push_str("\"}");
        }
        piece
    }

    /// The stream choice (without index, finish and token ids) for token `i`
    /// of `max` tokens, after the tokens `before`. `text` is the plain text
    /// this chunk carries (a split token's held back).
    pub fn stream_choice(&self, i: usize, token: u32, text: String, before: &[u32]) -> Value {
        let part = self.part(i);
        // The text offset costs a detokenize of all tokens so far: only
        // logprobs need it.
        let lp = self
            .logprobs
            .map(|k| self.token_logprobs(token, k, self.offset_of(before)));
        if !self.chat {
            let mut text = text;
            let mut logprobs = lp.map(|lp| completion_logprobs(&[lp]));
            if i == 0 {
                if let Some((prompt, ids)) = &self.echo {
                    if self.echo_text {
                        text = format!("{prompt}{text}");
                    }
                    if let Some(logprobs) = logprobs.as_mut() {
                        let mut all = echo_logprobs(ids);
                        merge_arrays(&mut all, logprobs);
                        *logprobs = all;
                    }
                }
            }
            return json!({"text": text, "logprobs": logprobs});
        }
        let mut delta = Map::new();
        if i == 0 {
            delta.insert("role".into(), json!("assistant"));
        }
        match part {
            Part::Reasoning => {
                delta.insert("reasoning".into(), json!(model::token_text(token)));
            }
            Part::Content => {
                delta.insert("content".into(), json!(text));
            }
            Part::End => {}
            Part::Tool(n) => {
                let arguments = self.arguments_piece(i, n, token, self.max_tokens);
                let first = (0..i).all(|j| self.part(j) != Part::Tool(n));
                let call = if first {
                    json!({"index": n, "id": Self::call_id(n), "type": "function",
                        "function": {"name": self.tools[n], "arguments": arguments}})
                } else {
                    json!({"index": n, "function": {"arguments": arguments}})
                };
                delta.insert("tool_calls".into(), json!([call]));
            }
        }
        let logprobs = lp.map(|lp| json!({"content": [chat_logprob(&lp)]}));
        json!({"delta": delta, "logprobs": logprobs})
    }

    /// The non-stream choice (without index, finish and token ids) for all of
    /// `tokens`.
    pub fn whole_choice(&self, tokens: &[u32]) -> Value {
        let generated = tokens.len();
        let mut offset = self.echo.as_ref().map_or(0, |(p, _)| p.chars().count());
        let lps: Option<Vec<TokenLogprob>> = self.logprobs.map(|k| {
            tokens
                .iter()
                .map(|&t| {
                    let lp = self.token_logprobs(t, k, offset);
                    offset += model::token_text(t).chars().count();
                    lp
                })
                .collect()
        });
        if !self.chat {
            let mut text = model::detokenize(tokens);
            let mut logprobs = lps.as_deref().map(completion_logprobs);
            if let Some((prompt, ids)) = &self.echo {
                if self.echo_text {
                    text = format!("{prompt}{text}");
                }
                if let Some(logprobs) = logprobs.as_mut() {
                    let mut all = echo_logprobs(ids);
                    merge_arrays(&mut all, logprobs);
                    *logprobs = all;
                }
            }
            return json!({"text": text, "logprobs": logprobs, "prompt_logprobs": null});
        }
        let pick = |part: Part| -> Option<String> {
            let ids: Vec<u32> = (0..generated)
                .filter(|&i| self.part(i) == part)
                .map(|i| tokens[i])
                .collect();
            (!ids.is_empty()).then(|| model::detokenize(&ids))
        };
        let mut message = json!({"role": "assistant", "content": pick(Part::Content),
            "refusal": null, "annotations": null, "audio": null, "function_call": null,
            "reasoning": pick(Part::Reasoning)});
        let calls: Vec<Value> = (0..self.tools.len())
            .filter(|&n| self.last_of_call(n, generated).is_some())
            .map(|n| {
                let arguments: String = (0..generated)
                    .filter(|&i| self.part(i) == Part::Tool(n))
                    .map(|i| self.arguments_piece(i, n, tokens[i], generated))
                    .collect();
                json!({"id": Self::call_id(n), "type": "function",
                    "function": {"name": self.tools[n], "arguments": arguments}})
            })
            .collect();
        if !calls.is_empty() {
            message["tool_calls"] = json!(calls);
        }
        let logprobs =
            lps.map(|lps| json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>()}));
        json!({"message": message, "logprobs": logprobs})
    }

    /// Text offset (in characters, as vLLM counts) after `tokens`: where
    /// the next token starts.
    pub fn offset_of(&self, tokens: &[u32]) -> usize {
        self.echo.as_ref().map_or(0, |(p, _)| p.chars().count())
            + model::detokenize(tokens).chars().count()
    }

    /// Token `token`'s logprobs with `k` alternatives (the token itself
    /// first; completions always list it).
    fn token_logprobs(&self, token: u32, k: usize, offset: usize) -> TokenLogprob {
        let alternatives = if self.chat { k } else { k.max(1) };
        TokenLogprob {
            text: model::token_text(token),
            logprob: Some(logprob(token)),
            top: Some(
                (0..alternatives as u32)
                    .map(|j| {
                        let alternative = token + j;
                        (
                            model::token_text(alternative),
                            logprob(token) - f64::from(j) * 0.5,
                        )
                    })
                    .collect(),
            ),
            offset,
        }
    }
}

/// The mock model's log-probability of a token: a pure function of it.
fn logprob(token: u32) -> f64 {
    -f64::from(token % 997) / 64.0
}

/// One token's logprobs.
struct TokenLogprob {
    text: String,
    /// `None` for the first echoed prompt token (nothing precedes it).
    logprob: Option<f64>,
    top: Option<Vec<(String, f64)>>,
    offset: usize,
}

/// Completions logprobs of `tokens`.
fn completion_logprobs(tokens: &[TokenLogprob]) -> Value {
    json!({
        "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.as_ref().map(|top| {
            top.iter().map(|(text, lp)| (text.clone(), json!(lp))).collect::<Map<_, _>>()
        })).collect::<Vec<_>>(),
    })
}

/// Completions logprobs of an echoed prompt.
fn echo_logprobs(ids: &[u32]) -> Value {
    let mut offset = 0;
    let tokens: Vec<TokenLogprob> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let text = model::token_text(id);
            let first = i == 0;
            let lp = TokenLogprob {
                logprob: (!first).then(|| logprob(id)),
                top: (!first).then(|| vec![(text.clone(), logprob(id))]),
                text: text.clone(),
                offset,
            };
            offset += text.chars().count();
            lp
        })
        .collect();
    completion_logprobs(&tokens)
}

/// Appends every array of `more` to the same array of `into`.
fn merge_arrays(into: &mut Value, more: &Value) {
    if let (Some(into), Some(more)) = (into.as_object_mut(), more.as_object()) {
        for (key, value) in more {
            if let (Some(Value::Array(to)), Some(from)) = (into.get_mut(key), value.as_array()) {
                to.extend(from.iter().cloned());
            }
        }
    }
}

/// A chat logprobs entry.
fn chat_logprob(lp: &TokenLogprob) -> Value {
    let entry = |text: &str, logprob: f64| json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()});
    let mut out = entry(&lp.text, lp.logprob.unwrap_or(-9999.0));
    out["top_logprobs"] = json!(lp
        .top
        .iter()
        .flatten()
        .map(|(t, l)| entry(t, *l))
        .collect::<Vec<_>>());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(messages: Value) -> Value {
        json!({"messages": messages, "reasoning_effort": "low",
               "tools": [{"type": "function", "function": {"name": "f"}}]})
    }

    #[test]
    fn a_model_that_ends_calls_its_tool_then_answers_the_result() {
        let asked = chat(json!([{"role": "user", "content": "hi"}]));
        let shape = Shape::new(true, &asked, &[], 32, Some(9));
        // Reasoning, the call's arguments, then the end-of-sequence token.
        let parts: Vec<Part> = (0..9).map(|i| shape.part(i)).collect();
        assert_eq!(parts[..4], [Part::Reasoning; 4]);
        assert_eq!(parts[4..8], [Part::Tool(0); 4]);
        assert_eq!(parts[8], Part::End);
        assert_eq!(shape.finish_reason(9, true), "tool_calls");
        let tokens = model::generate(&[1], 8);
        let whole = shape.whole_choice(&[tokens.as_slice(), &[model::EOS_ID]].concat());
        let arguments = whole
            .pointer("/message/tool_calls/0/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or_default();
        assert!(serde_json::from_str::<Value>(arguments).is_ok(), "{whole}");
        // The tool's result comes back: the answer is text.
        let result = chat(json!([{"role": "user", "content": "hi"},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}]));
        let shape = Shape::new(true, &result, &[], 32, Some(9));
        assert_eq!(shape.part(5), Part::Content);
        assert_eq!(shape.finish_reason(9, true), "stop");
        // Without --eos-after-tokens: calls until max_tokens, as before.
        let shape = Shape::new(true, &result, &[], 32, None);
        assert_eq!(shape.part(31), Part::Tool(0));
        assert_eq!(shape.finish_reason(32, false), "length");
    }
}
