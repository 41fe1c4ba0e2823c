//! kvroute's test bed: everything needed to exercise the router without GPUs.
//!
//! - [`engine`]: a simulated vLLM-like engine (block manager, scheduler, timing model, HTTP).
//! - [`trace`]: Mooncake-format traces and the id → token/text recipe of `traces.md` §3.
//! - [`workload`]: the built-in demo workload (multi-turn conversations sharing system prompts).
//! - [`replay`]: an open-loop replay client measuring TTFT, TPOT, e2e and cache hit rate.
//! - [`load`]: a fixed-rate load generator (wrk2's model: latency from the scheduled send
//!   time, hdrhistogram percentiles) over HTTP/1.1 keep-alive connections.
//! - [`sim`]: a discrete-event simulator: the router's policy and simulated engines on a
//!   virtual clock, deterministic in its seed.
//! - [`plot`]: the simulator's figures (TTFT CDF, load over time, hit rate), PNG and SVG.
//! - [`index_bench`], [`tokenize_bench`], [`decision_bench`], [`fleet_bench`]: the benchmark
//!   runs behind `kvroute bench`.

/// The error of the test bed's entry points (benchmarks, `engine::server::serve`): any error,
/// with its message; the `kvroute` binary reports it as is.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) mod client;
pub mod decision_bench;
pub mod engine;
pub(crate) mod fasthash;
pub mod fleet_bench;
pub mod index_bench;
pub mod load;
pub mod plot;
pub mod replay;
pub mod sim;
pub mod tokenize_bench;
pub mod trace;
pub mod workload;
