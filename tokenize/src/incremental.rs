//! [`IncrementalTokenizer`]: exact tokenization whose cost grows with the new part of a prompt.
//!
//! Agents resend the whole conversation every turn. The rendered prompt of turn N+1 starts
//! with the rendered prompt of turn N up to its generation prompt (`<|im_start|>assistant\n`
//! for Qwen3), so the ids of that prefix can be reused and only the new messages tokenized.
//!
//! The prompt is cut only where [`Tokenizer::cut_points`] allows: at the start of a special
//! token the chat template writes, with no added token across the cut. The HF pipeline splits
//! on added tokens before normalizing, pre-tokenizing and merging, so the ids of the pieces
//! concatenate to the ids of the whole: no BPE merge crosses such a cut (a cut inside plain
//! text would be the trap: `" hel" + "lo"` ≠ `" hello"`).
//!
//! Per prompt: one render (done by the caller), one xxh3 pass over the text that yields the
//! hash of every prefix ending at a cut, a lookup per cut from the last one back, and the
//! tokenization of the text after the longest cached prefix. The last [`ENTRIES_PER_PROMPT`]
//! cuts of every prompt are then cached, all sharing one id buffer.
//!
//! One instance per shard (`&mut self`, no locks). The cache is a bounded LRU keyed by
//! `xxh3(prefix bytes, seed = namespace)`; its budget counts the tokens of the id buffers it
//! holds (each buffer once).

use crate::{TokenizeError, Tokenizer};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use xxhash_rust::xxh3::Xxh3;

/// Default budget of one shard's prefix cache, tokens held in id buffers (4 bytes each:
/// 8 Mi tokens = 32 MiB). Sized for ~80 concurrent 100k-token agent conversations per shard
/// (WEKA traces: median input ~110k tokens, traces.md §2).
pub const DEFAULT_CACHE_TOKENS: usize = 8 * 1024 * 1024;

/// Cuts cached per prompt, counted from its end: the generation-prompt start (what the next
/// turn reuses) and the message boundaries just before it (reused when a client edits or
/// drops the last message, or when a template renders `<think>` after the last cut).
pub const ENTRIES_PER_PROMPT: usize = 3;

/// Result of [`IncrementalTokenizer::encode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids of the whole text, equal to [`Tokenizer::encode`] of it.
    pub ids: Vec<u32>,
    /// Leading ids taken from the cache (0 on a miss), tokens.
    pub reused_tokens: usize,
}

/// Counters of one [`IncrementalTokenizer`] since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IncrementalStats {
    /// Prompts encoded.
    pub prompts: u64,
    /// Prompts that reused a cached prefix.
    pub hits: u64,
    /// Ids taken from the cache, tokens.
    pub reused_tokens: u64,
    /// Ids produced by the tokenizer, tokens.
    pub encoded_tokens: u64,
    /// Cache entries evicted for the budget.
    pub evictions: u64,
}

/// A cached prefix: `tokens` leading ids of buffer `buf` are the ids of a `bytes`-long text.
#[derive(Debug, Clone, Copy)]
struct Entry {
    buf: u64,
    tokens: usize,
    bytes: usize,
    tick: u64,
}

/// A tokenizer plus a per-shard LRU of prefix ids. See the module doc.
///
/// # Invariants
/// 1. `order` holds exactly one `(tick, key)` per entry of `entries`, with the entry's tick.
/// 2. Every entry's buffer is in `buffers`, whose refcount is the number of entries using it;
///    no buffer has refcount 0.
/// 3. `held_tokens` is the sum of the lengths of the buffers in `buffers`, and is at most
///    `budget_tokens` between calls.
/// 4. An entry's `tokens` is at most its buffer's length.
#[derive(Debug)]
pub struct IncrementalTokenizer {
    tok: Tokenizer,
    budget_tokens: usize,
    entries: HashMap<u64, Entry>,
    order: BTreeMap<u64, u64>,
    buffers: HashMap<u64, (Arc<Vec<u32>>, usize)>,
    held_tokens: usize,
    next_tick: u64,
    next_buf: u64,
    stats: IncrementalStats,
}

impl IncrementalTokenizer {
    /// An empty cache over `tok` holding at most `budget_tokens` ids (0 disables caching).
    pub fn new(tok: Tokenizer, budget_tokens: usize) -> Self {
        Self {
            tok,
            budget_tokens,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            buffers: HashMap::new(),
            held_tokens: 0,
            next_tick: 0,
            next_buf: 0,
            stats: IncrementalStats::default(),
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Counters since creation.
    pub fn stats(&self) -> IncrementalStats {
        self.stats
    }

    /// Ids held by the cache now, tokens (≤ the budget).
    pub fn held_tokens(&self) -> usize {
        self.held_tokens
    }

    /// Token ids of `text` (a rendered prompt), exactly as [`Tokenizer::try_encode`] gives
    /// them, reusing the ids of the longest cached prefix of `text` that ends at a cut point
    /// and was cached under the same `namespace`. Caches the last [`ENTRIES_PER_PROMPT`] cuts
    /// of `text`.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails on a piece.
    pub fn encode(&mut self, text: &str, namespace: u64) -> Result<Encoded, TokenizeError> {
        self.stats.prompts += 1;
        let cuts = self.tok.cut_points(text);
        // Hash of every prefix text[..cut]: one streaming pass.
        let mut hasher = Xxh3::with_seed(namespace);
        let mut hashes = Vec::with_capacity(cuts.len());
        let mut from = 0;
        for &p in &cuts {
            hasher.update(&text.as_bytes()[from..p]);
            hashes.push(hasher.digest());
            from = p;
        }
        // Longest cached prefix.
        let mut start = 0; // bytes already covered
        let mut first_cut = 0; // index of the first cut after `start`
        let mut ids = Vec::new();
        for i in (0..cuts.len()).rev() {
            if let Some(e) = self.entries.get(&hashes[i]).copied()
                && e.bytes == cuts[i]
            {
                let buf = &self.buffers[&e.buf].0;
                ids.reserve(e.tokens + (text.len() - e.bytes) / 3);
                ids.extend_from_slice(&buf[..e.tokens]);
                self.touch(hashes[i]);
                start = e.bytes;
                first_cut = i + 1;
                break;
            }
        }
        let reused = ids.len();
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.reused_tokens += reused as u64;
        }
        // Tokenize the rest piece by piece, noting the id count at each cut.
        let mut at_cut = Vec::with_capacity(cuts.len() - first_cut);
        let mut from = start;
        for &p in &cuts[first_cut..] {
            self.push_piece(&text[from..p], &mut ids)?;
            at_cut.push(ids.len());
            from = p;
        }
        self.push_piece(&text[from..], &mut ids)?;
        self.stats.encoded_tokens += (ids.len() - reused) as u64;
        // Cache the last cuts (new ones only), sharing one buffer.
        let new_cuts = cuts.len() - first_cut;
        let keep = new_cuts.min(ENTRIES_PER_PROMPT);
        if keep > 0 && self.budget_tokens > 0 {
            let buf_id = self.next_buf;
            self.next_buf += 1;
            let last_tokens = at_cut[new_cuts - 1];
            let buf = Arc::new(ids[..last_tokens].to_vec());
            self.held_tokens += buf.len();
            self.buffers.insert(buf_id, (buf, 0));
            let from = new_cuts - keep;
            for (j, &tokens) in at_cut.iter().enumerate().skip(from) {
                let i = first_cut + j;
                self.insert(
                    hashes[i],
                    Entry {
                        buf: buf_id,
                        tokens,
                        bytes: cuts[i],
                        tick: 0,
                    },
                );
            }
            self.evict_to_budget();
        }
        Ok(Encoded {
            ids,
            reused_tokens: reused,
        })
    }

    fn push_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if !piece.is_empty() {
            ids.extend(self.tok.try_encode(piece)?);
        }
        Ok(())
    }

    fn touch(&mut self, key: u64) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, key);
        }
    }

    fn insert(&mut self, key: u64, mut entry: Entry) {
        self.remove(key);
        entry.tick = self.next_tick;
        self.next_tick += 1;
        self.order.insert(entry.tick, key);
        if let Some(b) = self.buffers.get_mut(&entry.buf) {
            b.1 += 1;
        }
        self.entries.insert(key, entry);
    }

    fn remove(&mut self, key: u64) {
        if let Some(e) = self.entries.remove(&key) {
            self.order.remove(&e.tick);
            let b = self.buffers.get_mut(&e.buf).expect("invariant 2");
            b.1 -= 1;
            if b.1 == 0 {
                self.held_tokens -= b.0.len();
                self.buffers.remove(&e.buf);
            }
        }
    }

    /// Drops least recently used entries until the held buffers fit the budget (and buffers
    /// no entry uses, e.g. one whose entries were all replaced).
    fn evict_to_budget(&mut self) {
        let orphans: Vec<u64> = self
            .buffers
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            let (b, _) = self.buffers.remove(&id).expect("listed");
            self.held_tokens -= b.len();
        }
        while self.held_tokens > self.budget_tokens {
            let Some((_, &key)) = self.order.first_key_value() else {
                break;
            };
            self.remove(key);
            self.stats.evictions += 1;
        }
    }

    /// Checks the numbered invariants; names the first broken one. Tests only.
    #[cfg(test)]
    fn check_invariants(&self) -> Result<(), String> {
        if self.order.len() != self.entries.len()
            || self
                .order
                .iter()
                .any(|(t, k)| self.entries.get(k).is_none_or(|e| e.tick != *t))
        {
            return Err("1: order and entries disagree".into());
        }
        let mut refs: HashMap<u64, usize> = HashMap::new();
        for e in self.entries.values() {
            *refs.entry(e.buf).or_default() += 1;
        }
        if self.buffers.len() != refs.len()
            || self
                .buffers
                .iter()
                .any(|(id, (_, r))| refs.get(id) != Some(r))
        {
            return Err("2: buffer refcounts".into());
        }
        let held: usize = self.buffers.values().map(|(b, _)| b.len()).sum();
        if held != self.held_tokens || held > self.budget_tokens {
            return Err(format!(
                "3: held {held}, counted {}, budget {}",
                self.held_tokens, self.budget_tokens
            ));
        }
        if self
            .entries
            .values()
            .any(|e| e.tokens > self.buffers[&e.buf].0.len())
        {
            return Err("4: entry longer than its buffer".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use crate::tokenizer::test_qwen as qwen;

    #[test]
    fn cut_points_are_special_token_starts() {
        let t = qwen();
        let text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(t.cut_points(text), vec![19, 30]);
        // Cutting inside plain text would break a merge; there is no cut there.
        assert!(t.cut_points("hello world").is_empty());
        assert_ne!(
            [t.encode(" hel"), t.encode("lo")].concat(),
            t.encode(" hello")
        );
        assert_eq!(t.encode(" hello"), vec![23811]);
    }

    #[test]
    fn second_turn_reuses_first() {
        let t = qwen();
        let mut inc = IncrementalTokenizer::new(t.clone(), 1 << 20);
        let mut msgs = vec![
            json!({"role": "system", "content": "You are terse."}),
            json!({"role": "user", "content": "Sort [3, 1, 2] in Python."}),
        ];
        let p1 = t.render_chat(&Value::Array(msgs.clone()), true).unwrap();
        let e1 = inc.encode(&p1, 0).unwrap();
        assert_eq!((e1.ids.clone(), e1.reused_tokens), (t.encode(&p1), 0));
        msgs.push(json!({"role": "assistant", "content": "sorted([3, 1, 2])"}));
        msgs.push(json!({"role": "user", "content": "Thanks!"}));
        let p2 = t.render_chat(&Value::Array(msgs), true).unwrap();
        let e2 = inc.encode(&p2, 0).unwrap();
        assert_eq!(e2.ids, t.encode(&p2));
        // Everything before turn 1's generation prompt `<|im_start|>assistant\n` is reused.
        assert_eq!(e2.reused_tokens, e1.ids.len() - 3);
        // Another namespace does not see it.
        let e3 = inc.encode(&p2, 42).unwrap();
        assert_eq!((e3.ids, e3.reused_tokens), (t.encode(&p2), 0));
        inc.check_invariants().unwrap();
        assert_eq!(inc.stats().hits, 1);
    }

    #[test]
    fn budget_is_respected() {
        let t = qwen();
        let mut inc = IncrementalTokenizer::new(t.clone(), 200);
        for i in 0..50 {
            let text = format!(
                "<|im_start|>user\nmessage number {i} with some words<|im_end|>\n<|im_start|>assistant\n"
            );
            assert_eq!(inc.encode(&text, 0).unwrap().ids, t.encode(&text));
            inc.check_invariants().unwrap();
        }
        assert!(inc.held_tokens() <= 200);
        assert!(inc.stats().evictions > 0);
        let mut off = IncrementalTokenizer::new(t.clone(), 0);
        let text = "<|im_start|>user\nx<|im_end|>\n";
        off.encode(text, 0).unwrap();
        assert_eq!(off.encode(text, 0).unwrap().reused_tokens, 0);
    }

    /// Content pieces that stress the BPE and the pre-tokenizer around message boundaries:
    /// leading/trailing spaces and newlines, digits, punctuation, code, CJK, emoji, combining
    /// marks, and spelled special tokens inside content.
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{1,10}",
            " [a-z]{1,8}",
            "[ \n\t]{1,3}",
            "[0-9]{1,7}",
            "[.,;:!?()\\[\\]{}\"'`<>/|=+*-]{1,3}",
            Just("café".to_string()),
            Just("e\u{301}".to_string()),
            Just("中文字".to_string()),
            Just("😀".to_string()),
            Just("<|im_end|>".to_string()),
            Just("<|im_start|>".to_string()),
            Just("<think>".to_string()),
            Just("</tool_call>".to_string()),
            Just("<|im".to_string()),
            Just("def f(x):\n    return x\n".to_string()),
        ]
    }

    fn content(max_pieces: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(piece(), 0..max_pieces).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Incremental ids equal full-tokenization ids at every turn of random multi-turn chats
        /// (system prompt, users, assistants with and without `<think>`, tool calls and tool
        /// results), across two interleaved conversations sharing a cache.
        #[test]
        fn incremental_equals_full(
            system in content(12),
            turns in prop::collection::vec((content(10), content(10), 0u8..4), 1..7),
            budget in prop_oneof![Just(0usize), Just(64usize), Just(1usize << 20)],
        ) {
            let t = qwen();
            let mut inc = IncrementalTokenizer::new(t.clone(), budget);
            let mut a = vec![json!({"role": "system", "content": system})];
            let mut b = vec![json!({"role": "system", "content": system})];
            for (user, reply, kind) in turns {
                for (conv, ns) in [(&mut a, 0u64), (&mut b, 7u64)] {
                    conv.push(json!({"role": "user", "content": user}));
                    let prompt = t.render_chat(&Value::Array(conv.clone()), true).unwrap();
                    let got = inc.encode(&prompt, ns).unwrap();
                    prop_assert_eq!(&got.ids, &t.encode(&prompt), "prompt {:?}", prompt);
                    inc.check_invariants().map_err(TestCaseError::fail)?;
                    let assistant = match kind {
                        0 => json!({"role": "assistant", "content": reply}),
                        1 => json!({"role": "assistant", "content": format!("<think>\n{reply}\n</think>\n\n{user}")}),
                        2 => json!({"role": "assistant", "content": reply,
                                    "tool_calls": [{"function": {"name": "run", "arguments": {"cmd": reply}}}]}),
                        _ => json!({"role": "tool", "content": reply}),
                    };
                    conv.push(assistant);
                }
            }
        }
    }
}
