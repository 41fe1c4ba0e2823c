//! Engine arguments (`engine-model.md` §1). A plain struct with public fields: `io`'s CLI
//! wraps it with clap; defaults come from [`super::defaults`].

use std::net::SocketAddr;

use super::defaults;
use super::events::KvEventsConfig;

/// Arguments of one simulated engine (one rank, vLLM flavour).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// HTTP listen address. Default [`defaults::ENGINE_LISTEN`].
    pub listen: SocketAddr,
    /// Served model name (`/v1/models`, `model` field of responses, `model_name` label).
    /// Default [`defaults::MODEL_NAME`].
    pub model_name: String,
    /// Tokens per KV block. Default [`defaults::BLOCK_SIZE`].
    pub block_size: usize,
    /// KV capacity in blocks. Default [`defaults::NUM_GPU_BLOCKS`].
    pub num_gpu_blocks: usize,
    /// Running-set cap, in requests. Default [`defaults::MAX_NUM_SEQS`].
    pub max_num_seqs: usize,
    /// Token budget per step, in tokens. Default [`defaults::MAX_NUM_BATCHED_TOKENS`].
    pub max_num_batched_tokens: usize,
    /// Fraction of blocks (0–1) kept free on admission. Default [`defaults::WATERMARK`].
    pub watermark: f64,
    /// Divisor of all modelled times; 0 = no delay. Default [`defaults::SPEEDUP_RATIO`].
    pub speedup_ratio: f64,
    /// Extra divisor of decode time. Default [`defaults::DECODE_SPEEDUP_RATIO`].
    pub decode_speedup_ratio: f64,
    /// Longest accepted prompt, in tokens. Default [`defaults::MAX_MODEL_LEN`].
    pub max_model_len: usize,
    /// Seed of the output-token generator. Default [`defaults::SEED`].
    pub seed: u64,
    /// Idle keep-alive connections close after this many ms.
    /// Default [`defaults::KEEP_ALIVE_TIMEOUT_MS`].
    pub keep_alive_timeout_ms: u64,
    /// KV-event publishing (PUB + replay ROUTER, `engine-model.md` §5); `None` = off.
    pub kv_events: Option<KvEventsConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            listen: defaults::ENGINE_LISTEN
                .parse()
                .expect("ENGINE_LISTEN is a valid socket address"),
            model_name: defaults::MODEL_NAME.to_string(),
            block_size: defaults::BLOCK_SIZE,
            num_gpu_blocks: defaults::NUM_GPU_BLOCKS,
            max_num_seqs: defaults::MAX_NUM_SEQS,
            max_num_batched_tokens: defaults::MAX_NUM_BATCHED_TOKENS,
            watermark: defaults::WATERMARK,
            speedup_ratio: defaults::SPEEDUP_RATIO,
            decode_speedup_ratio: defaults::DECODE_SPEEDUP_RATIO,
            max_model_len: defaults::MAX_MODEL_LEN,
            seed: defaults::SEED,
            keep_alive_timeout_ms: defaults::KEEP_ALIVE_TIMEOUT_MS,
            kv_events: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_reads_the_consts() {
        let c = EngineConfig::default();
        assert_eq!(c.listen.to_string(), defaults::ENGINE_LISTEN);
        assert_eq!(c.block_size, 16);
        assert_eq!(c.num_gpu_blocks, 16_384);
        assert_eq!(c.max_num_seqs, 256);
        assert_eq!(c.max_num_batched_tokens, 8_192);
        assert_eq!(c.watermark, 0.01);
        assert_eq!(c.max_model_len, 131_072);
    }
}
