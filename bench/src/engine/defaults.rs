//! Default engine arguments, defined once. [`EngineConfig::default`](super::EngineConfig),
//! the `kvroute engine` CLI (in `io`) and the tests all read these constants.
//!
//! Source for every value: `engine-model.md` §1 (vLLM V1 defaults unless noted).

/// Address the simulated engine listens on when none is given. Source: the router's
/// default worker list (`127.0.0.1:8100`, the first of the demo's four engines).
pub const ENGINE_LISTEN: &str = "127.0.0.1:8100";

/// Model name served on `/v1/models` and used as the `model_name` metric label.
pub const MODEL_NAME: &str = "qwen3-sim";

/// Tokens per KV block. Source: vLLM's default `--block-size` (Dynamo's mocker uses 64).
pub const BLOCK_SIZE: usize = 16;

/// KV capacity in blocks (capacity in tokens = blocks × [`BLOCK_SIZE`]).
/// Source: `engine-model.md` §1; demos use ~2,000 to create eviction pressure.
pub const NUM_GPU_BLOCKS: usize = 16_384;

/// Cap on the running set, in requests. Source: vLLM `--max-num-seqs`.
pub const MAX_NUM_SEQS: usize = 256;

/// Token budget per scheduler step, in tokens. Source: vLLM `--max-num-batched-tokens`.
pub const MAX_NUM_BATCHED_TOKENS: usize = 8_192;

/// Fraction of KV blocks (0–1) that must stay free after admitting a request.
/// Source: vLLM block-manager watermark.
pub const WATERMARK: f64 = 0.01;

/// Divisor applied to every modelled step time; 0 means no delay. Source: Dynamo mocker.
pub const SPEEDUP_RATIO: f64 = 1.0;

/// Extra divisor applied to decode time only (models speculative decoding). Source: Dynamo mocker.
pub const DECODE_SPEEDUP_RATIO: f64 = 1.0;

/// Context length (prompt + output), tokens; a request that does not fit is refused (HTTP 400).
/// Source: Qwen3's 128 Ki context (`engine-model.md` §1).
pub const MAX_MODEL_LEN: usize = 131_072;

/// Seed of every pseudo-random choice of the engine (output tokens).
pub const SEED: u64 = 0;

/// `max_tokens` when a request gives neither `max_tokens` nor `max_completion_tokens`, in tokens.
/// Source: OpenAI legacy completions default (vLLM uses 16 for `/v1/completions`).
pub const MAX_TOKENS: u32 = 16;

/// Idle keep-alive connections are closed after this many ms. Source: uvicorn's
/// `timeout_keep_alive` (5 s), which vLLM and SGLang servers inherit.
pub const KEEP_ALIVE_TIMEOUT_MS: u64 = 5_000;

/// Wall-clock driver: modelled time is accumulated and slept once it reaches this many ms,
/// so sub-millisecond steps batch into one sleep.
pub const MIN_SLEEP_MS: f64 = 1.0;

/// Whether the engine answers 404 to a request for a model it does not serve. vLLM always
/// checks; the simulator defaults to off because the workspace's clients send other names
/// (`kvroute replay` defaults to `Qwen/Qwen3-0.6B`, the io tests send `"m"`). Tests of the
/// router's 404 handling turn it on with `EngineConfig::check_model`.
pub const CHECK_MODEL: bool = false;

/// How many `x-request-id` values `GET /_kvroute/stats` keeps (the most recent ones).
pub const REQUEST_ID_LOG: usize = 1_024;
