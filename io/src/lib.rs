//! kvroute's network layer: thread-per-core monoio shards serving HTTP/1.1, proxying
//! OpenAI-compatible requests to workers over pooled keep-alive connections.
//!
//! Main types:
//! - [`shard::Server`]: the running gateway ([`shard::start`]).
//! - [`shard::Shared`]: what all shards share (workers, router, metrics).
//! - [`upstream::Pool`]: one shard's idle worker connections.
//!
//! A request reads top to bottom in [`exchange`]: parse ([`http1`]) → routing key
//! (`kvroute_core::route_key`) → decide (`kvroute_core::policy`) → load guard → forward
//! ([`upstream`]) → relay ([`relay`]) → record (metrics, guard drop).

pub mod admin;
pub mod conn;
pub mod demo;
pub mod error;
pub mod exchange;
pub mod gateway;
pub mod http1;
pub mod load_poll;
pub mod relay;
pub mod shard;
pub mod simulate;
pub mod upstream;
pub mod zmq;
