//! The end-to-end tests: real routers, mock engines and etcd as processes on
//! loopback, one module per subject. One test binary (it links the router
//! once); `common` holds the cluster builders every module shares.

// Tests fail loudly on anything unexpected; that is what unwrap is for here.
#![allow(clippy::unwrap_used)]

mod common;

mod aware_routing;
mod bounds;
#[cfg(feature = "etcd")]
mod cluster;
mod faithful;
mod http2;
mod kv_transfer;
mod lifecycle;
mod messages;
mod observability;
mod redis_faults;
mod responses;
mod resume;
mod routing;
mod security;
mod shared_responses;
mod soak;
mod store_hygiene;
mod takeover_faults;
mod tenants;
