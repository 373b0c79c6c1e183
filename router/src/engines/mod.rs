//! Talking to engines: the one HTTP client every call to an engine goes
//! through (`http/`), and where registered engines may live at all
//! (`addresses.rs`: the address policy every registered URL and control
//! address is checked against), and `probe.rs` (the `GET`s of health probes
//! and model lists, over that client).

pub mod addresses;
pub mod http;
pub mod probe;
