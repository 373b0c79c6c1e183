//! Talking to engines: the one HTTP client every call to an engine goes
//! through (`http/`), and where registered engines may live at all
//! (`addresses.rs`: the address policy every registered URL and control
//! address is checked against).

pub mod addresses;
pub mod http;
