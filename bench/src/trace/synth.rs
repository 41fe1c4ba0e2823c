//! Id → tokens → text synthesis for traces that carry only block ids (traces.md §3).
//!
//! [`WordIds`] holds the vocabulary ids that are one leading-space lowercase word each;
//! [`SplitMix64`] seeded with `(ns << 32) | id` picks 512 of them per block id, so equal ids give
//! equal blocks and the text `" w1 w2 …"` re-tokenizes to exactly those ids. [`PromptBuilder`]
//! assembles and caches a request's prompt from its `hash_ids`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvroute_tokenize::Tokenizer;

use super::{MOONCAKE_BLOCK_TOKENS, RequestMeta, TAIL_NAMESPACE_BIT, TraceError, TraceRecord};

/// Minimum letters of a `WORD_IDS` token after its leading `Ġ`. Source: traces.md §3.
pub const WORD_MIN_LETTERS: usize = 3;
/// Maximum letters of a `WORD_IDS` token after its leading `Ġ`. Source: traces.md §3.
pub const WORD_MAX_LETTERS: usize = 8;
/// Default cap on [`PromptBuilder`]'s cache, in block ids (~4 KB each: text + word offsets);
/// the cache is emptied when it would grow past it. Sized for the demo (≤ 2,000 requests).
pub const DEFAULT_MAX_CACHED_BLOCKS: usize = 16_384;

/// SplitMix64 stream of traces.md §3: `state = (ns << 32) | id`; per output
/// `state += 0x9E3779B97F4A7C15`, then the standard mix (64-bit wrapping arithmetic).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// Generator for block `id` in namespace `ns` (traces.md §3: `state = (ns << 32) | id`).
    pub fn new(ns: u32, id: u64) -> Self {
        Self {
            state: (u64::from(ns) << 32) | id,
        }
    }

    /// Generator from a raw 64-bit state.
    pub fn from_state(state: u64) -> Self {
        Self { state }
    }

    /// Next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Iterator for SplitMix64 {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        Some(self.next_u64())
    }
}

/// `x mod d` for a fixed divisor without a division: Lemire, Kaser, Kurz, "Faster remainder
/// by direct computation" (2019), `fastmod_u64`: `M = ⌊(2^128 − 1) / d⌋ + 1`, then
/// `x mod d = ⌊((M·x) mod 2^128) · d / 2^128⌋`, exact for every 64-bit `x` and `d ≥ 1`.
/// The prompt generator draws one remainder per token, so this is its hot path.
#[derive(Debug, Clone, Copy)]
pub struct FastMod {
    m: u128,
    d: u64,
}

impl FastMod {
    /// Remainders modulo `d`.
    ///
    /// # Panics
    /// If `d` is 0.
    pub fn new(d: u64) -> Self {
        assert!(d > 0, "modulo by zero");
        Self {
            m: (u128::MAX / u128::from(d)).wrapping_add(1),
            d,
        }
    }

    /// `x mod d`.
    #[inline]
    pub fn rem(&self, x: u64) -> u64 {
        let low = self.m.wrapping_mul(u128::from(x));
        let d = u128::from(self.d);
        let bottom = ((low & u128::from(u64::MAX)) * d) >> 64;
        let top = (low >> 64) * d;
        ((bottom + top) >> 64) as u64
    }
}

/// `WORD_IDS` of traces.md §3: vocabulary ids whose token string is `Ġ` followed by 3–8
/// lowercase ASCII letters, sorted ascending, with their words (leading `Ġ` as a space).
/// Qwen2/Qwen3: 18,584 ids, first 279, 323, 369, 390, 419, last 143854, 143855, 143934.
///
/// # Invariants
/// 1. `ids` is strictly ascending and non-empty; `words.len() == ids.len()`.
/// 2. `words[i]` is `' '` followed by 3–8 bytes `a..=z`.
#[derive(Debug, Clone)]
pub struct WordIds {
    ids: Vec<u32>,
    words: Vec<String>,
}

impl WordIds {
    /// Whether a byte-level BPE token string is `Ġ` + 3–8 lowercase ASCII letters.
    pub fn is_word_token(token: &str) -> bool {
        token.strip_prefix('Ġ').is_some_and(|w| {
            (WORD_MIN_LETTERS..=WORD_MAX_LETTERS).contains(&w.len())
                && w.bytes().all(|b| b.is_ascii_lowercase())
        })
    }

    /// Selects the word ids from a tokenizer's vocabulary (ids `0..vocab_size`).
    ///
    /// # Errors
    /// - [`TraceError::NoWordTokens`]: no token of the vocabulary qualifies.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self, TraceError> {
        let vocab = tok.vocab_size() as u32;
        Self::from_vocab((0..vocab).filter_map(|id| tok.id_to_token(id).map(|t| (id, t))))
    }

    /// Selects the word ids from `(id, token string)` pairs in any order (duplicates ids keep
    /// one entry).
    ///
    /// # Errors
    /// - [`TraceError::NoWordTokens`]: no pair qualifies.
    pub fn from_vocab<I, S>(vocab: I) -> Result<Self, TraceError>
    where
        I: IntoIterator<Item = (u32, S)>,
        S: AsRef<str>,
    {
        let mut pairs: Vec<(u32, String)> = vocab
            .into_iter()
            .filter(|(_, t)| Self::is_word_token(t.as_ref()))
            .map(|(id, t)| (id, format!(" {}", &t.as_ref()['Ġ'.len_utf8()..])))
            .collect();
        pairs.sort_unstable_by_key(|p| p.0);
        pairs.dedup_by_key(|p| p.0);
        if pairs.is_empty() {
            return Err(TraceError::NoWordTokens);
        }
        let (ids, words) = pairs.into_iter().unzip();
        Ok(Self { ids, words })
    }

    /// The selected ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Number of selected ids (18,584 for Qwen3).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Always false: construction rejects an empty selection.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Word of `WORD_IDS[index]` with its leading space, e.g. `" sticky"`.
    ///
    /// # Panics
    /// If `index >= self.len()`.
    pub fn word(&self, index: usize) -> &str {
        &self.words[index]
    }

    fn indices(&self, ns: u32, id: u64, n: usize) -> impl Iterator<Item = usize> + '_ {
        let m = FastMod::new(self.ids.len() as u64);
        SplitMix64::new(ns, id)
            .take(n)
            .map(move |z| m.rem(z) as usize)
    }

    /// First `n` tokens of block `(ns, id)`: `WORD_IDS[z mod len]` per SplitMix64 output
    /// (traces.md §3). A shorter block is a prefix of a longer one.
    pub fn block_tokens(&self, ns: u32, id: u64, n: usize) -> Vec<u32> {
        self.indices(ns, id, n).map(|i| self.ids[i]).collect()
    }

    /// Appends [`Self::block_tokens`]`(ns, id, n)` to `out`. The ids are written into slots
    /// grown up front rather than pushed one by one (a push re-reads and re-writes the
    /// vector's length every token: the prompt generator's hot loop).
    pub fn push_block_tokens(&self, ns: u32, id: u64, n: usize, out: &mut Vec<u32>) {
        let m = FastMod::new(self.ids.len() as u64);
        let start = out.len();
        out.resize(start + n, 0);
        for (slot, z) in out[start..].iter_mut().zip(SplitMix64::new(ns, id)) {
            *slot = self.ids[m.rem(z) as usize];
        }
    }

    /// Text of [`Self::block_tokens`]: the words, each with its leading space
    /// (`" sticky finder vic …"`), which re-tokenizes to exactly those ids.
    pub fn block_text(&self, ns: u32, id: u64, n: usize) -> String {
        let mut s = String::with_capacity(n * (WORD_MAX_LETTERS + 1));
        self.push_block_text(ns, id, n, &mut s);
        s
    }

    /// Appends [`Self::block_text`]`(ns, id, n)` to `out` (at most `n × 9` bytes, all ASCII).
    pub fn push_block_text(&self, ns: u32, id: u64, n: usize, out: &mut String) {
        for i in self.indices(ns, id, n) {
            out.push_str(&self.words[i]);
        }
    }

    /// Test-only check of the numbered invariants; names the broken one.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        if self.ids.is_empty() || self.ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err("1: ids empty or not strictly ascending".into());
        }
        if self.words.len() != self.ids.len() {
            return Err("1: words.len() != ids.len()".into());
        }
        for w in &self.words {
            let ok = w.strip_prefix(' ').is_some_and(|l| {
                (WORD_MIN_LETTERS..=WORD_MAX_LETTERS).contains(&l.len())
                    && l.bytes().all(|b| b.is_ascii_lowercase())
            });
            if !ok {
                return Err(format!("2: bad word {w:?}"));
            }
        }
        Ok(())
    }
}

/// One cached block: its full text and the end byte offset of each word.
#[derive(Debug)]
struct CachedBlock {
    text: String,
    ends: Vec<u16>,
}

/// Builds a request's prompt text from its `hash_ids` (traces.md §3 "Assembly"): each id gives
/// `block_tokens` (512) words, the last block only its first `input_length − 512·(n−1)`.
/// Each id's full block text is cached (at most `max_cached_blocks` ids; the cache is emptied
/// when full), so building is a copy. Shareable across threads (`&self`, internal mutex).
#[derive(Debug)]
pub struct PromptBuilder {
    words: WordIds,
    ns: u32,
    block_tokens: u32,
    max_cached_blocks: usize,
    cache: Mutex<HashMap<u64, Arc<CachedBlock>>>,
}

impl PromptBuilder {
    /// Builder for ids in namespace `ns` (0 for Mooncake and the built-in workload) with
    /// 512-token blocks and [`DEFAULT_MAX_CACHED_BLOCKS`].
    pub fn new(words: WordIds, ns: u32) -> Self {
        Self {
            words,
            ns,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            max_cached_blocks: DEFAULT_MAX_CACHED_BLOCKS,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Builder over `tok`'s [`WordIds`] for namespace `ns` (see [`Self::new`]).
    ///
    /// # Errors
    /// - [`TraceError::NoWordTokens`]: the vocabulary has no word tokens.
    pub fn from_tokenizer(tok: &Tokenizer, ns: u32) -> Result<Self, TraceError> {
        Ok(Self::new(WordIds::from_tokenizer(tok)?, ns))
    }

    /// Sets the tokens per id (default 512). Values of 0 are treated as 1; at most 7,000
    /// (word offsets are kept as `u16`).
    pub fn with_block_tokens(mut self, block_tokens: u32) -> Self {
        self.block_tokens = block_tokens.clamp(1, 7_000);
        self
    }

    /// Sets the cache cap in block ids (0 disables caching).
    pub fn with_max_cached_blocks(mut self, max_cached_blocks: usize) -> Self {
        self.max_cached_blocks = max_cached_blocks;
        self
    }

    /// The word ids used.
    pub fn words(&self) -> &WordIds {
        &self.words
    }

    /// Tokens per id.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Ids currently cached.
    pub fn cached_blocks(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }

    fn block(&self, id: u64) -> Arc<CachedBlock> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = cache.get(&id) {
            return b.clone();
        }
        let n = self.block_tokens as usize;
        let mut text = String::with_capacity(n * (WORD_MAX_LETTERS + 1));
        let mut ends = Vec::with_capacity(n);
        for i in self.words.indices(self.ns, id, n) {
            text.push_str(self.words.word(i));
            ends.push(text.len() as u16);
        }
        let b = Arc::new(CachedBlock { text, ends });
        if self.max_cached_blocks > 0 {
            if cache.len() >= self.max_cached_blocks {
                cache.clear();
            }
            cache.insert(id, b.clone());
        }
        b
    }

    /// Prompt text of `r`: the concatenated block texts, `r.input_length` words in total (fewer
    /// only if `hash_ids` is too short for `input_length`). Starts with a space.
    pub fn prompt_text(&self, r: &TraceRecord) -> String {
        let mut out = String::with_capacity(r.input_length as usize * (WORD_MAX_LETTERS + 1));
        for (i, &id) in r.hash_ids.iter().enumerate() {
            let take = r.block_len(i, self.block_tokens) as usize;
            if take == 0 {
                continue;
            }
            let b = self.block(id);
            let end = b.ends[take.min(b.ends.len()) - 1] as usize;
            out.push_str(&b.text[..end]);
        }
        out
    }

    /// Token ids of `r`'s prompt as [`Self::prompt_tokens`], and its text as
    /// [`Self::prompt_text`] when `with_text`, for a request of any trace: the ids are keyed
    /// in `meta.namespace` (not the builder's), and with `meta.tail_id = Some(k)` every id is
    /// a full block followed by `input_length − B·len(hash_ids)` tail tokens from
    /// `(namespace | 2^31, k)` (WEKA, traces.md §3 "Assembly"). One generator pass serves
    /// both outputs; nothing is cached. The id vector has room for `output_length` more.
    pub fn prompt(
        &self,
        r: &TraceRecord,
        meta: &RequestMeta,
        with_text: bool,
    ) -> (Vec<u32>, Option<String>) {
        let len = r.input_length as usize;
        // Room for the output tokens the engine appends.
        let mut ids = Vec::with_capacity(len + r.output_length as usize);
        let mut text = with_text.then(|| String::with_capacity(len * (WORD_MAX_LETTERS + 1)));
        let (table, words) = (&self.words.ids, &self.words.words);
        let mut emit = |ns: u32, id: u64, n: usize| match text.as_mut() {
            Some(t) => {
                for i in self.words.indices(ns, id, n) {
                    ids.push(table[i]);
                    t.push_str(&words[i]);
                }
            }
            None => self.words.push_block_tokens(ns, id, n, &mut ids),
        };
        let b = self.block_tokens;
        for (i, &id) in r.hash_ids.iter().enumerate() {
            let take = match meta.tail_id {
                Some(_) => b as usize,
                None => r.block_len(i, b) as usize,
            };
            emit(meta.namespace, id, take.min(len));
        }
        if let Some(k) = meta.tail_id {
            let tail = len.saturating_sub(b as usize * r.hash_ids.len());
            if tail > 0 {
                emit(meta.namespace | TAIL_NAMESPACE_BIT, k, tail);
            }
        }
        (ids, text)
    }

    /// Token ids of `r`'s prompt (what [`Self::prompt_text`] tokenizes to, before any chat
    /// template).
    pub fn prompt_tokens(&self, r: &TraceRecord) -> Vec<u32> {
        let mut out = Vec::with_capacity(r.input_length as usize);
        for (i, &id) in r.hash_ids.iter().enumerate() {
            let take = r.block_len(i, self.block_tokens) as usize;
            out.extend(self.words.block_tokens(self.ns, id, take));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: ids 10.. with a few qualifying and non-qualifying tokens.
    fn toy() -> WordIds {
        WordIds::from_vocab([
            (12, "Ġcat"),
            (10, "Ġdog"),
            (11, "ĠDog"),
            (13, "Ġab"),
            (14, "Ġabcdefghi"),
            (15, "horse"),
            (16, "Ġhorse"),
            (17, "Ġcafé"),
        ])
        .unwrap()
    }

    /// Brute-force reference: the division-free remainder equals `%` on edge cases and
    /// a SplitMix64 stream, for the Qwen3 `WORD_IDS` length and other divisors.
    #[test]
    fn fast_mod_equals_the_remainder() {
        for d in [
            1u64,
            2,
            3,
            7,
            18_584,
            65_537,
            u32::MAX as u64,
            u64::MAX - 1,
            u64::MAX,
        ] {
            let m = FastMod::new(d);
            let edge = [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX, u64::MAX - 1];
            for x in edge
                .into_iter()
                .chain(SplitMix64::from_state(d).take(20_000))
            {
                assert_eq!(m.rem(x), x % d, "{x} mod {d}");
            }
        }
    }

    /// traces.md §3 test vectors for `(ns, id) = (1, 1)`, through [`PromptBuilder::prompt`] with
    /// a toy vocabulary checked by its own reference (`WORD_IDS[z mod len]`): and a WEKA-style
    /// request = 2 full blocks of 4 + a 3-token tail from `(ns | 2^31, k)`.
    #[test]
    fn prompt_assembles_full_blocks_and_a_private_tail() {
        let pb = PromptBuilder::new(toy(), 0).with_block_tokens(4);
        let r = TraceRecord {
            timestamp_ms: 0,
            input_length: 11,
            output_length: 1,
            hash_ids: vec![7, 8],
        };
        let meta = RequestMeta {
            namespace: 24,
            tail_id: Some(5),
            conversation: Some(0),
            think_ms: 0.0,
        };
        let w = pb.words();
        let reference = |ns: u32, id: u64, n: usize| -> Vec<u32> {
            SplitMix64::new(ns, id)
                .take(n)
                .map(|z| w.ids()[(z % w.len() as u64) as usize])
                .collect()
        };
        let mut want = reference(24, 7, 4);
        want.extend(reference(24, 8, 4));
        want.extend(reference(24 | (1 << 31), 5, 3));
        let (ids, text) = pb.prompt(&r, &meta, true);
        assert_eq!(ids, want);
        let decoded: String = ids
            .iter()
            .map(|t| w.word(w.ids().binary_search(t).unwrap()))
            .collect();
        assert_eq!(text.unwrap(), decoded);
        // Open loop (Mooncake) = the builder's own prompt_tokens / prompt_text.
        let m = TraceRecord {
            input_length: 6,
            ..r.clone()
        };
        let (ids, text) = pb.prompt(&m, &RequestMeta::OPEN_LOOP, true);
        assert_eq!(ids, pb.prompt_tokens(&m));
        assert_eq!(text.unwrap(), pb.prompt_text(&m));
        assert_eq!(pb.prompt(&m, &RequestMeta::OPEN_LOOP, false).1, None);
    }

    /// The real vocabulary reproduces traces.md §3's vector for `(1, 1)`.
    #[test]
    fn qwen3_words_reproduce_the_traces_md_vector() {
        let tok = Tokenizer::qwen3().unwrap();
        let w = WordIds::from_tokenizer(&tok).unwrap();
        assert_eq!(
            w.block_tokens(1, 1, 8),
            [27402, 43730, 31431, 89745, 30854, 88631, 47106, 31127]
        );
        assert_eq!(w.block_tokens(0, 0, 3), [73221, 26183, 35652]);
        // Appending writes the same ids after what the vector held.
        let mut out = vec![7];
        w.push_block_tokens(1, 1, 8, &mut out);
        w.push_block_tokens(0, 0, 3, &mut out);
        assert_eq!(
            out,
            [
                7, 27402, 43730, 31431, 89745, 30854, 88631, 47106, 31127, 73221, 26183, 35652
            ]
        );
    }

    #[test]
    fn word_selection_rules() {
        let w = toy();
        assert_eq!(w.ids(), &[10, 12, 16]);
        assert_eq!(w.word(2), " horse");
        w.check_invariants().unwrap();
        assert!(matches!(
            WordIds::from_vocab([(1, "x")]),
            Err(TraceError::NoWordTokens)
        ));
    }

    #[test]
    fn splitmix_matches_reference_constants() {
        // Reference SplitMix64 with seed 0: first output 0xE220A8397B1DCDAF.
        assert_eq!(SplitMix64::from_state(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(SplitMix64::new(1, 1).state, (1 << 32) | 1);
    }

    #[test]
    fn prompt_trims_last_block_and_reuses_prefixes() {
        let pb = PromptBuilder::new(toy(), 0).with_block_tokens(4);
        let a = TraceRecord {
            timestamp_ms: 0,
            input_length: 6,
            output_length: 1,
            hash_ids: vec![7, 8],
        };
        let b = TraceRecord {
            input_length: 8,
            ..a.clone()
        };
        let (ta, tb) = (pb.prompt_text(&a), pb.prompt_text(&b));
        assert_eq!(ta.split(' ').count() - 1, 6);
        assert!(tb.starts_with(&ta));
        assert_eq!(pb.prompt_tokens(&a).len(), 6);
        assert_eq!(pb.prompt_tokens(&b)[..6], pb.prompt_tokens(&a)[..]);
        assert_eq!(pb.cached_blocks(), 2);
        // The text is the decoded form of the tokens.
        let words = pb.words();
        let decoded: String = pb
            .prompt_tokens(&a)
            .iter()
            .map(|t| words.word(words.ids().binary_search(t).unwrap()))
            .collect();
        assert_eq!(decoded, ta);
    }
}
