//! `connex-transfer`: renewable KV holds and one-sided block reads between a
//! prefill engine (the holder) and a decoder (the reader).
//!
//! - [`Holder`]: registers memory regions, holds blocks under a transfer id
//!   with a lease (renewed by every pull and renew), frees them on release,
//!   expiry, `after_pull` or budget eviction, and serves the control protocol
//!   ([`proto`]) on its `remote_ctrl` listener.
//! - [`Reader`]: pulls a hold into its own registered memory with the chosen
//!   backend (TCP always; UCX and Mooncake behind cargo features).
//! - [`CtrlClient`]: renew / release / stat / stats over pooled connections
//!   (what the router uses).
//!
//! See docs/transfer.md for the protocol, the limits and what each backend
//! really supports.

mod auth;
mod backend;
mod client;
mod config;
mod conn;
mod error;
mod hold_table;
mod holder;
mod inbound_idle;
pub mod net;
pub mod proto;
mod reader;
mod region;
mod server;
mod stats;

pub use auth::{check_id_entropy, new_transfer_id};
pub use client::{ClientConfig, CtrlClient, Resolve, Resolver};
pub use config::{
    BackendKind, Faults, HolderConfig, ReleaseMode, Secret, DEFAULT_MAX_EPOCH, SECRET_ENV,
};
pub use error::{Result, TransferError};
pub use holder::Holder;
pub use reader::{Reader, ReaderConfig};
pub use region::{BlockRef, Region, RegionId};
pub use stats::{ConnectionCounts, HoldInfo, HolderStats, PullStats};

/// Deterministic bytes for tests and benchmarks: byte `i` of the pattern
/// seeded by `seed`. Holder and reader processes compute the same bytes
/// without exchanging them, so a pull can be checked byte for byte.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    extend_pattern(&mut out, seed, len);
    out
}

/// Appends [`pattern`]`(seed, len)` to `out` (no allocation of its own).
pub fn extend_pattern(out: &mut Vec<u8>, seed: u64, len: usize) {
    let end = out.len() + len;
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    while out.len() < end {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let word = (z ^ (z >> 31)).to_le_bytes();
        let take = (end - out.len()).min(8);
        out.extend_from_slice(&word[..take]);
    }
}
