//! The prefill -> decode flow, as named phases:
//!
//! 1. `prefill`: get the KV hold and the prompt ids from a prefill instance;
//! 2. `decode`: open a decoder's stream (an `attempt`);
//! 3. `relay`: check, journal and relay its tokens through the client's `output`;
//! 4. on a decoder failure, `resume::decide` picks the next step, `reprefill`
//!    replaces a lost hold, and the `session` (which drives 2-4) continues on
//!    another decoder.
//!
//! Engines are reached through the [`upstream::Upstream`] seam, so that every
//! phase is tested against scripted engines as well as real processes.

pub mod attempt;
pub mod checkpoint;
pub mod decode;
pub mod deps;
pub mod derender;
pub mod failure;
pub mod holds;
pub mod merged;
pub mod prefill;
pub mod record;
pub mod relay;
pub mod reprefill;
pub mod resume;
pub mod session;
#[cfg(test)]
mod session_tests;
pub mod tokenizer;
pub mod tokens;
pub mod upstream;

use crate::error::ApiError;
use crate::journal::{EntryReader, JournalHandle};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::RequestInfo;
use crate::protocols::openai::translated_output::TranslatedOutput;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use deps::FlowDeps;
use record::RequestRecord;
use session::Session;
use std::sync::Arc;

/// Runs one validated request through P/D and returns the client's response.
/// `record` records how the request ended, however it ends.
pub async fn run(
    deps: Arc<FlowDeps>,
    info: RequestInfo,
    body: ClientBody,
    record: RequestRecord,
) -> Result<Response, ApiError> {
    run_observed(deps, info, body, record, None)
        .await
        .map(|(response, _)| response)
}

/// [`run`], with a reader of the request's journal entry (what a background
/// response checkpoints, `checkpoint.rs`); the client's stream is
/// `translated`'s when there is one (a protocol run as a chat).
pub async fn run_observed(
    deps: Arc<FlowDeps>,
    info: RequestInfo,
    body: ClientBody,
    mut record: RequestRecord,
    translated: Option<Box<dyn TranslatedOutput>>,
) -> Result<(Response, EntryReader), ApiError> {
    let started = start(deps, info, body, &mut record, translated).await;
    respond(started, record).await
}

/// Continues a request that another router replica started, from its
/// `checkpoint`: as a decoder-failure resume does (the next attempt pulls the
/// prompt's KV from the hold and generates after the checkpoint's tokens).
pub async fn continue_from(
    deps: Arc<FlowDeps>,
    info: RequestInfo,
    body: ClientBody,
    checkpoint: checkpoint::DecodeCheckpoint,
    mut record: RequestRecord,
    translated: Option<Box<dyn TranslatedOutput>>,
) -> Result<(Response, EntryReader), ApiError> {
    let checkpoint::DecodeCheckpoint {
        prefill,
        kv_transfer_params,
        prompt_token_ids,
        epoch,
        choice,
    } = checkpoint;
    let hold = CheckpointHold {
        prefill,
        kv_transfer_params,
        prompt_token_ids,
        epoch,
    };
    let prefilled = match checked_hold(&deps, hold) {
        Ok(prefilled) => prefilled,
        Err(error) => {
            record.finish(error.status().as_u16());
            return Err(error);
        }
    };
    let journal = open_journal(&deps, &info, &mut record);
    journal.update(|e| e.choices = vec![choice.into()]);
    let started = Session::start(deps, info, body, prefilled, journal, translated).await;
    respond(started, record).await
}

/// The hold part of a checkpoint (its choice goes to the journal).
struct CheckpointHold {
    prefill: String,
    kv_transfer_params: serde_json::Value,
    prompt_token_ids: Vec<u32>,
    epoch: u64,
}

/// The hold a `checkpoint` read from the shared response store names, checked
/// as a prefill's own answer is (`prefill::check_params`): the store is
/// input, and the decoder pulls from whatever `remote_ctrl` these params
/// name, so they must be those of a prefill this router knows, naming its
/// registered control address. The prefill is the one of the checkpoint's
/// id, or (replicas that name their instances apart, static ones without a
/// shared registry) the one whose registered control address the params
/// name. The attempt goes on in a new epoch (the hold
/// is this replica's now: the dead one's decoder can no longer pull or
/// release it), within the epochs a prefill's answer may carry.
fn checked_hold(
    deps: &FlowDeps,
    checkpoint: CheckpointHold,
) -> Result<prefill::Prefilled, ApiError> {
    let refused = |why: String| {
        tracing::warn!(prefill = %checkpoint.prefill, %why, "a checkpoint from the response store refused");
        ApiError::Unavailable(format!("the stored checkpoint cannot be continued: {why}"))
    };
    let is_prefill =
        |i: &Arc<crate::membership::Instance>| i.role.serves(crate::membership::Pick::Prefill);
    let ctrl = checkpoint.kv_transfer_params["remote_ctrl"].as_str();
    let instance = deps
        .registry
        .get(&checkpoint.prefill)
        .filter(is_prefill)
        .or_else(|| {
            let ctrl = ctrl?;
            deps.registry
                .list()
                .into_iter()
                .find(|i| is_prefill(i) && i.ctrl.as_deref() == Some(ctrl))
        })
        .ok_or_else(|| refused(format!("unknown prefill `{}`", checkpoint.prefill)))?;
    if !checkpoint.kv_transfer_params.is_object() {
        return Err(refused("kv_transfer_params is not an object".into()));
    }
    prefill::check_params(&checkpoint.kv_transfer_params, &instance)
        .map_err(|err| refused(err.to_string()))?;
    if checkpoint.prompt_token_ids.is_empty() {
        return Err(refused("no prompt_token_ids".into()));
    }
    let epoch = checkpoint
        .epoch
        .checked_add(1)
        .filter(|e| *e <= prefill::MAX_RESUME_EPOCH)
        .ok_or_else(|| refused(format!("epoch {} is out of range", checkpoint.epoch)))?;
    Ok(prefill::Prefilled {
        instance: instance.id.clone(),
        kv_transfer_params: resume::with_epoch(&checkpoint.kv_transfer_params, epoch),
        prompt_token_ids: checkpoint.prompt_token_ids,
        prompt_logprobs: None,
    })
}

/// The request's journal entry, given to its record.
fn open_journal(deps: &FlowDeps, info: &RequestInfo, record: &mut RequestRecord) -> JournalHandle {
    record.set_model(&info.model);
    let journal = deps.journal.open_at(
        &info.request_id,
        info.route.path(),
        &info.model,
        info.stream,
        usize::try_from(info.n).unwrap_or(1),
        record.started(),
    );
    record.set_entry(journal.reader());
    journal
}

/// The client's response of a started session (a session that could not
/// start: the error, recorded).
async fn respond(
    started: Result<Session, ApiError>,
    mut record: RequestRecord,
) -> Result<(Response, EntryReader), ApiError> {
    let mut session = match started {
        Ok(session) => session,
        Err(error) => {
            record.finish(error.status().as_u16());
            return Err(error);
        }
    };
    let reader = session.journal_reader();
    session.set_record(record);
    let served = ServedBy {
        prefill: session.prefill_instance(),
        decoder: session.first_decoder().to_string(),
    };
    let (mut response, resumes) = if session.info().stream {
        (session.into_sse_response(), None)
    } else {
        // The session records its own end (status) in its record.
        let (response, resumes) = session.collect().await?;
        (axum::Json(response).into_response(), Some(resumes))
    };
    served.add_headers(response.headers_mut(), resumes);
    Ok((response, reader))
}

/// Prefill, then the first decoder.
async fn start(
    deps: Arc<FlowDeps>,
    info: RequestInfo,
    body: ClientBody,
    record: &mut RequestRecord,
    translated: Option<Box<dyn TranslatedOutput>>,
) -> Result<Session, ApiError> {
    if !deps.registry.knows_model(&info.model) {
        return Err(ApiError::ModelNotFound(info.model.clone()));
    }
    let journal = open_journal(&deps, &info, record);
    let payload = prefill::prefill_body(info.route, &body);
    let prompt = if deps.prefill.wants_prompt() {
        let engines = deps
            .registry
            .eligible(&info.model, crate::membership::Pick::Prefill);
        tokens::prompt_ids(&deps, info.route, &body, &engines).await
    } else {
        None
    };
    let prefilled = prefill::run(&deps, &info, info.route, payload, prompt.as_deref()).await?;
    Session::start(deps, info, body, prefilled, journal, translated).await
}

/// Who served a request.
struct ServedBy {
    prefill: String,
    decoder: String,
}

impl ServedBy {
    /// The response headers the flow adds, in one place: the instances that
    /// served it (for operators and the demo) and, for a non-stream response,
    /// the resumes it needed. (The client's `x-request-id` is the edge's:
    /// `edge/routes/prologue.rs`.)
    fn add_headers(&self, headers: &mut HeaderMap, resumes: Option<u32>) {
        for (name, value) in [
            (PREFILL_HEADER, &self.prefill),
            (DECODER_HEADER, &self.decoder),
        ] {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        }
        if let Some(resumes) = resumes {
            headers.insert(RESUMES_HEADER, resumes.into());
        }
    }
}

/// Response header naming the prefill instance that served a request.
pub const PREFILL_HEADER: &str = "x-connex-prefill";
/// Response header naming the (first) decode instance that served a request.
pub const DECODER_HEADER: &str = "x-connex-decoder";
/// Response header (non-stream) counting the resumes a request needed.
pub const RESUMES_HEADER: &str = "x-connex-resumes";
