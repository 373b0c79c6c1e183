//! Membership: which engine instances exist, their role, model, lifecycle and load;
//! how the router learns of them (self-registration, static instances
//! `static_instances.rs`, each engine's own model list `membership/model_list.rs`).
//!
//! One abstraction, two backends. Every router keeps a local [`view::View`] that
//! the routing hot path reads (never a network round trip per request); writes
//! (register, heartbeat, drain, activate, remove) go through a [`Store`]:
//! - [`memory`] (the default): the view *is* the membership of this one router;
//!   instances whose heartbeats stop for their TTL are marked dead by a reaper.
//! - `etcd` (`--etcd URL`, cargo feature `etcd`): each instance is a key under a
//!   prefix bound to an etcd lease (TTL = heartbeat TTL) that heartbeats to any
//!   replica refresh; a watch applies every change to the view of every replica.
//!
//! An instance's `Arc<Instance>` is updated in place when its state changes (never
//! swapped for a new one while its identity is the same), so that a stream holding
//! it sees the change through [`Instance::subscribe`]. In-flight counts are local
//! to each router.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod etcd_config;
pub mod instance;
pub mod load;
pub mod machine;
pub mod memory;
pub mod model_list;
pub mod registration;
pub mod registry;
pub mod static_instances;
pub mod status;
pub mod store;
pub mod view;

pub use etcd_config::EtcdConfig;
pub use instance::{Instance, LoadGuard};
pub use registration::{valid_id, Lifecycle, Pick, Registration};
pub use registry::Registry;
pub use store::{Claim, RegistryError};
