//! stub
pub mod engine;
pub mod replay;
pub mod trace;
pub mod workload;
