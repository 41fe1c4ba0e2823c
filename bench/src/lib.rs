//! stub
pub mod engine;
