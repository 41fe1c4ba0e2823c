//! [`ByteBpe`]: HF's BPE merges for one byte-level pre-token, without its per-call
//! allocations.
//!
//! Why (measured, `perf/runs/2026-12-01-chat-prefix/`): once a chat turn's old messages come
//! from the chat prefix cache, tokenizing its new words is most of the decision, and HF's
//! `Model::tokenize` costs ~2 µs per word it has not cached (a `Word` and a heap per call, a
//! `String` per output token) and ~0.3 µs per cached one. Here a word of `n` bytes costs
//! `O(n²)` pair lookups in a flat hash map (a few dozen for a 7-byte word) and no allocation
//! beyond the caller's id buffer.
//!
//! Exactness: HF's `Word::merge_all` pops merges from a heap ordered by (rank, position) and
//! skips stale entries, i.e. it always applies the lowest-ranked adjacent pair, leftmost on a
//! tie; [`ByteBpe::push_word`] does exactly that on a small array. The model must be plain
//! byte-level BPE ([`ByteBpe::new`] refuses any other: dropout, continuing-subword prefix,
//! end-of-word suffix, byte fallback, or a byte missing from the vocabulary), with
//! `ignore_merges` honoured as HF does. Words longer than [`MAX_WORD_BYTES`] go back to HF.
//! The fast path's load-time check and the property test `equals_hf_on_words` (plus every
//! vocabulary entry in `equals_hf_on_the_vocabulary`) compare it with HF.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Longest pre-token merged here, bytes (the merge loop is quadratic in it; longer words,
/// rare in text, take HF's heap-based merge).
pub const MAX_WORD_BYTES: usize = 64;

/// Hasher for the maps here: FNV-1a over bytes (short words) or one multiply for a packed
/// `(left, right)` id pair, then murmur3's 64-bit finalizer, so that hashbrown's bucket bits
/// (the low ones) and tag bits (the top seven) both depend on every input bit (FNV alone
/// leaves the low bits a function of the bytes' low bits: ASCII words then collide).
#[derive(Default, Clone, Copy)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u128(&mut self, n: u128) {
        self.write_u64(n as u64);
        self.write_u64((n >> 64) as u64);
    }
}

/// A byte-level BPE model's merges (module doc). Immutable; `Send + Sync`.
#[derive(Debug)]
pub struct ByteBpe {
    /// `(left << 32 | right)` → `(rank, merged id)`.
    merges: HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>,
    /// Id of each byte's alphabet char.
    byte_id: [u32; 256],
    /// Words that are one token, by raw bytes: every vocabulary entry whose own merge gives
    /// back itself (measured at load), or, under `ignore_merges`, every entry (HF returns a
    /// word found in the vocabulary as is). Most words of running text are one token in a
    /// 150k vocabulary: one lookup instead of the merge loop.
    /// Words of at most 15 bytes are keyed inline ([`short_key`]): one probe touches one
    /// bucket instead of a bucket and a boxed key (with words from the whole vocabulary the
    /// boxed keys were a cache miss each, ~300 ns a word).
    whole: WordTable,
    /// Longer one-token words.
    whole_long: HashMap<Box<[u8]>, u32, BuildHasherDefault<PairHasher>>,
}

/// The inline key of a word of at most 15 bytes: its bytes, zero-padded, and its length in
/// the last byte (little-endian), `None` for a longer word.
///
/// Built in registers from two loads that overlap (the first and the last 4 or 8 bytes,
/// OR-ed at their offsets: the bytes they share are equal), not by copying the word into a
/// zeroed array and reading it back: that copy was a `memcpy` call whose byte stores the
/// 16-byte read could not be forwarded from, a stall on every word of the tokenizer's fast
/// path (a fifth of `FastEncoder::encode_piece`'s own time in a `bench fleet` profile,
/// perf/runs/2026-12-07-short-key). Equal to the copy for every length: test
/// `short_key_equals_the_padded_copy`.
#[inline]
fn short_key(bytes: &[u8]) -> Option<u128> {
    let n = bytes.len();
    let word = match n {
        0 => 0,
        1..=3 => {
            u128::from(bytes[0])
                | u128::from(bytes[n / 2]) << (8 * (n / 2))
                | u128::from(bytes[n - 1]) << (8 * (n - 1))
        }
        4..=7 => {
            let lo = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
            let hi = u32::from_le_bytes(bytes[n - 4..].try_into().expect("4 bytes"));
            u128::from(lo) | u128::from(hi) << (8 * (n - 4))
        }
        8..=15 => {
            let lo = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
            let hi = u64::from_le_bytes(bytes[n - 8..].try_into().expect("8 bytes"));
            u128::from(lo) | u128::from(hi) << (8 * (n - 8))
        }
        _ => return None,
    };
    Some(word | (n as u128) << 120)
}

/// The one-token words of at most 15 bytes ([`short_key`] → id): open addressing with linear
/// probing, one `(key, id)` slot of 32 bytes per probe, at most half full. A word of running
/// text is looked up with one cache line (hashbrown reads a control group and then the
/// bucket, two lines, and both miss for a word drawn from the whole 150k vocabulary: the
/// lookup was 17 % of a whole token-mode decision at turn 10 of an 8k-token chat,
/// `kvroute bench decision`, perf/runs/2026-12-02-decision-2). Key 0 marks an empty slot
/// (no short key is 0: its last byte is the word's length, ≥ 1).
#[derive(Debug, Default)]
struct WordTable {
    slots: Box<[(u128, u32)]>,
}

impl WordTable {
    /// The table of `words` (distinct keys; a later duplicate is ignored).
    fn new(words: &[(u128, u32)]) -> Self {
        let cap = (words.len() * 2).next_power_of_two().max(2);
        let mut t = Self {
            slots: vec![(0u128, 0u32); cap].into_boxed_slice(),
        };
        for &(k, id) in words.iter().filter(|(k, _)| *k != 0) {
            let mask = t.slots.len() - 1;
            let mut i = Self::slot(k) & mask;
            loop {
                match t.slots[i].0 {
                    0 => {
                        t.slots[i] = (k, id);
                        break;
                    }
                    x if x == k => break,
                    _ => i = (i + 1) & mask,
                }
            }
        }
        t
    }

    #[inline]
    fn slot(k: u128) -> usize {
        let mut h = PairHasher::default();
        h.write_u128(k);
        h.finish() as usize
    }

    /// The id of short key `k`, if it is a one-token word.
    #[inline]
    fn get(&self, k: u128) -> Option<&u32> {
        if self.slots.is_empty() || k == 0 {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = Self::slot(k) & mask;
        loop {
            let (key, id) = &self.slots[i];
            if *key == k {
                return Some(id);
            }
            if *key == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// Starts loading the home slot of short key `k` into the cache, so that a later
    /// [`Self::get`] of it does not wait for memory (see [`ByteBpe::prefetch`]).
    #[inline]
    fn prefetch(&self, k: u128) {
        if self.slots.is_empty() {
            return;
        }
        let slot = &self.slots[Self::slot(k) & (self.slots.len() - 1)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `prefetcht0` is a hint: it reads nothing architecturally and cannot fault
        // (the address is a live slot anyway); SSE is part of x86_64's baseline.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(slot).cast::<i8>());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Words held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.iter().filter(|(k, _)| *k != 0).count()
    }
}

impl ByteBpe {
    /// The merges of `model` (HF's BPE, serialized), with `byte_char` the byte-level
    /// alphabet, or `None` when the model is not plain byte-level BPE (module doc).
    pub fn new(model: &tokenizers::models::ModelWrapper, byte_char: &[char; 256]) -> Option<Self> {
        let tokenizers::models::ModelWrapper::BPE(bpe) = model else {
            return None;
        };
        let v = serde_json::to_value(bpe).ok()?;
        // An empty prefix or suffix is what HF's `format!("{prefix}{s}")` makes a no-op.
        let none = |f: &serde_json::Value| f.is_null() || f.as_str() == Some("");
        let plain = v["dropout"].is_null()
            && none(&v["continuing_subword_prefix"])
            && none(&v["end_of_word_suffix"])
            && v["byte_fallback"] == serde_json::Value::Bool(false);
        if !plain {
            return None;
        }
        let vocab = bpe.get_vocab();
        let mut byte_id = [0u32; 256];
        for (b, slot) in byte_id.iter_mut().enumerate() {
            *slot = *vocab.get(byte_char[b].to_string().as_str())?;
        }
        let mut merges = HashMap::default();
        for (rank, m) in v["merges"].as_array()?.iter().enumerate() {
            let (a, b) = match m {
                serde_json::Value::Array(p) if p.len() == 2 => (p[0].as_str()?, p[1].as_str()?),
                serde_json::Value::String(s) => s.split_once(' ')?,
                _ => return None,
            };
            let (ia, ib) = (*vocab.get(a)?, *vocab.get(b)?);
            let merged = *vocab.get(format!("{a}{b}").as_str())?;
            merges
                .entry(u64::from(ia) << 32 | u64::from(ib))
                .or_insert((rank as u32, merged));
        }
        let mut bpe = Self {
            merges,
            byte_id,
            whole: WordTable::default(),
            whole_long: HashMap::default(),
        };
        let ignore_merges = v["ignore_merges"] == serde_json::Value::Bool(true);
        let char_byte: HashMap<char, u8> =
            (0..=255u8).map(|b| (byte_char[b as usize], b)).collect();
        let (mut whole, mut whole_long) = (Vec::new(), HashMap::default());
        let mut out = Vec::new();
        for (token, &id) in &vocab {
            let Some(bytes) = token
                .chars()
                .map(|c| char_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            else {
                continue;
            };
            out.clear();
            if ignore_merges || bpe.merge(&bytes, &mut out) && out == [id] {
                match short_key(&bytes) {
                    Some(k) => whole.push((k, id)),
                    None => {
                        whole_long.insert(bytes.into_boxed_slice(), id);
                    }
                };
            }
        }
        bpe.whole = WordTable::new(&whole);
        bpe.whole_long = whole_long;
        Some(bpe)
    }

    /// Starts loading the table slot that [`Self::push_word`] of `bytes` will read first.
    /// A word drawn from a 150k vocabulary misses the cache (the table is 16 MiB); a caller
    /// that prefetches a batch of words before pushing them waits for their misses at once
    /// instead of one after the other (measured: `kvroute bench tokenize` and `bench
    /// decision`, perf/runs/2026-12-02-prefetch).
    #[inline]
    pub fn prefetch(&self, bytes: &[u8]) {
        if let Some(k) = short_key(bytes) {
            self.whole.prefetch(k);
        }
    }

    /// Appends the ids of pre-token `bytes` (raw bytes) to `ids`. Returns false, appending
    /// nothing, for a word longer than [`MAX_WORD_BYTES`] that is not one token (the caller
    /// asks HF).
    pub fn push_word(&self, bytes: &[u8], ids: &mut Vec<u32>) -> bool {
        let one = match short_key(bytes) {
            Some(k) => self.whole.get(k),
            None => self.whole_long.get(bytes),
        };
        if let Some(&id) = one {
            ids.push(id);
            return true;
        }
        self.merge(bytes, ids)
    }

    /// The merge loop (module doc) without the one-token shortcut.
    fn merge(&self, bytes: &[u8], ids: &mut Vec<u32>) -> bool {
        if bytes.len() > MAX_WORD_BYTES {
            return false;
        }
        let mut sym = [0u32; MAX_WORD_BYTES];
        let mut n = bytes.len();
        for (s, &b) in sym.iter_mut().zip(bytes) {
            *s = self.byte_id[b as usize];
        }
        // Rank of the pair starting at each position (u32::MAX: none), kept up to date.
        let mut rank = [u32::MAX; MAX_WORD_BYTES];
        let mut merged = [0u32; MAX_WORD_BYTES];
        let pair = |s: &[u32], i: usize| -> Option<(u32, u32)> {
            self.merges
                .get(&(u64::from(s[i]) << 32 | u64::from(s[i + 1])))
                .copied()
        };
        for i in 0..n.saturating_sub(1) {
            if let Some((r, m)) = pair(&sym, i) {
                rank[i] = r;
                merged[i] = m;
            }
        }
        while n > 1 {
            // Lowest rank, leftmost on a tie.
            let mut best = 0;
            for i in 1..n - 1 {
                if rank[i] < rank[best] {
                    best = i;
                }
            }
            if rank[best] == u32::MAX {
                break;
            }
            sym[best] = merged[best];
            sym.copy_within(best + 2..n, best + 1);
            rank.copy_within(best + 2..n, best + 1);
            merged.copy_within(best + 2..n, best + 1);
            n -= 1;
            rank[n - 1] = u32::MAX;
            for i in [best.wrapping_sub(1), best] {
                if i < n - 1 {
                    (rank[i], merged[i]) = pair(&sym, i).unwrap_or((u32::MAX, 0));
                }
            }
        }
        ids.extend_from_slice(&sym[..n]);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;
    use proptest::prelude::*;
    use std::sync::OnceLock;
    use tokenizers::Model;

    struct Fixture {
        tok: Tokenizer,
        bpe: ByteBpe,
        byte_char: [char; 256],
    }

    fn fixture() -> &'static Fixture {
        static F: OnceLock<Fixture> = OnceLock::new();
        F.get_or_init(|| {
            let tok = Tokenizer::qwen3().unwrap();
            let byte_char = crate::fast::byte_level_alphabet();
            let bpe = ByteBpe::new(tok.hf().get_model(), &byte_char)
                .expect("Qwen3 is plain byte-level BPE");
            Fixture {
                tok,
                bpe,
                byte_char,
            }
        })
    }

    /// HF's ids and ours for the pre-token `bytes`.
    fn both(bytes: &[u8]) -> (Vec<u32>, Option<Vec<u32>>) {
        let f = fixture();
        let word: String = bytes.iter().map(|&b| f.byte_char[b as usize]).collect();
        let hf = f
            .tok
            .hf()
            .get_model()
            .tokenize(&word)
            .unwrap()
            .iter()
            .map(|t| t.id)
            .collect();
        let mut ours = Vec::new();
        let ok = f.bpe.push_word(bytes, &mut ours);
        (hf, ok.then_some(ours))
    }

    proptest::proptest! {
        /// The word table answers as a map built from the same pairs: every key its first id,
        /// every other key (0 included) nothing.
        #[test]
        fn word_table_matches_a_map(
            pairs in proptest::collection::vec((0u128..4096, 0u32..1000), 0..600),
            probes in proptest::collection::vec(0u128..8192, 0..200),
        ) {
            let t = WordTable::new(&pairs);
            let mut want: HashMap<u128, u32> = HashMap::new();
            for &(k, id) in pairs.iter().filter(|(k, _)| *k != 0) {
                want.entry(k).or_insert(id);
            }
            proptest::prop_assert_eq!(t.len(), want.len());
            for k in want.keys().chain(&probes) {
                proptest::prop_assert_eq!(t.get(*k), want.get(k));
            }
        }
    }

    #[test]
    fn worked_examples() {
        for w in [
            &b"hello"[..],
            b" world",
            b"aaaaaaa",
            b" the",
            b"\n\n",
            b"x",
            b"  ",
            b"0",
            b" Kubernetes",
            b"'s",
        ] {
            let (hf, ours) = both(w);
            assert_eq!(Some(hf), ours, "{}", String::from_utf8_lossy(w));
        }
        // " hello" is one Qwen3 token; "aaaaaaa" several.
        assert_eq!(both(b" hello").1.unwrap().len(), 1);
        assert!(both(b"aaaaaaa").1.unwrap().len() > 1);
        let long = vec![b'a'; MAX_WORD_BYTES + 1];
        assert_eq!(both(&long).1, None);
        // The shortcut holds exactly the entries that merge back to themselves.
        let f = fixture();
        assert!(f.bpe.whole.len() > 100_000, "{}", f.bpe.whole.len());
        let mut merged = Vec::new();
        assert!(f.bpe.merge(b" hello", &mut merged));
        assert_eq!(
            merged,
            [*f.bpe.whole.get(short_key(b" hello").unwrap()).unwrap()]
        );
        assert_ne!(short_key(b"a"), short_key(b"a\0"));
        assert_eq!(short_key(&[b'x'; 16]), None);
    }

    proptest! {
        /// [`short_key`] is the word's bytes zero-padded to 15 with its length in byte 15, for
        /// every length 0..=15, and `None` from 16 on.
        #[test]
        fn short_key_equals_the_padded_copy(bytes in proptest::collection::vec(any::<u8>(), 0..20)) {
            let want = (bytes.len() < 16).then(|| {
                let mut b = [0u8; 16];
                b[..bytes.len()].copy_from_slice(&bytes);
                b[15] = bytes.len() as u8;
                u128::from_le_bytes(b)
            });
            prop_assert_eq!(short_key(&bytes), want);
        }
    }

    #[test]
    fn equals_hf_on_the_vocabulary() {
        // Every vocabulary entry's own bytes (ASCII entries: the fast path's domain), merged
        // both ways.
        let f = fixture();
        let mut char_byte = HashMap::new();
        for (b, c) in f.byte_char.iter().enumerate() {
            char_byte.insert(*c, b as u8);
        }
        let mut checked = 0;
        for word in f.tok.hf().get_model().get_vocab().keys() {
            let bytes = word
                .chars()
                .map(|c| char_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>();
            // The merge loop alone, too (the shortcut is built from it).
            if let Some(b) = bytes
                .as_ref()
                .filter(|b| b.is_ascii() && b.len() <= MAX_WORD_BYTES)
            {
                let mut merged = Vec::new();
                assert!(f.bpe.merge(b, &mut merged));
                let hf: Vec<u32> = f
                    .tok
                    .hf()
                    .get_model()
                    .tokenize(word)
                    .unwrap()
                    .iter()
                    .map(|t| t.id)
                    .collect();
                assert_eq!(merged, hf, "{word}");
            }
            let Some(bytes) = word
                .chars()
                .map(|c| char_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            else {
                continue;
            };
            if !bytes.is_ascii() || bytes.len() > MAX_WORD_BYTES {
                continue;
            }
            let (hf, ours) = both(&bytes);
            assert_eq!(Some(hf), ours, "{word}");
            checked += 1;
        }
        assert!(checked > 50_000, "{checked}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
        /// Random ASCII pre-token-like words (letters, digits, punctuation, spaces, repeats).
        #[test]
        fn equals_hf_on_words(w in "[ ]?([a-zA-Z]{1,12}|[0-9]{1,3}|[!-/:-@]{1,6}|(ab){1,8}|a{1,30}|[ \n]{1,8})") {
            let (hf, ours) = both(w.as_bytes());
            prop_assert_eq!(Some(hf), ours);
        }
    }
}
