//! The simulated engine as a pure, deterministic state machine (no clock reads, no I/O, no
//! async). [`EngineCore`] is the entry point; it owns a [`Scheduler`] which owns a
//! [`BlockManager`]. Step time comes from [`timing`], output tokens from [`tokens`].
//!
//! | module | holds | source |
//! |---|---|---|
//! | [`blocks`] | [`BlockManager`], [`BlockEvent`], block hashing | `engine-model.md` §2 |
//! | [`scheduler`] | [`Scheduler`], counters | §3 |
//! | [`timing`] | polynomial prefill/decode ms | §4 |
//! | [`tokens`] | seeded filler output tokens | §6 |
//! | `engine_core` | [`EngineCore`], [`StepOutput`], [`EngineStats`], [`EngineError`] | §2–§4 |

mod block_map;
pub mod blocks;
mod engine_core;
pub mod scheduler;
pub mod timing;
pub mod tokens;

#[cfg(test)]
mod tests;

pub use blocks::{BlockEvent, BlockHash, BlockManager};
pub use engine_core::{
    EngineCore, EngineError, EngineStats, FinishReason, PromptUsage, StepOutput, TokenOut,
};
pub use scheduler::Scheduler;
