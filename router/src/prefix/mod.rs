//! Which prompt prefixes each engine holds in its KV cache, from the KV events
//! it reports (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, forwarded
//! by its agent), so that a prompt goes where its prefix is already computed.
//!
//! The index is keyed by the router's own hash of the token chain
//! ([`hash::chain`]), computed from the token ids each BlockStored carries:
//! whatever hash algorithm and seed the engine uses (vLLM's sha256 over pickle,
//! its PYTHONHASHSEED-derived NONE_HASH), the router never has to reproduce it.
//! The engine's own hashes serve only to apply BlockRemoved and to find where
//! a stored block's parent sits in the chain.

pub mod events;
pub mod hash;
pub mod index;

pub use events::KvEventBatch;
pub use index::{BlockBudget, BlockIndex};
