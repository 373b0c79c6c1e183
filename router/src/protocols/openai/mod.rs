//! OpenAI's chat and completions wire formats, as the phases (`pd/`) read and
//! write them: the client's body kept as it came (`client_body.rs`) and the
//! edits each phase sends of it (`patch.rs`), the request's checks
//! (`request.rs`), the router's stop strings (`stops.rs`), an engine chunk's
//! fast checks and edits (`chunk.rs`), and what the client gets: each chunk
//! with the router's id, or one answer assembled from them (`output.rs`,
//! `assemble.rs`), or handed to another client protocol
//! (`translated_output.rs`: the `TranslatedOutput` the relay feeds each
//! parsed chat chunk).

pub mod assemble;
pub mod chunk;
pub mod client_body;
pub mod output;
pub mod patch;
pub mod request;
pub mod stops;
pub mod translated_output;
