//! [`EngineCore`]: the whole simulated engine as a pure state machine stepped by a clock it is
//! given (no clock reads, no I/O, no async). Source: `engine-model.md` §2–§4, vLLM V1
//! `EngineCore::step`, Dynamo mocker.

use super::blocks::{BlockEvent, BlockManager};
use super::scheduler::{Request, Scheduler, SchedulerConfig};
use super::timing::TimingModel;
use super::tokens::{OutputStream, output_token};
use crate::engine::EngineConfig;

/// Why the engine refused a configuration, a request or an admin call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A configuration field is out of range (`field` names it).
    #[error("invalid engine config: {field} out of range")]
    InvalidConfig {
        /// Name of the offending [`EngineConfig`] field.
        field: &'static str,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt is longer than `max_model_len` (HTTP 400).
    #[error(
        "this model's maximum context length is {max_model_len} tokens, the prompt has {prompt_tokens}"
    )]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Configured limit in tokens.
        max_model_len: usize,
    },
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus output would not fit in the whole KV cache even alone.
    #[error("request needs {blocks_needed} KV blocks, the engine has {num_gpu_blocks}")]
    ExceedsKvCapacity {
        /// Blocks for prompt + max_tokens.
        blocks_needed: usize,
        /// Engine capacity in blocks.
        num_gpu_blocks: usize,
    },
    /// A request with this id is already in the engine.
    #[error("request id {req_id} is already in use")]
    DuplicateRequest {
        /// The id.
        req_id: u64,
    },
    /// `reset_prefix_cache` refused because requests hold blocks (as vLLM does).
    #[error("cannot reset the prefix cache while {used_blocks} blocks are in use")]
    ResetWhileBusy {
        /// Blocks held by requests.
        used_blocks: usize,
    },
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens` (OpenAI `"length"`).
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
        }
    }
}

/// Prompt accounting reported with a request's first token (HTTP `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptUsage {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache at first admission: hit blocks × block
    /// size, at most `⌊(L − 1)/bs⌋ × bs` (`engine-model.md` §2, §6).
    pub cached_tokens: u32,
}

/// One output token of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOut {
    /// Token id (from [`super::tokens::OUTPUT_VOCAB`]).
    pub token_id: u32,
    /// 0-based position among the request's outputs.
    pub index: u32,
    /// Set on the first token only.
    pub prompt: Option<PromptUsage>,
    /// Set on the last token; the request has left the engine.
    pub finish: Option<FinishReason>,
}

/// Result of one [`EngineCore::step`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutput {
    /// Clock value the step started at, in ms (the `now_ms` argument).
    pub start_ms: f64,
    /// Modelled step time in ms (§4, after speedups); tokens are ready at
    /// `start_ms + duration_ms`. 0 for an idle step.
    pub duration_ms: f64,
    /// Uncached prompt tokens computed in the step (the prefill term's `T`).
    pub prefill_tokens: usize,
    /// Requests that decoded one token in the step.
    pub decode_requests: usize,
    /// Tokens produced, in running-set order.
    pub outputs: Vec<(u64, TokenOut)>,
    /// Cache changes of the step in order (evictions at scheduling, stores at execution),
    /// plus any left by [`EngineCore::reset_prefix_cache`] since the previous step.
    pub events: Vec<BlockEvent>,
}

/// Load and counter snapshot (`engine-model.md` §7, vLLM metric names in field docs).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc`, 0–1 (blocks held by requests / capacity).
    pub kv_usage: f64,
    /// `vllm:prefix_cache_queries_total`, tokens.
    pub prefix_queries_tokens: u64,
    /// `vllm:prefix_cache_hits_total`, tokens.
    pub prefix_hits_tokens: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// Blocks evicted since start (= hashes in `Removed` events).
    pub evicted_blocks: u64,
    /// Cached full blocks now (active + inactive).
    pub cached_blocks: usize,
}

/// The simulated engine of one rank. Feed it requests, call [`Self::step`] with the current
/// clock (virtual or wall), and sleep/advance by the returned `duration_ms`.
///
/// Deterministic: the same config, the same calls and the same clock values give the same
/// outputs and events.
#[derive(Debug)]
pub struct EngineCore {
    sched: Scheduler,
    timing: TimingModel,
    seed: u64,
    block_size: usize,
    num_gpu_blocks: usize,
    max_model_len: usize,
    pending_events: Vec<BlockEvent>,
    /// Output streams of requests added with [`Self::add_request_stream`]; others use
    /// `(req_id, 0)`.
    streams: std::collections::HashMap<u64, OutputStream>,
}

impl EngineCore {
    /// Empty engine for `cfg` (its server fields are ignored).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] when `block_size`, `num_gpu_blocks`, `max_num_seqs`,
    /// `max_num_batched_tokens` or `max_model_len` is 0, `watermark` is outside `[0, 1)`, or
    /// a speedup ratio is negative or not finite; or the field
    /// [`EngineFaults::check`](crate::engine::EngineFaults::check) names.
    pub fn new(cfg: &EngineConfig) -> Result<Self, EngineError> {
        let bad = |field| Err(EngineError::InvalidConfig { field });
        if cfg.block_size == 0 {
            return bad("block_size");
        }
        if cfg.num_gpu_blocks == 0 {
            return bad("num_gpu_blocks");
        }
        if cfg.max_num_seqs == 0 {
            return bad("max_num_seqs");
        }
        if cfg.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens");
        }
        if cfg.max_model_len == 0 {
            return bad("max_model_len");
        }
        if !(0.0..1.0).contains(&cfg.watermark) {
            return bad("watermark");
        }
        if !(cfg.speedup_ratio.is_finite() && cfg.speedup_ratio >= 0.0) {
            return bad("speedup_ratio");
        }
        if !(cfg.decode_speedup_ratio.is_finite() && cfg.decode_speedup_ratio >= 0.0) {
            return bad("decode_speedup_ratio");
        }
        cfg.faults.check()?;
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            watermark_blocks: (cfg.watermark * cfg.num_gpu_blocks as f64) as usize,
        };
        Ok(Self {
            sched: Scheduler::new(
                sched_cfg,
                BlockManager::new(cfg.block_size, cfg.num_gpu_blocks),
            ),
            timing: TimingModel {
                speedup_ratio: cfg.speedup_ratio,
                decode_speedup_ratio: cfg.decode_speedup_ratio,
            },
            seed: cfg.seed,
            block_size: cfg.block_size,
            num_gpu_blocks: cfg.num_gpu_blocks,
            max_model_len: cfg.max_model_len,
            pending_events: Vec::new(),
            streams: std::collections::HashMap::new(),
        })
    }

    /// Queues request `req_id` with prompt token ids `prompt`, producing exactly `max_tokens`
    /// output tokens (finish reason `length`): token `j` is
    /// [`output_token`]`(seed, req_id, j)`. See [`Self::add_request_stream`] for the errors.
    ///
    /// # Errors
    /// As [`Self::add_request_stream`].
    pub fn add_request(
        &mut self,
        req_id: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> Result<(), EngineError> {
        let stream = OutputStream {
            key: req_id,
            start: 0,
        };
        self.add_request_stream(req_id, prompt, max_tokens, stream)
    }

    /// Queues request `req_id` with prompt token ids `prompt`, producing exactly `max_tokens`
    /// output tokens (finish reason `length`): token `j` is
    /// [`output_token`]`(seed, stream.key, stream.start + j)` (the continuation rule of
    /// [`OutputStream`]).
    ///
    /// # Errors
    /// - [`EngineError::EmptyPrompt`]: `prompt` is empty.
    /// - [`EngineError::PromptTooLong`]: `prompt.len() > max_model_len`.
    /// - [`EngineError::ZeroMaxTokens`]: `max_tokens == 0`.
    /// - [`EngineError::ExceedsKvCapacity`]: prompt + output needs more blocks than exist.
    /// - [`EngineError::DuplicateRequest`]: `req_id` is still in the engine.
    pub fn add_request_stream(
        &mut self,
        req_id: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
        stream: OutputStream,
    ) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > self.max_model_len {
            return Err(EngineError::PromptTooLong {
                prompt_tokens: prompt.len(),
                max_model_len: self.max_model_len,
            });
        }
        if max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        // The last output token's KV is never computed.
        let blocks_needed = (prompt.len() + max_tokens as usize - 1).div_ceil(self.block_size);
        if blocks_needed > self.num_gpu_blocks {
            return Err(EngineError::ExceedsKvCapacity {
                blocks_needed,
                num_gpu_blocks: self.num_gpu_blocks,
            });
        }
        if self.sched.contains(req_id) {
            return Err(EngineError::DuplicateRequest { req_id });
        }
        self.sched
            .enqueue(Request::new(req_id, prompt, max_tokens, self.block_size));
        if stream.key != req_id || stream.start != 0 {
            self.streams.insert(req_id, stream);
        }
        Ok(())
    }

    /// Removes `req_id` (client disconnected), releasing its blocks tail first. Returns false
    /// if the request is unknown (already finished or never added). Emits no event.
    pub fn abort(&mut self, req_id: u64) -> bool {
        self.streams.remove(&req_id);
        self.sched.remove(req_id).is_some()
    }

    /// Runs one step starting at `now_ms`: schedule (§3), model its duration (§4), compute,
    /// sample one token for every request whose known tokens are all computed, finish and
    /// release requests at `max_tokens`. An idle engine returns an empty output with
    /// `duration_ms = 0` (still carrying pending reset events).
    pub fn step(&mut self, now_ms: f64) -> StepOutput {
        let mut events = std::mem::take(&mut self.pending_events);
        let planned = self.sched.schedule(&mut events);
        let prefill_tokens: usize = planned
            .iter()
            .filter(|s| !s.is_decode)
            .map(|s| s.num_tokens)
            .sum();
        let decode_requests = planned.iter().filter(|s| s.is_decode).count();
        let duration_ms = self.timing.step_ms(
            prefill_tokens,
            decode_requests > 0,
            self.sched.blocks().usage(),
        );
        let mut outputs = Vec::new();
        for s in planned {
            if !self.sched.advance(s, &mut events) {
                continue; // mid-prefill chunk
            }
            let req = &self.sched.requests[&s.req_id];
            let index = req.num_outputs;
            let prompt = (index == 0).then(|| PromptUsage {
                prompt_tokens: req.prompt_len as u32,
                cached_tokens: req.cached_tokens.unwrap_or(0) as u32,
            });
            let stream = self
                .streams
                .get(&s.req_id)
                .copied()
                .unwrap_or(OutputStream {
                    key: s.req_id,
                    start: 0,
                });
            let token_id = output_token(self.seed, stream.key, stream.start.wrapping_add(index));
            let finished = self.sched.append_output(s.req_id, token_id);
            if finished {
                self.streams.remove(&s.req_id);
            }
            outputs.push((
                s.req_id,
                TokenOut {
                    token_id,
                    index,
                    prompt,
                    finish: finished.then_some(FinishReason::Length),
                },
            ));
        }
        StepOutput {
            start_ms: now_ms,
            duration_ms,
            prefill_tokens,
            decode_requests,
            outputs,
            events,
        }
    }

    /// True when no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.sched.num_running() == 0 && self.sched.num_waiting() == 0
    }

    /// Current load and counters.
    pub fn stats(&self) -> EngineStats {
        let c = self.sched.counters();
        let b = self.sched.blocks();
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            kv_usage: b.usage(),
            prefix_queries_tokens: c.prefix_queries_tokens,
            prefix_hits_tokens: c.prefix_hits_tokens,
            preemptions: c.preemptions,
            prompt_tokens: c.prompt_tokens,
            generation_tokens: c.generation_tokens,
            evicted_blocks: b.evicted_total(),
            cached_blocks: b.num_cached(),
        }
    }

    /// Drops every cached block (`POST /reset_prefix_cache`); an [`BlockEvent::AllCleared`]
    /// is delivered with the next step. Returns the number of blocks dropped.
    ///
    /// # Errors
    /// [`EngineError::ResetWhileBusy`] while requests hold blocks (vLLM refuses too).
    pub fn reset_prefix_cache(&mut self) -> Result<usize, EngineError> {
        let used_blocks = self.sched.blocks().num_used();
        let n = self
            .sched
            .blocks_mut()
            .reset()
            .ok_or(EngineError::ResetWhileBusy { used_blocks })?;
        self.pending_events.push(BlockEvent::AllCleared);
        Ok(n)
    }

    /// Models an engine restart for the cache: drops every cached block with no event (a
    /// restarted engine starts empty and its publisher restarts at seq 0; `engine-model.md`
    /// §8). Returns the number of blocks dropped.
    ///
    /// # Errors
    /// [`EngineError::ResetWhileBusy`] while requests hold blocks.
    pub fn restart_cache(&mut self) -> Result<usize, EngineError> {
        let n = self.reset_prefix_cache()?;
        self.pending_events.retain(|e| *e != BlockEvent::AllCleared);
        Ok(n)
    }

    /// Engine hashes of every cached full block (see [`BlockManager::cached_hashes`]).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.sched.blocks().cached_hashes()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Checks the scheduler's and block manager's invariants; the error names the broken one.
    #[cfg(test)]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.sched.check_invariants()
    }
}
