//! vLLM V1 style scheduler: FCFS waiting queue, running set, token budget with chunked
//! prefill, watermark admission, LIFO preemption with full recompute.
//! Source: `engine-model.md` §3, vLLM V1 `Scheduler::schedule`, Dynamo mocker scheduler.

use std::collections::{HashMap, VecDeque};

use super::blocks::{BlockEvent, BlockHash, BlockManager, Slot, extend_block_hashes};
use crate::fasthash::FastHash;

/// Scheduler limits, validated by `EngineCore::new`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    /// Running-set cap, in requests (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Token budget per step, in tokens (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Blocks that must stay free or evictable after an admission
    /// (`⌊watermark × num_gpu_blocks⌋`).
    pub watermark_blocks: usize,
}

/// Cumulative counters, exported as vLLM metrics (`engine-model.md` §7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Tokens looked up in the prefix cache, summed over admissions (resumptions after a
    /// preemption count again, as in vLLM). `vllm:prefix_cache_queries_total`.
    pub prefix_queries_tokens: u64,
    /// Tokens served from the prefix cache, summed over admissions. `vllm:prefix_cache_hits_total`.
    pub prefix_hits_tokens: u64,
    /// Preemptions. `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// Prompt tokens of requests that produced their first token. `vllm:prompt_tokens_total`.
    pub prompt_tokens: u64,
    /// Output tokens produced. `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
}

/// One request inside the engine.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) id: u64,
    /// Prompt followed by the output tokens produced so far.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) max_tokens: u32,
    /// Tokens whose KV is computed (prefix of `tokens`).
    pub(crate) computed: usize,
    /// Chained hashes of the full blocks of `tokens` (`tokens.len() / bs` of them).
    pub(crate) hashes: Vec<BlockHash>,
    /// Leading blocks held as full cached blocks: `hashes[..full_blocks]`.
    pub(crate) full_blocks: usize,
    /// Block-manager slots of those blocks (`full_blocks` of them).
    pub(crate) slots: Vec<Slot>,
    /// Private blocks held (partial tail and blocks allocated for scheduled tokens).
    pub(crate) private_blocks: usize,
    /// Tokens served from cache at the first admission (`cached_tokens` of the response).
    pub(crate) cached_tokens: Option<usize>,
    pub(crate) num_outputs: u32,
}

impl Request {
    pub(crate) fn new(id: u64, mut prompt: Vec<u32>, max_tokens: u32, block_size: usize) -> Self {
        // Room for the outputs up front: growing a long prompt's vectors at the first output
        // token copied them into fresh pages (a visible share of long simulations).
        let total = prompt.len() + max_tokens as usize;
        prompt.reserve_exact(max_tokens as usize);
        let mut hashes = Vec::with_capacity(total / block_size);
        extend_block_hashes(&mut hashes, &prompt, block_size);
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            max_tokens,
            computed: 0,
            hashes,
            full_blocks: 0,
            slots: Vec::new(),
            private_blocks: 0,
            cached_tokens: None,
            num_outputs: 0,
        }
    }

    fn held_blocks(&self) -> usize {
        self.full_blocks + self.private_blocks
    }
}

/// Work for one request in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// Request id.
    pub req_id: u64,
    /// Tokens computed for it this step.
    pub num_tokens: usize,
    /// True for a decode step (one token after its previous output); false for a prefill
    /// chunk (new prompt tokens, or a recompute after preemption).
    pub is_decode: bool,
}

/// Blocks of a request whose cache lookups [`Scheduler::advance`] starts ahead of the one it
/// fills ([`BlockManager::prefetch`]).
const AHEAD: usize = 8;

/// Blocks needed to hold `tokens` tokens.
fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens.div_ceil(bs)
}

/// Scheduler of one engine rank: owns the requests and the [`BlockManager`].
///
/// # Invariants
/// 1. Every request is in exactly one of `waiting`, `running`; `running.len() ≤ max_num_seqs`.
/// 2. Waiting requests hold no blocks and have `computed = 0`.
/// 3. Between steps a running request holds `full_blocks = ⌊computed / bs⌋` full blocks
///    (`hashes[..full_blocks]`) and `⌈computed / bs⌉ − full_blocks` private blocks.
/// 4. Each active block's refcount equals the number of running requests holding it; the
///    block manager's private count is the sum of the requests' private blocks.
/// 5. `hashes.len() = ⌊tokens.len() / bs⌋`; `computed < tokens.len()` for running requests.
/// 6. The block manager's own invariants hold.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    pub(crate) requests: HashMap<u64, Request, FastHash>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    counters: Counters,
    /// Reused buffer for admission lookups.
    scratch: Vec<Slot>,
}

impl Scheduler {
    /// Empty scheduler over `blocks`.
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager) -> Self {
        Self {
            cfg,
            blocks,
            requests: HashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
        }
    }

    /// The block manager (read-only).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// The block manager, for admin operations (reset).
    pub(crate) fn blocks_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }

    /// Cumulative counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Requests in the running set.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests in the waiting queue.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether `req_id` is known (waiting or running).
    pub fn contains(&self, req_id: u64) -> bool {
        self.requests.contains_key(&req_id)
    }

    /// Queues a validated request at the tail of `waiting`.
    pub(crate) fn enqueue(&mut self, req: Request) {
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// Removes `req_id` wherever it is and releases its blocks (tail first). Returns the
    /// request, or `None` if unknown.
    pub(crate) fn remove(&mut self, req_id: u64) -> Option<Request> {
        let mut req = self.requests.remove(&req_id)?;
        if let Some(i) = self.running.iter().position(|&r| r == req_id) {
            self.running.remove(i);
            self.release(&mut req);
        } else if let Some(i) = self.waiting.iter().position(|&r| r == req_id) {
            self.waiting.remove(i);
        }
        Some(req)
    }

    fn release(&mut self, req: &mut Request) {
        self.blocks.release_slots(&req.slots, req.private_blocks);
        req.slots.clear();
        req.full_blocks = 0;
        req.private_blocks = 0;
        req.computed = 0;
    }

    /// Preempts the newest running request (LIFO): its blocks are released (they stay cached,
    /// vLLM V1), progress is reset for a full recompute, and it goes to the head of `waiting`.
    fn preempt_last(&mut self) -> u64 {
        let id = self.running.pop().expect("preempt with empty running set");
        let mut req = self.requests.remove(&id).expect("running request exists");
        self.release(&mut req);
        self.requests.insert(id, req);
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
        id
    }

    /// Plans one step (`engine-model.md` §3 steps 1–3): running requests first (decode 1
    /// token or the next prefill chunk, preempting LIFO when blocks run out), then admissions
    /// from `waiting` in FCFS order under the budget, the running cap and the watermark.
    /// Allocates the blocks the planned tokens need; evictions are appended to `events`.
    pub fn schedule(&mut self, events: &mut Vec<BlockEvent>) -> Vec<Scheduled> {
        let bs = self.blocks.block_size();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut out = Vec::new();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let remaining = req.tokens.len() - req.computed;
            let is_decode = remaining == 1 && req.num_outputs > 0;
            let n = remaining.min(budget);
            let need = blocks_for(req.computed + n, bs).saturating_sub(req.held_blocks());
            let mut self_preempted = false;
            while self.blocks.allocate_private(need, events).is_err() {
                preempted = true;
                if self.preempt_last() == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            self.requests.get_mut(&id).expect("running").private_blocks += need;
            out.push(Scheduled {
                req_id: id,
                num_tokens: n,
                is_decode,
            });
            budget -= n;
            i += 1;
        }

        // vLLM V1 admits nothing in a step that preempted.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let req = &self.requests[&id];
            let len = req.tokens.len();
            let mut slots = std::mem::take(&mut self.scratch);
            self.blocks
                .lookup_prefix_slots(&req.hashes, len, &mut slots);
            let hit = slots.len();
            let cached = hit * bs;
            let n = (len - cached).min(budget);
            let new_blocks = blocks_for(cached + n, bs) - hit;
            let taken_inactive = self.blocks.count_inactive_slots(&slots);
            let need = taken_inactive + new_blocks + self.cfg.watermark_blocks;
            if self.blocks.num_available() < need {
                self.scratch = slots;
                break; // strict FCFS: head-of-line blocking
            }
            self.blocks.take_slots(&slots);
            self.blocks
                .allocate_private(new_blocks, events)
                .expect("checked against num_available");
            let req = self.requests.get_mut(&id).expect("waiting");
            req.full_blocks = hit;
            self.scratch = std::mem::replace(&mut req.slots, slots);
            let total_blocks = req.hashes.capacity().max(req.hashes.len());
            req.slots
                .reserve(total_blocks.saturating_sub(req.slots.len()));
            req.private_blocks = new_blocks;
            req.computed = cached;
            req.cached_tokens.get_or_insert(cached);
            let is_decode = len - cached == 1 && req.num_outputs > 0;
            self.counters.prefix_queries_tokens += len as u64;
            self.counters.prefix_hits_tokens += cached as u64;
            self.waiting.pop_front();
            self.running.push(id);
            out.push(Scheduled {
                req_id: id,
                num_tokens: n,
                is_decode,
            });
            budget -= n;
        }
        out
    }

    /// Applies a planned step's computation to `req_id` (`engine-model.md` §3 step 4):
    /// `computed += num_tokens`; blocks that became full get their hash and enter the cache
    /// (merged when already cached); each run of newly stored consecutive blocks is reported as
    /// one [`BlockEvent::Stored`]. Returns true when all known tokens are computed, i.e. the
    /// request samples a token now.
    pub(crate) fn advance(&mut self, s: Scheduled, events: &mut Vec<BlockEvent>) -> bool {
        let bs = self.blocks.block_size();
        let req = self.requests.get_mut(&s.req_id).expect("scheduled request");
        req.computed += s.num_tokens;
        let full = req.computed / bs;
        let mut run: Option<(Option<BlockHash>, Vec<BlockHash>, Vec<u32>)> = None;
        // The blocks' cache lookups are memory accesses: start them a few blocks ahead.
        for &h in &req.hashes[req.full_blocks.min(full)..full.min(req.full_blocks + AHEAD)] {
            self.blocks.prefetch(h);
        }
        while req.full_blocks < full {
            let idx = req.full_blocks;
            if let Some(&next) = req.hashes[..full].get(idx + AHEAD) {
                self.blocks.prefetch(next);
            }
            let h = req.hashes[idx];
            req.private_blocks -= 1;
            req.full_blocks += 1;
            let (slot, stored) = self.blocks.fill_private_slot(h);
            req.slots.push(slot);
            if stored {
                let r = run.get_or_insert_with(|| {
                    (
                        idx.checked_sub(1).map(|p| req.hashes[p]),
                        Vec::new(),
                        Vec::new(),
                    )
                });
                r.1.push(h);
                r.2.extend_from_slice(&req.tokens[idx * bs..(idx + 1) * bs]);
            } else if let Some((parent, hashes, token_ids)) = run.take() {
                events.push(BlockEvent::Stored {
                    parent,
                    hashes,
                    token_ids,
                });
            }
        }
        if let Some((parent, hashes, token_ids)) = run {
            events.push(BlockEvent::Stored {
                parent,
                hashes,
                token_ids,
            });
        }
        req.computed == req.tokens.len()
    }

    /// Appends a sampled output token to `req_id` and updates counters. Returns true when the
    /// request reached `max_tokens`; it is then removed and its blocks released.
    pub(crate) fn append_output(&mut self, req_id: u64, token: u32) -> bool {
        let bs = self.blocks.block_size();
        let req = self.requests.get_mut(&req_id).expect("scheduled request");
        if req.num_outputs == 0 {
            self.counters.prompt_tokens += req.prompt_len as u64;
        }
        self.counters.generation_tokens += 1;
        req.tokens.push(token);
        req.num_outputs += 1;
        extend_block_hashes(&mut req.hashes, &req.tokens, bs);
        let done = req.num_outputs >= req.max_tokens;
        if done {
            self.remove(req_id);
        }
        done
    }

    /// Checks invariants 1–6; the error names the broken one.
    #[cfg(test)]
    pub fn check_invariants(&self) -> Result<(), String> {
        use std::collections::HashSet;
        let bs = self.blocks.block_size();
        let w: HashSet<u64> = self.waiting.iter().copied().collect();
        let r: HashSet<u64> = self.running.iter().copied().collect();
        if w.len() != self.waiting.len()
            || r.len() != self.running.len()
            || !w.is_disjoint(&r)
            || w.len() + r.len() != self.requests.len()
            || self
                .requests
                .keys()
                .any(|k| !w.contains(k) && !r.contains(k))
            || self.running.len() > self.cfg.max_num_seqs
        {
            return Err("1: waiting/running partition broken".into());
        }
        for id in &self.waiting {
            let q = &self.requests[id];
            if q.held_blocks() > 0 || q.computed > 0 {
                return Err(format!("2: waiting request {id} holds blocks"));
            }
        }
        let mut refs: HashMap<BlockHash, u32> = HashMap::new();
        let mut private = 0;
        for id in &self.running {
            let q = &self.requests[id];
            if q.full_blocks != q.computed / bs || q.held_blocks() != blocks_for(q.computed, bs) {
                return Err(format!(
                    "3: request {id} computed {} holds {} full + {} private",
                    q.computed, q.full_blocks, q.private_blocks
                ));
            }
            if q.slots.len() != q.full_blocks {
                return Err(format!(
                    "3: request {id} holds {} slots for {} full blocks",
                    q.slots.len(),
                    q.full_blocks
                ));
            }
            for h in &q.hashes[..q.full_blocks] {
                *refs.entry(*h).or_default() += 1;
            }
            private += q.private_blocks;
            if q.computed >= q.tokens.len() {
                return Err(format!("5: running request {id} has nothing to compute"));
            }
        }
        for q in self.requests.values() {
            if q.hashes.len() != q.tokens.len() / bs {
                return Err(format!("5: request {} hashes out of date", q.id));
            }
        }
        if private + refs.len() != self.blocks.num_used() {
            return Err(format!(
                "4: requests hold {private} private + {} full, manager counts {} used",
                refs.len(),
                self.blocks.num_used()
            ));
        }
        for (h, n) in &refs {
            if self.blocks.refcount(*h) != *n {
                return Err(format!(
                    "4: block {h:#x} held by {n} requests, refcount {}",
                    self.blocks.refcount(*h)
                ));
            }
        }
        self.blocks.check_invariants().map_err(|e| format!("6.{e}"))
    }
}
