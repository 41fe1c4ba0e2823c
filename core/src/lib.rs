//! kvroute's router core: configuration, worker registry, load accounting, routing keys,
//! policies and metrics. No sockets, no clocks read inside a policy.
//!
//! Main types:
//! - [`config::Config`]: every setting, with one default each in [`config::defaults`].
//! - [`workers::Workers`]: the worker registry with atomic in-flight counts shared by all
//!   shards, changed at run time; [`workers::LoadGuard`] is the RAII token that counts one
//!   request, [`health`] the breaker, health and retry state machines.
//! - [`route_key::RouteKey`]: what routing needs from a request body; its token ids are
//!   [`ids::TokenIds`], shared and extended in place turn by turn.
//! - [`chat_prefix::ChatCache`]: a chat turn's key and token ids from the state after its
//!   previous messages.
//! - [`tokens::Tokenizers`] / [`tokens::ShardTokenizers`]: token ids for routing (body,
//!   `x-kvroute-routing-tokens` header, or the rendered prompt tokenized incrementally).
//! - [`policy::Router`]: `decide(snapshot, key, rng) -> Decision`, a read-only function of
//!   the request, a [`policy::Snapshot`] of the eligible workers and their loads, and the
//!   router's indexes; `record(key, decision)` writes the chosen worker into the indexes once
//!   the request is committed to it.
//! - [`sync`]: replica sync, the messages several router replicas exchange (booked load,
//!   page keys) and how a replica applies a peer's.
//! - [`metrics::Metrics`]: Prometheus counters and histograms.

pub mod chat_prefix;
pub mod config;
pub mod copy;
pub mod discovery;
pub mod error;
pub mod events;
pub mod health;
pub mod ids;
pub mod load;
pub mod metrics;
pub mod policy;
pub mod route_key;
pub mod sync;
pub mod tokens;
pub mod workers;

pub use error::CoreError;
