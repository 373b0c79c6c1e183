//! What the engines get of a caller's tenant in the chat body they are sent,
//! whatever the client wrote there.

use super::Caller;
use crate::error::ApiError;
use crate::protocols::openai::client_body::ClientBody;

/// What the engines get of the caller's tenant, whatever the client sent:
/// its `priority` (the client's own only at or after its tenant's) and its
/// `cache_salt` (the tenant's KV isolation, with the client's own under it).
pub fn set_engine_fields(caller: &Caller, body: &mut ClientBody) -> Result<(), ApiError> {
    // A large array or object is held raw (never a valid value of either).
    for key in ["priority", "cache_salt"] {
        if body.raw(key).is_some() {
            return Err(ApiError::bad_request(format!("`{key}` is not valid"), None));
        }
    }
    if let Some(priority) = caller.priority_for(body.get("priority"))? {
        body.set("priority", priority.into());
    }
    if let Some(salt) = caller.cache_salt_for(body.get("cache_salt"))? {
        body.set("cache_salt", salt.into());
    }
    Ok(())
}
