//! Simulated vLLM-like engine: the GPU-free test bed the router is tested against
//! (`engine-model.md`).
//!
//! - [`model::EngineCore`]: pure state machine (block manager, scheduler, timing), stepped by
//!   a clock it is given.
//! - [`server`]: HTTP front end (OpenAI + SGLang `/generate` + `/metrics`) on tokio/hyper that
//!   steps an `EngineCore` in wall-clock mode. [`server::spawn`] runs one on its own thread.
//! - [`events`]: KV events in vLLM's wire format (PUB + replay ROUTER, faults).
//! - [`EngineConfig`]: engine arguments; defaults in [`defaults`].

mod config;
pub mod defaults;
pub mod events;
pub mod model;
pub mod server;

pub use config::{EngineConfig, EngineFaults};
pub use model::{EngineCore, EngineError, EngineStats, StepOutput, TokenOut};
pub use server::{EngineHandle, RequestStats, render_metrics, serve, spawn};
