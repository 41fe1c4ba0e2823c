//! [`IncrementalTokenizer`]: exact tokenization whose cost grows with the new part of a prompt.
//!
//! Agents resend the whole conversation every turn, and replayed traces (Mooncake) send each
//! turn as one message whose text is the previous turn's text plus new text. Either way the
//! prompt of turn N+1 starts with most of the prompt of turn N, so the ids of that prefix can
//! be reused and only the rest tokenized.
//!
//! A prompt is cut only where the ids of the pieces provably concatenate to the ids of the
//! whole (a cut anywhere else is the trap: `" hel" + "lo"` ≠ `" hello"`):
//! - template cuts ([`Tokenizer::cut_points`]): the start of a special token the chat template
//!   writes (message boundaries), with no added token across the cut;
//! - text cuts ([`Tokenizer::is_text_cut`]): between an ASCII letter and an ASCII non-letter
//!   (`"…abc| def"`, `"…abc|\n"`), only for pipelines recognised at load time (byte-level BPE,
//!   NFC, a known split regex; see there for the proof), and each one used is also checked on
//!   the running pipeline ([`Tokenizer::verify_text_cut`]).
//!
//! Text cuts are too dense to hash every one (one per word), so only *anchors* are used: a
//! content-defined subset chosen left to right from the text alone ([`ANCHOR_MIN_GAP`],
//! [`ANCHOR_SELECT_BITS`], [`ANCHOR_MAX_GAP`]), so two prompts sharing a prefix share its
//! anchors, about one per few hundred bytes.
//!
//! Per prompt: one render (done by the caller), one scan for anchors, one xxh3 pass over the
//! text that yields the hash of every prefix ending at a template cut or an anchor, at most
//! [`MAX_PROBES`] lookups from the last cut back, and the tokenization of the text after the
//! longest cached prefix. Cached then, all sharing one id buffer: the last
//! [`ENTRIES_PER_PROMPT`] new template cuts, the last [`TAIL_ANCHORS`] anchors, every
//! [`COARSE_EVERY`]-th anchor, and the still-cached entries of the reused prefix (moved to
//! the new buffer so the previous turn's buffer can be freed).
//!
//! One tokenizer per shard (`&mut self`); the cache ([`PrefixCache`]) is one per model, shared
//! by the shards behind a mutex held only to look up / copy and to insert ids, never while
//! tokenizing: with one cache per shard a conversation whose next turn arrives on another
//! connection (another core) reused nothing. The cache is a bounded LRU keyed by
//! `xxh3(prefix bytes, seed = namespace)`; its budget counts the tokens of the id buffers it
//! holds (each buffer once).

use crate::{TokenizeError, Tokenizer};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::Xxh3;

/// Default budget of one model's prefix cache (shared by all shards), tokens held in id
/// buffers (4 bytes each: 8 Mi tokens = 32 MiB). Sized for ~80 concurrent 100k-token agent
/// conversations
/// (WEKA traces: median input ~110k tokens, traces.md §2).
pub const DEFAULT_CACHE_TOKENS: usize = 8 * 1024 * 1024;

/// Template cuts cached per prompt, counted from its end: the generation-prompt start (what
/// the next turn reuses) and the message boundaries just before it (reused when a client edits
/// or drops the last message, or when a template renders `<think>` after the last cut).
pub const ENTRIES_PER_PROMPT: usize = 3;

/// Text anchors cached per prompt, counted from its end: the last one inside the content is
/// what a grown single-message prompt reuses (the ~300 bytes after it are re-tokenized), the
/// ones before it cover an edit of the last few hundred bytes. Three, because a chat
/// template's tail can hold two anchors the next turn does not share (`"…word|<|im_end|>"`,
/// `"assistant|\n"`).
pub const TAIL_ANCHORS: usize = 3;

/// Every `COARSE_EVERY`-th anchor of a prompt (counted from its start) is cached too: one per
/// ~4.6 KiB (~650 tokens) of text, so prompts sharing a long prefix but not each other's tail
/// (other conversations over the same document, a regenerated earlier turn) reuse all but at
/// most that much of it. Measured on a 16k-token single-message Qwen3 prompt of vocabulary
/// words: 410 anchors, 25 coarse, 30 cache entries after a miss.
pub const COARSE_EVERY: usize = 16;

/// No anchor within this many bytes after the previous one (or the text start): bounds the
/// anchors of repetitive text (e.g. one word repeated) to one per 64 bytes.
pub const ANCHOR_MIN_GAP: usize = 64;

/// A text-cut candidate at least this many bytes after the previous anchor is always an
/// anchor, so text whose 8-byte windows never select (e.g. one word repeated) still has one
/// per ~1 KiB when it has text cuts at all.
pub const ANCHOR_MAX_GAP: usize = 1024;

/// A text-cut candidate (past [`ANCHOR_MIN_GAP`]) is an anchor when the top
/// `ANCHOR_SELECT_BITS` bits of a mix of the 8 bytes before it are zero: 1 in 32 candidates.
/// With one candidate per word (~7 bytes) anchors are ~64 + 32 × 7 ≈ 290 bytes apart
/// (measured: 290 bytes, 40 tokens on Qwen3 vocabulary-word text): a hit re-tokenizes up to
/// that much of the old tail, and a 16k-token prompt has ~400 anchors to hash (the scan,
/// anchors and hashes cost ~0.15 ms per 120 KB, ~0.3 % of encoding it).
pub const ANCHOR_SELECT_BITS: u32 = 5;

/// At most this many cache lookups per prompt, from its last cut back (a miss costs at most
/// this many hash-map probes, ~20–50 ns each). 1,024 anchors are ~300 KiB of new text: a
/// prompt that grew by more than that since its cached prefix is tokenized in full.
pub const MAX_PROBES: usize = 1024;

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
    /// Hits whose reused prefix ended at a text cut (inside a message), a subset of `hits`.
    pub text_hits: u64,
    /// Text cuts that passed the byte rule but failed [`Tokenizer::verify_text_cut`] and were
    /// not used (0 unless the pipeline was misclassified; then it stays exact, just slower).
    pub rejected_text_cuts: u64,
}

/// One place a prompt may be cut, with why ([`CUT_TEMPLATE`], [`CUT_TEXT`], [`CUT_COARSE`]).
#[derive(Debug, Clone, Copy)]
struct Cut {
    pos: usize,
    kind: u8,
}

/// Start of a template special token ([`Tokenizer::cut_points`]).
const CUT_TEMPLATE: u8 = 1;
/// A text anchor ([`Tokenizer::is_text_cut`] holds there).
const CUT_TEXT: u8 = 2;
/// A text anchor whose index is `≡ COARSE_EVERY − 1`.
const CUT_COARSE: u8 = 4;

/// A cached prefix: `tokens` leading ids of buffer `buf` are the ids of a `bytes`-long text.
#[derive(Debug, Clone, Copy)]
struct Entry {
    buf: u64,
    tokens: usize,
    bytes: usize,
    tick: u64,
}

/// The LRU of prefix ids behind one or more [`IncrementalTokenizer`]s: one per model, shared
/// by every shard's tokenizer through [`SharedPrefixCache`], so turn N+1 of a conversation
/// reuses turn N's ids whichever shard (core) its connection lands on.
///
/// # Invariants
/// 1. `order` holds exactly one `(tick, key)` per entry of `entries`, with the entry's tick.
/// 2. Every entry's buffer is in `buffers`, whose refcount is the number of entries using it;
///    no buffer has refcount 0.
/// 3. `held_tokens` is the sum of the lengths of the buffers in `buffers`, and is at most
///    `budget_tokens` between calls.
/// 4. An entry's `tokens` is at most its buffer's length.
#[derive(Debug)]
pub struct PrefixCache {
    budget_tokens: usize,
    entries: HashMap<u64, Entry>,
    order: BTreeMap<u64, u64>,
    buffers: HashMap<u64, (Arc<Vec<u32>>, usize)>,
    held_tokens: usize,
    next_tick: u64,
    next_buf: u64,
    evictions: u64,
}

/// A [`PrefixCache`] shared by the shards' tokenizers. The lock is held only to look up and
/// copy a cached prefix's ids (a memcpy, ~5 µs for 16k ids) and to insert a prompt's cuts,
/// never while tokenizing (milliseconds), so shards do not wait on each other's encodes.
pub type SharedPrefixCache = Arc<Mutex<PrefixCache>>;

/// Locks `cache`. A panic while it was held (none is expected: the updates do not panic
/// between a count and its structure) does not disable caching: the lock is taken over.
fn lock_cache(cache: &SharedPrefixCache) -> std::sync::MutexGuard<'_, PrefixCache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

/// A tokenizer plus a prefix cache (its own, or one shared with other shards). See the module
/// doc.
#[derive(Debug)]
pub struct IncrementalTokenizer {
    tok: Tokenizer,
    cache: SharedPrefixCache,
    /// The cache's budget is not 0 (read once: a budget never changes), so a request takes
    /// the cache lock only to look up and to insert.
    caching: bool,
    stats: IncrementalStats,
}

impl PrefixCache {
    /// An empty cache holding at most `budget_tokens` ids (0 disables caching).
    pub fn new(budget_tokens: usize) -> Self {
        Self {
            budget_tokens,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            buffers: HashMap::new(),
            held_tokens: 0,
            next_tick: 0,
            next_buf: 0,
            evictions: 0,
        }
    }

    /// [`Self::new`] wrapped for sharing between shards.
    pub fn shared(budget_tokens: usize) -> SharedPrefixCache {
        Arc::new(Mutex::new(Self::new(budget_tokens)))
    }

    /// Ids held now, tokens (≤ the budget).
    pub fn held_tokens(&self) -> usize {
        self.held_tokens
    }
}

impl IncrementalTokenizer {
    /// `tok` with its own empty cache of at most `budget_tokens` ids (0 disables caching).
    pub fn new(tok: Tokenizer, budget_tokens: usize) -> Self {
        Self::with_cache(tok, PrefixCache::shared(budget_tokens))
    }

    /// `tok` over `cache`, which other tokenizers (of other shards) may share.
    pub fn with_cache(tok: Tokenizer, cache: SharedPrefixCache) -> Self {
        let caching = lock_cache(&cache).budget_tokens > 0;
        Self {
            tok,
            cache,
            caching,
            stats: IncrementalStats::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        lock_cache(&self.cache)
    }

    /// Identity of the prefix cache behind this tokenizer: equal for the tokenizers of one
    /// model on every shard ([`SharedPrefixCache`]), distinct between models.
    pub fn cache_id(&self) -> usize {
        Arc::as_ptr(&self.cache) as usize
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Counters of this tokenizer since creation (`evictions`: of its cache, by every
    /// tokenizer sharing it).
    pub fn stats(&self) -> IncrementalStats {
        IncrementalStats {
            evictions: self.lock().evictions,
            ..self.stats
        }
    }

    /// Ids held by the cache now, tokens (≤ the budget).
    pub fn held_tokens(&self) -> usize {
        self.lock().held_tokens
    }

    /// Token ids of `text` (a rendered prompt), exactly as [`Tokenizer::try_encode`] gives
    /// them, reusing the ids of the longest cached prefix of `text` that ends at a template cut
    /// or a text anchor (see the module doc) and was cached under the same `namespace`
    /// (looking at most [`MAX_PROBES`] cuts back from the end). Caches the cuts the module
    /// doc lists.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails on a piece.
    pub fn encode(&mut self, text: &str, namespace: u64) -> Result<Encoded, TokenizeError> {
        self.stats.prompts += 1;
        if !self.caching {
            let ids = self.tok.try_encode(text)?;
            self.stats.encoded_tokens += ids.len() as u64;
            return Ok(Encoded {
                ids,
                reused_tokens: 0,
            });
        }
        let cuts = self.cuts(text);
        // Hash of every prefix text[..cut]: one streaming pass.
        let mut hasher = Xxh3::with_seed(namespace);
        let mut hashes = Vec::with_capacity(cuts.len());
        let mut from = 0;
        for c in &cuts {
            hasher.update(&text.as_bytes()[from..c.pos]);
            hashes.push(hasher.digest());
            from = c.pos;
        }
        // Longest cached prefix, at most MAX_PROBES lookups back.
        let mut start = 0; // bytes already covered
        let mut first_new = 0; // index of the first cut after `start`
        let mut ids = Vec::new();
        let mut cache = lock_cache(&self.cache);
        for i in (0..cuts.len()).rev().take(MAX_PROBES) {
            let Some(e) = cache.entries.get(&hashes[i]).copied() else {
                continue;
            };
            if e.bytes != cuts[i].pos {
                continue;
            }
            let text_only = cuts[i].kind & CUT_TEMPLATE == 0;
            if text_only && !self.tok.verify_text_cut(text, cuts[i].pos) {
                self.stats.rejected_text_cuts += 1;
                continue;
            }
            let buf = &cache.buffers[&e.buf].0;
            ids.reserve(e.tokens + (text.len() - e.bytes) / 3);
            ids.extend_from_slice(&buf[..e.tokens]);
            cache.touch(hashes[i]);
            start = e.bytes;
            first_new = i + 1;
            if text_only {
                self.stats.text_hits += 1;
            }
            break;
        }
        drop(cache);
        let reused = ids.len();
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.reused_tokens += reused as u64;
        }
        // New cuts to cache: the last template cuts, the tail and coarse anchors (each text
        // cut checked on the pipeline before it is used as a piece boundary).
        let mut keep = vec![false; cuts.len()];
        let mut templates = 0;
        let mut tail = 0;
        for i in (0..cuts.len()).rev() {
            let k = cuts[i].kind;
            let mut want = false;
            if k & CUT_TEMPLATE != 0 && i >= first_new && templates < ENTRIES_PER_PROMPT {
                templates += 1;
                want = true;
            }
            if k & CUT_TEXT != 0 {
                want |= i >= first_new && (tail < TAIL_ANCHORS || k & CUT_COARSE != 0);
                tail += 1;
            }
            if want && k & CUT_TEMPLATE == 0 && !self.tok.verify_text_cut(text, cuts[i].pos) {
                self.stats.rejected_text_cuts += 1;
                want = false;
            }
            keep[i] = want;
        }
        // Tokenize the rest piece by piece, split at the kept cuts, noting the id counts.
        let mut at_cut = vec![0; cuts.len()];
        let mut from = start;
        for i in first_new..cuts.len() {
            if keep[i] {
                self.push_piece(&text[from..cuts[i].pos], &mut ids)?;
                at_cut[i] = ids.len();
                from = cuts[i].pos;
            }
        }
        self.push_piece(&text[from..], &mut ids)?;
        self.stats.encoded_tokens += (ids.len() - reused) as u64;
        // Entries of the reused prefix still cached move to the new buffer (its ids start with
        // theirs: the prefix ids are encode(prefix) and each such cut is a cut of `text`).
        let new_entries = keep.iter().filter(|&&k| k).count();
        if new_entries > 0 {
            let mut cache = lock_cache(&self.cache);
            for i in 0..first_new {
                if let Some(e) = cache.entries.get(&hashes[i])
                    && e.bytes == cuts[i].pos
                    && e.tokens <= reused
                {
                    at_cut[i] = e.tokens;
                    keep[i] = true;
                }
            }
            let buf_id = cache.next_buf;
            cache.next_buf += 1;
            let len = (0..cuts.len())
                .filter(|&i| keep[i])
                .map(|i| at_cut[i])
                .max()
                .unwrap_or(0);
            let buf = Arc::new(ids[..len].to_vec());
            cache.held_tokens += buf.len();
            cache.buffers.insert(buf_id, (buf, 0));
            for i in (0..cuts.len()).filter(|&i| keep[i]) {
                cache.insert(
                    hashes[i],
                    Entry {
                        buf: buf_id,
                        tokens: at_cut[i],
                        bytes: cuts[i].pos,
                        tick: 0,
                    },
                );
            }
            cache.evict_to_budget();
        }
        Ok(Encoded {
            ids,
            reused_tokens: reused,
        })
    }

    /// Template cuts and text anchors of `text`, ascending, one per byte offset.
    fn cuts(&self, text: &str) -> Vec<Cut> {
        let template = self.tok.cut_points(text);
        let anchors = self.text_anchors(text);
        let mut out = Vec::with_capacity(template.len() + anchors.len());
        let (mut t, mut a) = (template.iter().peekable(), anchors.iter().peekable());
        loop {
            let cut = match (t.peek(), a.peek()) {
                (Some(&&x), Some(&&(y, coarse))) if x == y => {
                    t.next();
                    a.next();
                    Cut {
                        pos: x,
                        kind: CUT_TEMPLATE | CUT_TEXT | if coarse { CUT_COARSE } else { 0 },
                    }
                }
                (Some(&&x), Some(&&(y, _))) if x < y => {
                    t.next();
                    Cut {
                        pos: x,
                        kind: CUT_TEMPLATE,
                    }
                }
                (Some(&&x), None) => {
                    t.next();
                    Cut {
                        pos: x,
                        kind: CUT_TEMPLATE,
                    }
                }
                (_, Some(&&(y, coarse))) => {
                    a.next();
                    Cut {
                        pos: y,
                        kind: CUT_TEXT | if coarse { CUT_COARSE } else { 0 },
                    }
                }
                (None, None) => break,
            };
            out.push(cut);
        }
        out
    }

    /// Text anchors of `text` (see the module doc): `(byte offset, coarse)`, ascending. The
    /// chain is chosen from [`Tokenizer::text_cut_candidates`] left to right, each choice
    /// depending only on the bytes before the candidate, its own byte and the previous
    /// choice, so a prompt and any prompt sharing `text[..=p]` agree on the anchors up to `p`.
    /// Anchors with an added token across them are chosen (to keep the chain) but not
    /// returned.
    pub(crate) fn text_anchors(&self, text: &str) -> Vec<(usize, bool)> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let (mut last, mut index) = (0usize, 0usize);
        for p in self.tok.text_cut_candidates(text) {
            let gap = p - last;
            if gap < ANCHOR_MIN_GAP {
                continue;
            }
            let mut w = u64::from_le_bytes(bytes[p - 8..p].try_into().expect("8 bytes"));
            w = (w ^ (w >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            w = (w ^ (w >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            if gap >= ANCHOR_MAX_GAP || w >> (64 - ANCHOR_SELECT_BITS) == 0 {
                last = p;
                let coarse = index % COARSE_EVERY == COARSE_EVERY - 1;
                index += 1;
                if self.tok.is_text_cut(text, p) {
                    out.push((p, coarse));
                }
            }
        }
        out
    }

    fn push_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if !piece.is_empty() {
            self.tok.encode_into(piece, ids)?;
        }
        Ok(())
    }

    /// Checks the cache's invariants ([`PrefixCache`]). Tests only.
    #[cfg(test)]
    fn check_invariants(&self) -> Result<(), String> {
        self.lock().check_invariants()
    }
}

impl PrefixCache {
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
            self.evictions += 1;
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

    /// A pre-tokenizer splitting on `regex` matches, each match its own piece.
    fn isolated_split(regex: &str) -> tokenizers::pre_tokenizers::split::Split {
        use tokenizers::SplitDelimiterBehavior;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        Split::new(
            SplitPattern::Regex(regex.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap()
    }

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

    /// Two shards' tokenizers over one shared cache: turn 2 encoded on the other shard (a
    /// thread of its own) reuses turn 1's ids, counted on that shard; the cache stays sound.
    #[test]
    fn shards_share_one_prefix_cache() {
        let t = qwen();
        let cache = PrefixCache::shared(1 << 20);
        let mut shard0 = IncrementalTokenizer::with_cache(t.for_shard(), Arc::clone(&cache));
        let mut msgs = vec![json!({"role": "user", "content": "Sort [3, 1, 2] in Python."})];
        let p1 = t.render_chat(&Value::Array(msgs.clone()), true).unwrap();
        let e1 = shard0.encode(&p1, 0).unwrap();
        msgs.push(json!({"role": "assistant", "content": "sorted([3, 1, 2])"}));
        msgs.push(json!({"role": "user", "content": "Thanks!"}));
        let p2 = t.render_chat(&Value::Array(msgs), true).unwrap();
        let (shard1_tok, shared, text) = (t.for_shard(), Arc::clone(&cache), p2.clone());
        let (e2, stats) = std::thread::spawn(move || {
            let mut shard1 = IncrementalTokenizer::with_cache(shard1_tok, shared);
            (shard1.encode(&text, 0).unwrap(), shard1.stats())
        })
        .join()
        .unwrap();
        assert_eq!(e2.ids, t.encode(&p2));
        assert_eq!(e2.reused_tokens, e1.ids.len() - 3);
        assert_eq!((stats.hits, shard0.stats().hits), (1, 0));
        shard0.check_invariants().unwrap();
        assert!(cache.lock().unwrap().held_tokens() >= e1.ids.len() - 3);
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

    /// Plain pipelines for the text-cut tests: Qwen3 as shipped, and the Qwen3 vocabulary
    /// under the two other recognised pre-tokenizers (Llama 3 split regex, GPT-2 ByteLevel).
    fn pipelines() -> &'static [(&'static str, Tokenizer)] {
        use tokenizers::PreTokenizerWrapper;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        static P: std::sync::OnceLock<Vec<(&'static str, Tokenizer)>> = std::sync::OnceLock::new();
        P.get_or_init(|| {
            let t = qwen();
            let llama3 = t.with_pipeline(
                |hf| {
                    let split = isolated_split(crate::tokenizer::TEXT_CUT_SPLIT_REGEXES[1]);
                    hf.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(
                        vec![split.into(), ByteLevel::new(false, false, false).into()],
                    ))));
                },
                false,
            );
            let gpt2 = t.with_pipeline(
                |hf| {
                    hf.with_pre_tokenizer(Some(ByteLevel::new(false, false, true)));
                },
                false,
            );
            vec![
                ("qwen3", t.clone()),
                ("llama3-regex", llama3),
                ("gpt2-bytelevel", gpt2),
            ]
        })
    }

    /// Words of the Qwen3 vocabulary (`Ġ` + 3–10 ASCII letters, the form the Mooncake replay
    /// builds prompts from), a deterministic sample.
    fn vocab_words() -> &'static [String] {
        static W: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        W.get_or_init(|| {
            let t = qwen();
            (0..t.vocab_size() as u32)
                .filter_map(|id| t.id_to_token(id))
                .filter_map(|tok| {
                    let w = tok.strip_prefix('Ġ')?;
                    ((3..=10).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_alphabetic()))
                        .then(|| w.to_string())
                })
                .step_by(7)
                .take(3000)
                .collect()
        })
    }

    /// Every pipeline recognised: text cuts on; anything else: off, with a reason.
    #[test]
    fn text_cuts_are_enabled_only_for_recognised_pipelines() {
        use tokenizers::TruncationParams;
        use tokenizers::normalizers::unicode::NFKC;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
        for (name, t) in pipelines() {
            assert!(
                t.text_cuts_enabled(),
                "{name}: {:?}",
                t.text_cuts_disabled_reason()
            );
        }
        let t = qwen();
        let off: Vec<Tokenizer> = vec![
            t.with_pipeline(
                |hf| {
                    let _ = hf.with_normalizer(Some(NFKC));
                },
                false,
            ),
            t.with_pipeline(
                |hf| {
                    hf.with_pre_tokenizer(Some(ByteLevel::new(true, false, true)));
                },
                false,
            ),
            t.with_pipeline(
                |hf| {
                    hf.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true)));
                },
                false,
            ),
            t.with_pipeline(
                |hf| {
                    hf.with_pre_tokenizer(Some(isolated_split(r"[^\n]+\n?")));
                },
                false,
            ),
            t.with_pipeline(
                |hf| {
                    hf.with_truncation(Some(TruncationParams::default()))
                        .unwrap();
                },
                false,
            ),
            t.with_pipeline(|hf| hf.set_encode_special_tokens(true), false),
        ];
        for t in &off {
            assert!(!t.text_cuts_enabled());
            assert!(t.text_cuts_disabled_reason().is_some());
            assert!(!t.is_text_cut("abc def", 3));
            assert_eq!(t.text_cut_candidates("abc def").count(), 0);
        }
    }

    /// The byte rule on examples, each checked against the tokenizer (the rule must imply
    /// `encode(a) ++ encode(b) == encode(a ++ b)`), and the cases it must refuse.
    #[test]
    fn text_cut_rule_examples() {
        let t = qwen();
        let yes = [
            ("abc def", 3),
            ("abc\ndef", 3),
            ("abc\r\n", 3),
            ("abc  def", 3),
            ("abc\tdef", 3),
            ("abc123", 3),
            ("abc.def", 3),
            ("it's", 2),
            ("IT'LL go", 2),
            ("abc<|im_end|>x", 3),
            ("中文abc, d", 9),
            ("<think>abc def", 10),
        ];
        for (text, p) in yes {
            assert!(t.is_text_cut(text, p), "{text:?} at {p}");
            assert!(t.verify_text_cut(text, p), "{text:?} at {p}");
            assert_eq!(
                [t.encode(&text[..p]), t.encode(&text[p..])].concat(),
                t.encode(text),
                "{text:?} at {p}"
            );
        }
        let no = [
            (" hello", 4),      // letter|letter: the " hel" + "lo" trap
            ("abc", 3),         // end of text
            ("abc def", 0),     // start of text
            ("a<think>", 6),    // inside an added token ("<think" | ">")
            ("caf\u{e9} x", 3), // letter|non-ASCII
            ("e\u{301} x", 1),  // letter|combining mark (NFC composes across)
            ("abc1 x", 4),      // digit before
            ("ab de", 2),       // space before... is a letter|space: allowed, so check 1
        ];
        for (text, p) in &no[..no.len() - 1] {
            assert!(!t.is_text_cut(text, *p), "{text:?} at {p}");
        }
        assert!(!t.is_text_cut("ab de", 1));
        assert_ne!(
            [t.encode("e"), t.encode("\u{301} x")].concat(),
            t.encode("e\u{301} x")
        );
    }

    /// Pieces for random texts: vocabulary words (with and without their space, capitalised),
    /// whitespace runs, newlines, digits, punctuation, contractions, multibyte letters,
    /// combining marks, emoji, and spelled added tokens.
    fn text_piece() -> impl Strategy<Value = String> {
        let n = vocab_words().len();
        let word = (0..n).prop_map(|i| format!(" {}", vocab_words()[i]));
        prop_oneof![
            12 => word,
            2 => (0..n).prop_map(|i| vocab_words()[i].clone()),
            1 => (0..n).prop_map(|i| {
                let w = &vocab_words()[i];
                format!(" {}{}", w[..1].to_uppercase(), &w[1..])
            }),
            1 => "[ \n\t\r]{1,3}",
            1 => "[0-9]{1,5}",
            1 => "[.,;:!?()\\[\\]{}\"'`<>/|=+*-]{1,3}",
            1 => prop::sample::select(vec![
                "'s", "'LL", "'re", "café", "e\u{301}", "中文字", "😀", "ſ", "Ωmega", "\u{301}",
                "<|im_end|>", "<think>", "</tool_call>", "<|im", "\n\n", "  ",
            ])
            .prop_map(str::to_string),
        ]
    }

    fn text_of(min: usize, max: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(text_piece(), min..max).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The rule itself: at every byte offset where `is_text_cut` holds, on every recognised
        /// pipeline, the ids of the two pieces concatenate to the ids of the whole, and the
        /// run-time check agrees.
        #[test]
        fn every_text_cut_is_exact(text in text_of(1, 40)) {
            for (name, t) in pipelines() {
                let whole = t.encode(&text);
                for p in 1..text.len() {
                    if t.is_text_cut(&text, p) {
                        prop_assert!(t.verify_text_cut(&text, p), "{} {:?} at {}", name, text, p);
                        prop_assert_eq!(
                            &[t.encode(&text[..p]), t.encode(&text[p..])].concat(),
                            &whole,
                            "{} {:?} at {}", name, text, p
                        );
                    }
                }
            }
        }

        /// Mooncake-like growing prompts: each turn is the previous text plus new text (and
        /// sometimes an edit of the previous tail first), sent raw (completions) and as one
        /// chat user message, with a roomy or a tight cache budget. Incremental ids always
        /// equal the full encode, and with a roomy budget a pure append reuses at least the ids
        /// up to the previous prompt's last anchor in the shared text.
        #[test]
        fn growing_prompts_reuse_and_stay_exact(
            base in text_of(150, 300),
            steps in prop::collection::vec((text_of(5, 120), 0u8..4, 0usize..400), 1..6),
            chat in any::<bool>(),
            pipeline in 0usize..3,
            budget in prop_oneof![3 => Just(1usize << 20), 1 => Just(1500usize)],
        ) {
            let t = &pipelines()[pipeline].1;
            let render = |c: &str| {
                if chat {
                    t.render_chat(&json!([{"role": "user", "content": c}]), true).unwrap()
                } else {
                    c.to_string()
                }
            };
            let mut inc = IncrementalTokenizer::new(t.clone(), budget);
            let mut content = base;
            let mut prev = render(&content);
            let first = inc.encode(&prev, 3).unwrap();
            prop_assert_eq!(&first.ids, &t.encode(&prev));
            for (suffix, edit, cut) in steps {
                match edit {
                    // Drop up to `cut` bytes of the tail (a client editing its last words).
                    1 => {
                        let mut k = content.len().saturating_sub(cut);
                        while !content.is_char_boundary(k) {
                            k -= 1;
                        }
                        content.truncate(k);
                    }
                    // Replace one character `cut` bytes before the end.
                    2 => {
                        let mut k = content.len().saturating_sub(cut);
                        while !content.is_char_boundary(k) {
                            k -= 1;
                        }
                        if let Some(c) = content[k..].chars().next() {
                            content.replace_range(k..k + c.len_utf8(), "Z");
                        }
                    }
                    _ => {}
                }
                content.push_str(&suffix);
                let text = render(&content);
                let got = inc.encode(&text, 3).unwrap();
                prop_assert_eq!(&got.ids, &t.encode(&text), "{:?}", text);
                inc.check_invariants().map_err(TestCaseError::fail)?;
                if (edit == 0 || edit == 3) && budget > text.len() {
                    // The previous prompt's anchors inside the shared text: at most 2 anchors of
                    // a template tail come after them, so the last one was cached as a tail
                    // anchor, and if it is still a usable anchor of the new text (an added token
                    // spelled across it could differ) it must be reused.
                    let shared = prev.bytes().zip(text.bytes()).take_while(|(a, b)| a == b).count();
                    let anchors = inc.text_anchors(&prev);
                    let inside: Vec<usize> = anchors.iter().map(|a| a.0).filter(|&p| p < shared).collect();
                    prop_assert!(anchors.len() - inside.len() < TAIL_ANCHORS);
                    if let Some(&last) = inside.last()
                        && inc.text_anchors(&text).iter().any(|a| a.0 == last)
                    {
                        prop_assert!(
                            got.reused_tokens >= t.encode(&text[..last]).len(),
                            "reused {} < ids before anchor {}", got.reused_tokens, last
                        );
                    }
                }
                prev = text;
            }
            prop_assert_eq!(inc.stats().rejected_text_cuts, 0);
        }
    }

    /// A text whose only anchor is forced (no candidate for > ANCHOR_MAX_GAP bytes) right after
    /// `" hel"`: `X + " hel" + tail`.
    fn forced_anchor_prefix() -> String {
        format!("a{}", " 1".repeat(ANCHOR_MAX_GAP / 2 + 10))
    }

    /// The `" hel" + "lo"` trap: the previous prompt had a cached anchor after `" hel"`, the
    /// new one continues the word there. That cut is refused (the naive reuse would be wrong),
    /// while a new prompt that keeps the boundary reuses it.
    #[test]
    fn cut_mid_word_is_never_used() {
        let t = qwen();
        let x = forced_anchor_prefix();
        for chat in [false, true] {
            let render = |c: &str| {
                if chat {
                    t.render_chat(&json!([{"role": "user", "content": c}]), true)
                        .unwrap()
                } else {
                    c.to_string()
                }
            };
            let mut inc = IncrementalTokenizer::new(t.clone(), 1 << 20);
            // Previous turn ended mid-word (chat: the template follows; raw: a space follows).
            let prev = render(&if chat {
                format!("{x} hel")
            } else {
                format!("{x} hel there")
            });
            let p = render(&format!("{x} hel")).find(" hel").unwrap() + 4;
            assert_eq!(
                inc.text_anchors(&prev)
                    .iter()
                    .map(|a| a.0)
                    .collect::<Vec<_>>(),
                vec![p]
            );
            inc.encode(&prev, 0).unwrap();
            let next = render(&format!("{x} hello there"));
            assert_eq!(&next[..p], &prev[..p]);
            assert!(!t.is_text_cut(&next, p));
            let naive = [t.encode(&next[..p]), t.encode(&next[p..])].concat();
            assert_ne!(naive, t.encode(&next), "the trap is real");
            let got = inc.encode(&next, 0).unwrap();
            assert_eq!(got.ids, t.encode(&next));
            assert_eq!(got.reused_tokens, 0);
            // Control: the same cached anchor is used when the next text keeps the boundary.
            let ok = render(&format!("{x} hel lo there"));
            let got = inc.encode(&ok, 0).unwrap();
            assert_eq!(got.ids, t.encode(&ok));
            assert_eq!(got.reused_tokens, t.encode(&ok[..p]).len());
            assert_eq!(inc.stats().text_hits, 1);
            inc.check_invariants().unwrap();
        }
    }

    /// A pipeline that merges across spaces, wrongly forced to allow text cuts, is caught by
    /// the run-time check: no unverified text cut is used and the ids stay exact.
    #[test]
    fn verify_catches_a_misclassified_pipeline() {
        use tokenizers::PreTokenizerWrapper;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        let t = qwen().with_pipeline(
            |hf| {
                let lines = isolated_split(r"[^\n]+\n?");
                hf.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                    lines.into(),
                    ByteLevel::new(false, false, false).into(),
                ]))));
            },
            true,
        );
        assert!(
            t.text_cuts_enabled() && t.is_text_cut("ab cd", 2) && !t.verify_text_cut("ab cd", 2)
        );
        let words: Vec<&str> = vocab_words().iter().map(String::as_str).take(400).collect();
        let mut inc = IncrementalTokenizer::new(t.clone(), 1 << 20);
        let mut text = String::new();
        for chunk in words.chunks(100) {
            text.push_str(&chunk.join(" "));
            text.push(' ');
            assert_eq!(inc.encode(&text, 0).unwrap().ids, t.encode(&text));
        }
        assert!(inc.stats().rejected_text_cuts > 0);
        assert_eq!(inc.stats().text_hits, 0);
    }

    /// A miss on a long single-message prompt (4,000 vocabulary words) caches a bounded number
    /// of entries (tail anchors, one coarse anchor per COARSE_EVERY anchors, template cuts) in
    /// one buffer; each grown turn then reuses all but the last few dozen tokens of the old text.
    #[test]
    fn long_prompt_miss_is_bounded_and_growth_reuses() {
        let t = qwen();
        let words = vocab_words();
        let content: String = (0..4000)
            .map(|i| format!(" {}", words[(i * 31) % words.len()]))
            .collect();
        let prompt = t
            .render_chat(&json!([{"role": "user", "content": content}]), true)
            .unwrap();
        let mut inc = IncrementalTokenizer::new(t.clone(), 1 << 20);
        let got = inc.encode(&prompt, 0).unwrap();
        assert_eq!(got.ids, t.encode(&prompt));
        let anchors = inc.text_anchors(&prompt).len();
        assert!(anchors > 50, "{anchors} anchors in {} bytes", prompt.len());
        let bound = anchors / COARSE_EVERY + TAIL_ANCHORS + ENTRIES_PER_PROMPT;
        assert!(
            inc.lock().entries.len() <= bound,
            "{} > {bound}",
            inc.lock().entries.len()
        );
        assert_eq!(inc.lock().buffers.len(), 1);
        inc.check_invariants().unwrap();
        // Growing it three times keeps one live buffer per turn at most (the template-cut
        // entries of each turn's tail keep that turn's buffer).
        let mut content = content;
        for k in 0..3 {
            content.push_str(&format!(" more words number {k} here"));
            let p = t
                .render_chat(&json!([{"role": "user", "content": content}]), true)
                .unwrap();
            let got = inc.encode(&p, 0).unwrap();
            assert_eq!(got.ids, t.encode(&p));
            assert!(
                got.reused_tokens > got.ids.len() - 80,
                "{} of {}",
                got.reused_tokens,
                got.ids.len()
            );
        }
        assert!(inc.lock().buffers.len() <= 4);
        inc.check_invariants().unwrap();
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
