//! Phase 3: re-prefill. Before a resume relies on its hold, the router checks
//! that the hold is still there; when it is not (released, expired, evicted, or
//! its holder gone) it prefills prompt + generated again on a healthy prefill
//! instance (`--on-hold-lost reprefill`), or fails the request (`fail`).

use super::deps::FlowDeps;
use super::prefill::{self, Prefilled};
use crate::config::OnHoldLost;
use crate::error::ApiError;
use crate::journal::{JournalHandle, Phase};
use crate::pd::holds::{Hold, HoldState};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::RequestInfo;

/// A new hold from a re-prefill, or `None` when the current one still holds
/// (or the connector has no holds to check).
pub async fn ensure_hold(
    deps: &FlowDeps,
    info: &RequestInfo,
    body: &ClientBody,
    hold: Option<&Hold>,
    journal: &JournalHandle,
) -> Result<Option<Prefilled>, ApiError> {
    let Some(hold) = hold else {
        return Ok(None);
    };
    let HoldState::Lost(reason) = deps.holds.check(hold).await else {
        return Ok(None);
    };
    tracing::warn!(%reason, "hold lost");
    if deps.resume.on_hold_lost == OnHoldLost::Fail {
        return Err(ApiError::Unavailable(format!(
            "{reason}; not prefilling again (--on-hold-lost fail)"
        )));
    }
    crate::observe::metrics::reprefill();
    journal.set_phase(Phase::Reprefill);
    // The whole context so far becomes the new hold's prompt.
    let (route, payload, context) = journal.read(|e| {
        let (route, payload) = prefill::continuation_body(
            info.route,
            body,
            &e.prompt_token_ids,
            &e.choices[0].token_ids,
        );
        // What the new prefill computes: prompt and generated tokens.
        let context = deps.prefill.wants_prompt().then(|| {
            let mut ids = e.prompt_token_ids.clone();
            ids.extend_from_slice(&e.choices[0].token_ids);
            ids
        });
        (route, payload, context)
    });
    let prefilled = prefill::run(deps, info, route, payload, context.as_deref()).await?;
    journal.update(|e| {
        e.prefill = Some(prefilled.instance.clone());
        e.kv_transfer_params = Some(prefilled.kv_transfer_params.clone());
        e.phase = Phase::Decode;
    });
    Ok(Some(prefilled))
}
