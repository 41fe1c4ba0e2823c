//! The built-in demo workload: multi-turn conversations sharing system prompts, emitted as
//! Mooncake-format [`TraceRecord`]s so the same replay, bound and text synthesis apply.
//!
//! Shape (traces.md §1, scaled down so the demo finishes fast): every request starts with the
//! shared head block id 0, then one of a few system prompts (1–4 full blocks each, shared by
//! many conversations), then the conversation's own blocks. Turn N+1's prompt is turn N's prompt
//! plus turn N's answer plus a new user message; turn N's full blocks keep their ids and the
//! grown last partial block gets a new id, so ids stay prefix-chained. Conversations start as a
//! Poisson process and interleave. Everything is a pure function of [`WorkloadParams`]
//! (its own SplitMix64 stream, independent of `rand` versions).

use serde::{Deserialize, Serialize};

use crate::trace::{MOONCAKE_BLOCK_TOKENS, SplitMix64, TraceRecord};

/// Default seed of the built-in workload.
pub const DEFAULT_SEED: u64 = 0x006b_7672_6f75_7465; // "kvroute" in ASCII
/// Default number of conversations (≈ 240 requests at ~6 turns each). Source: demo brief.
pub const DEFAULT_CONVERSATIONS: usize = 40;
/// Default fewest turns per conversation (a conversation ends earlier only at
/// [`DEFAULT_MAX_INPUT_TOKENS`]).
pub const DEFAULT_MIN_TURNS: u32 = 3;
/// Default most turns per conversation.
pub const DEFAULT_MAX_TURNS: u32 = 8;
/// Default number of distinct system prompts shared by the conversations.
pub const DEFAULT_SYSTEM_PROMPTS: usize = 5;
/// Default fewest 512-token blocks in a system prompt (after the shared head block).
pub const DEFAULT_SYSTEM_MIN_BLOCKS: u32 = 1;
/// Default most 512-token blocks in a system prompt (after the shared head block).
pub const DEFAULT_SYSTEM_MAX_BLOCKS: u32 = 4;
/// Default fewest tokens of a conversation's first user message.
pub const DEFAULT_FIRST_MESSAGE_MIN_TOKENS: u32 = 800;
/// Default most tokens of a conversation's first user message.
pub const DEFAULT_FIRST_MESSAGE_MAX_TOKENS: u32 = 4_000;
/// Default fewest tokens of a follow-up user message (added with the previous answer).
pub const DEFAULT_FOLLOWUP_MIN_TOKENS: u32 = 500;
/// Default most tokens of a follow-up user message.
pub const DEFAULT_FOLLOWUP_MAX_TOKENS: u32 = 2_000;
/// Default cap on a prompt, tokens: a conversation stops before a turn would exceed it.
pub const DEFAULT_MAX_INPUT_TOKENS: u32 = 16_384;
/// Default fewest output tokens per request.
pub const DEFAULT_OUTPUT_MIN_TOKENS: u32 = 50;
/// Default most output tokens per request.
pub const DEFAULT_OUTPUT_MAX_TOKENS: u32 = 300;
/// Default mean rate of conversation starts, conversations per second (Poisson process).
pub const DEFAULT_CONVERSATIONS_PER_S: f64 = 1.5;
/// Default shortest gap between a conversation's turns, ms.
pub const DEFAULT_TURN_GAP_MIN_MS: u64 = 2_000;
/// Default longest gap between a conversation's turns, ms.
pub const DEFAULT_TURN_GAP_MAX_MS: u64 = 5_000;

/// Parameters of [`builtin_workload`]. Ranges are inclusive; a `max` below its `min` is raised
/// to it. `Default` and `#[serde(default)]` read the `DEFAULT_*` constants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkloadParams {
    /// Seed of the generator; equal params give identical records.
    pub seed: u64,
    /// Conversations generated.
    pub conversations: usize,
    /// Fewest turns per conversation.
    pub min_turns: u32,
    /// Most turns per conversation.
    pub max_turns: u32,
    /// Distinct system prompts (at least 1).
    pub system_prompts: usize,
    /// Fewest full 512-token blocks per system prompt, after the shared head.
    pub system_min_blocks: u32,
    /// Most full 512-token blocks per system prompt, after the shared head.
    pub system_max_blocks: u32,
    /// Fewest tokens of the first user message.
    pub first_message_min_tokens: u32,
    /// Most tokens of the first user message.
    pub first_message_max_tokens: u32,
    /// Fewest tokens of a follow-up user message.
    pub followup_min_tokens: u32,
    /// Most tokens of a follow-up user message.
    pub followup_max_tokens: u32,
    /// Prompt cap, tokens: a conversation ends before a turn that would exceed it.
    pub max_input_tokens: u32,
    /// Fewest output tokens per request.
    pub output_min_tokens: u32,
    /// Most output tokens per request.
    pub output_max_tokens: u32,
    /// Mean conversation starts per second (exponential inter-arrival times).
    pub conversations_per_s: f64,
    /// Shortest gap between consecutive turns of a conversation, ms.
    pub turn_gap_min_ms: u64,
    /// Longest gap between consecutive turns of a conversation, ms.
    pub turn_gap_max_ms: u64,
}

impl Default for WorkloadParams {
    fn default() -> Self {
        Self {
            seed: DEFAULT_SEED,
            conversations: DEFAULT_CONVERSATIONS,
            min_turns: DEFAULT_MIN_TURNS,
            max_turns: DEFAULT_MAX_TURNS,
            system_prompts: DEFAULT_SYSTEM_PROMPTS,
            system_min_blocks: DEFAULT_SYSTEM_MIN_BLOCKS,
            system_max_blocks: DEFAULT_SYSTEM_MAX_BLOCKS,
            first_message_min_tokens: DEFAULT_FIRST_MESSAGE_MIN_TOKENS,
            first_message_max_tokens: DEFAULT_FIRST_MESSAGE_MAX_TOKENS,
            followup_min_tokens: DEFAULT_FOLLOWUP_MIN_TOKENS,
            followup_max_tokens: DEFAULT_FOLLOWUP_MAX_TOKENS,
            max_input_tokens: DEFAULT_MAX_INPUT_TOKENS,
            output_min_tokens: DEFAULT_OUTPUT_MIN_TOKENS,
            output_max_tokens: DEFAULT_OUTPUT_MAX_TOKENS,
            conversations_per_s: DEFAULT_CONVERSATIONS_PER_S,
            turn_gap_min_ms: DEFAULT_TURN_GAP_MIN_MS,
            turn_gap_max_ms: DEFAULT_TURN_GAP_MAX_MS,
        }
    }
}

/// Seeded draws used by the generator.
struct Draw(SplitMix64);

impl Draw {
    /// Uniform integer in `lo ..= max(lo, hi)`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        let hi = hi.max(lo);
        lo + self.0.next_u64() % (hi - lo + 1)
    }

    fn range_u32(&mut self, lo: u32, hi: u32) -> u32 {
        self.range(u64::from(lo), u64::from(hi)) as u32
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        -(1.0 - self.unit()).ln() * mean
    }
}

/// Hands out dense ids in first-use order.
struct Ids(u64);

impl Ids {
    fn fresh(&mut self) -> u64 {
        let id = self.0;
        self.0 += 1;
        id
    }
}

/// The built-in workload as conversations: element `c` holds conversation `c`'s turns in order
/// (timestamps ascending, ms). Conversation order is start-time order. Ids are dense from 0
/// (0 = the shared head block). Deterministic in `params`.
pub fn builtin_conversations(params: &WorkloadParams) -> Vec<Vec<TraceRecord>> {
    let b = MOONCAKE_BLOCK_TOKENS;
    let mut draw = Draw(SplitMix64::from_state(params.seed));
    let mut ids = Ids(0);
    let head = ids.fresh();
    let systems: Vec<Vec<u64>> = (0..params.system_prompts.max(1))
        .map(|_| {
            let n = draw.range_u32(params.system_min_blocks, params.system_max_blocks);
            std::iter::once(head)
                .chain((0..n).map(|_| ids.fresh()))
                .collect()
        })
        .collect();
    let mean_gap_ms = 1_000.0 / params.conversations_per_s.max(1e-6);
    let mut start_ms = 0.0f64;
    let mut out = Vec::with_capacity(params.conversations);
    for c in 0..params.conversations {
        if c > 0 {
            start_ms += draw.exp(mean_gap_ms);
        }
        let system = &systems[draw.range(0, systems.len() as u64 - 1) as usize];
        let turns = draw.range_u32(params.min_turns.max(1), params.max_turns);
        let mut block_ids = system.clone();
        let mut len = system.len() as u32 * b;
        let mut ts = start_ms.round() as u64;
        let mut prev_output = 0u32;
        let mut conv = Vec::with_capacity(turns as usize);
        for t in 0..turns {
            let message = if t == 0 {
                draw.range_u32(
                    params.first_message_min_tokens.max(1),
                    params.first_message_max_tokens,
                )
            } else {
                draw.range_u32(
                    params.followup_min_tokens.max(1),
                    params.followup_max_tokens,
                )
            };
            let output = draw.range_u32(params.output_min_tokens.max(1), params.output_max_tokens);
            if t > 0 {
                ts += draw.range(params.turn_gap_min_ms, params.turn_gap_max_ms);
            }
            let new_len = len + prev_output + message;
            if t > 0 && new_len > params.max_input_tokens {
                break;
            }
            // Keep the previous turn's full blocks; the grown partial block and everything after
            // it get fresh ids.
            block_ids.truncate((len / b) as usize);
            while block_ids.len() < new_len.div_ceil(b) as usize {
                block_ids.push(ids.fresh());
            }
            len = new_len;
            prev_output = output;
            conv.push(TraceRecord {
                timestamp_ms: ts,
                input_length: len,
                output_length: output,
                hash_ids: block_ids.clone(),
            });
        }
        out.push(conv);
    }
    out
}

/// The built-in demo workload in Mooncake format: all turns of [`builtin_conversations`]
/// merged by timestamp (ms; ties keep conversation order), interleaving conversations.
/// Deterministic in `params`. With the defaults: ~240 requests, inputs ~2k–16k tokens.
pub fn builtin_workload(params: &WorkloadParams) -> Vec<TraceRecord> {
    let mut all: Vec<TraceRecord> = builtin_conversations(params)
        .into_iter()
        .flatten()
        .collect();
    all.sort_by_key(|r| r.timestamp_ms); // stable: ties keep conversation order
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::block_count_ok;

    #[test]
    fn records_are_well_formed() {
        let p = WorkloadParams::default();
        let rs = builtin_workload(&p);
        assert!(
            rs.windows(2)
                .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms)
        );
        for r in &rs {
            assert!(block_count_ok(r, MOONCAKE_BLOCK_TOKENS), "{r:?}");
            assert_eq!(r.hash_ids[0], 0);
            assert!(r.input_length <= p.max_input_tokens);
            assert!((p.output_min_tokens..=p.output_max_tokens).contains(&r.output_length));
        }
    }

    #[test]
    fn max_below_min_is_raised() {
        let p = WorkloadParams {
            conversations: 3,
            min_turns: 4,
            max_turns: 1,
            output_min_tokens: 70,
            output_max_tokens: 10,
            ..WorkloadParams::default()
        };
        let cs = builtin_conversations(&p);
        assert_eq!(cs.len(), 3);
        for c in &cs {
            assert_eq!(c.len(), 4);
            assert!(c.iter().all(|r| r.output_length == 70));
        }
    }
}
