//! Engine arguments (`engine-model.md` §1). A plain struct with public fields: `io`'s CLI
//! wraps it with clap; defaults come from [`super::defaults`].

use std::net::SocketAddr;

use super::EngineError;
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
    /// Context length (prompt + output), tokens; the HTTP server refuses a request that does
    /// not fit as vLLM does. Default [`defaults::MAX_MODEL_LEN`].
    pub max_model_len: usize,
    /// Seed of the output-token generator. Default [`defaults::SEED`].
    pub seed: u64,
    /// Idle keep-alive connections close after this many ms.
    /// Default [`defaults::KEEP_ALIVE_TIMEOUT_MS`].
    pub keep_alive_timeout_ms: u64,
    /// KV-event publishing (PUB + replay ROUTER, `engine-model.md` §5); `None` = off.
    pub kv_events: Option<KvEventsConfig>,
    /// HTTP fault switches in force at start; changeable at run time with
    /// `POST /_kvroute/fault` or [`EngineHandle::set_faults`](super::EngineHandle::set_faults).
    /// Default: all off.
    pub faults: EngineFaults,
    /// Answer a generation request whose `model` field names another model with 404 and vLLM's
    /// `NotFoundError` body (a request without `model` is always served). Default
    /// [`defaults::CHECK_MODEL`] (off; see there why).
    pub check_model: bool,
}

/// HTTP fault switches of one engine (`engine-model.md` §8: HTTP errors, killed mid-stream,
/// accept-and-hang). Each field is off when `None` / `false`; [`Default`] is all off. The JSON
/// form (`GET`/`POST /_kvroute/fault`) has exactly these field names; a missing field is off.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineFaults {
    /// Crash after this many generated tokens: a generation request (any API, streaming or
    /// not) that has produced N tokens and would produce more has its connection dropped with
    /// no further byte (no chunked terminator, no `[DONE]`) and is aborted in the engine. A
    /// stream sends its first N tokens first; a non-streaming request dies before any response
    /// byte; N = 0 dies before the response head. A request with `max_tokens ≤ N` completes.
    /// Checked at every token against the current setting, so setting it on a running engine
    /// kills in-flight streams that are already past N at their next token.
    pub die_after_tokens: Option<u32>,
    /// Freeze (a SIGSTOPped engine): no endpoint but `/_kvroute/*` sends a response byte while
    /// this is on. New requests, `/health`, `/metrics` and in-flight streams are held until the
    /// fault is cleared (then they proceed) or their client disconnects. Held generation
    /// requests are not counted as received until released.
    pub stall: bool,
    /// Answer every generation request with this HTTP status (100–999) and an OpenAI error
    /// body `{"error": {"message", "type", "code"}}`, without running it.
    pub status: Option<u16>,
    /// `Retry-After` header value, in seconds, on the answers of [`Self::status`] (e.g. with
    /// 429 or 503). `None` = no header.
    pub retry_after_s: Option<u32>,
    /// `GET /health` answers this status (100–999) instead of 200, independently of the fields
    /// above (a non-2xx answer carries an OpenAI error body).
    pub health_status: Option<u16>,
}

impl EngineFaults {
    /// Checks the status codes.
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] naming `faults.status` or `faults.health_status` when
    /// the code is outside 100–999.
    pub fn check(&self) -> Result<(), EngineError> {
        let valid = |c: Option<u16>| c.is_none_or(|c| (100..=999).contains(&c));
        if !valid(self.status) {
            return Err(EngineError::InvalidConfig {
                field: "faults.status",
            });
        }
        if !valid(self.health_status) {
            return Err(EngineError::InvalidConfig {
                field: "faults.health_status",
            });
        }
        Ok(())
    }
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
            faults: EngineFaults::default(),
            check_model: defaults::CHECK_MODEL,
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
        assert_eq!(c.faults, EngineFaults::default());
        assert!(!c.check_model);
    }

    #[test]
    fn faults_json_names_and_checks() {
        let f: EngineFaults =
            serde_json::from_str(r#"{"die_after_tokens": 3, "health_status": 503}"#).unwrap();
        assert_eq!(f.die_after_tokens, Some(3));
        assert_eq!(f.health_status, Some(503));
        assert!(!f.stall && f.status.is_none());
        assert!(serde_json::from_str::<EngineFaults>(r#"{"stal": true}"#).is_err());
        assert_eq!(
            EngineFaults {
                status: Some(1000),
                ..EngineFaults::default()
            }
            .check(),
            Err(EngineError::InvalidConfig {
                field: "faults.status"
            })
        );
        assert!(f.check().is_ok());
    }
}
