//! kvroute's network layer: thread-per-core monoio shards serving HTTP/1.1, proxying
//! OpenAI-compatible requests to workers over pooled keep-alive connections, with health
//! checks, circuit breakers, retries and graceful shutdown.
//!
//! Main types:
//! - [`shard::Server`]: the running gateway ([`gateway::start`]).
//! - [`state::Shared`]: what all shards and background threads share.
//! - [`message::Request`] / [`message::ResponseSink`]: the protocol-neutral exchange.
//! - [`upstream::Pool`]: one shard's idle worker connections.
//! - [`alloc::RecentFirst`]: the `kvroute` binary's global allocator.
//!
//! A request reads top to bottom in [`exchange`]: a transport ([`http1::server`]) parses it
//! → routing key and token ids (`kvroute_core::tokens::ShardTokenizers::route`: the chat
//! prefix cache, else `kvroute_core::route_key` then the tokenizer) → decide (`kvroute_core::policy`, read-only) →
//! load guard → forward ([`upstream`], retried elsewhere before the first byte) → record →
//! relay ([`relay`]) → [`record::Record`] on drop (metrics, access log). Arrows:
//! [`http1`] → [`exchange`] → [`message`]; the exchange never imports a transport.

pub mod admin;
pub mod alloc;
pub mod conn;
pub mod discovery;
pub mod error;
pub mod exchange;
pub mod gateway;
pub mod health;
pub mod http1;
pub mod load_poll;
pub mod message;
pub mod migrate;
pub mod nats;
pub mod record;
pub mod relay;
pub mod shard;
pub mod state;
pub mod upstream;
pub mod zmq;
