//! [`FastEncoder`]: the HF pipeline's ids for ASCII text at a fraction of its cost.
//!
//! Why it exists (measured on the 2-core dev VM, `perf/runs/2026-12-01-tokenizer/`): the HF
//! `tokenizers` pipeline costs ~5 µs per token on Qwen3 even with a warm BPE cache (89 bytes,
//! 20 tokens: 95 µs; 5 bytes, 1 token: 5–9 µs), most of it in `NormalizedString` alignment
//! bookkeeping and allocations of the added-token split, the `Split` pre-tokenizer and
//! `ByteLevel`. Token-mode routing tokenizes the new text of every request, so that cost was
//! most of a routed request's CPU (issue 15).
//!
//! What it does, for a pipeline [`crate::Tokenizer`] classified at load time as byte-level BPE
//! with NFC (or no) normalizer, plain added tokens and one of the known split regexes
//! ([`crate::tokenizer::TEXT_CUT_SPLIT_REGEXES`]):
//! 1. split the text on added tokens, leftmost-longest on the raw text (HF's
//!    `AddedVocabulary`, all tokens plain: no strip, no single-word, not normalized);
//! 2. each piece between them that is ASCII: NFC is the identity, and the split regex is
//!    evaluated by a hand-written scanner ([`split_ascii`], one rule per alternative, in the
//!    regex's leftmost-first order); each pre-token is mapped to the byte-level alphabet and
//!    merged with the HF model's own merges ([`crate::bpe`]; by the HF model itself when it
//!    is not plain byte-level BPE or the word is long);
//! 3. a piece with any non-ASCII byte goes through the whole HF pipeline (exact, slower).
//!
//! So the ids are HF's by construction for everything but the scanner, which is checked
//! against HF's own pre-tokenizer by a property test over adversarial ASCII and at load time
//! on a fixed corpus ([`FastEncoder::new`] refuses the fast path on any difference).

use crate::bpe::ByteBpe;
use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Model;

/// How the split regex tokenizes digits: `\p{N}` (Qwen2/2.5/3) or `\p{N}{1,3}` (Llama 3,
/// cl100k), the only difference between [`crate::tokenizer::TEXT_CUT_SPLIT_REGEXES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Digits {
    /// One digit per pre-token.
    One,
    /// Up to three digits per pre-token.
    UpToThree,
}

/// The fast path of one tokenizer (module doc). Immutable after construction; `Send + Sync`.
#[derive(Debug)]
pub struct FastEncoder {
    /// Added tokens' contents, leftmost-longest.
    added: Option<AhoCorasick>,
    /// Id of each pattern of `added`.
    added_ids: Vec<u32>,
    /// The distinct first bytes of the added tokens: a text holding none of them holds no
    /// added token, and skips the search ([`Self::may_hold_added`]).
    added_first: Vec<u8>,
    digits: Digits,
    /// GPT-2's byte-level alphabet: the char each byte stands for in vocabulary strings.
    byte_char: [char; 256],
    /// The model's merges without HF's per-call allocations ([`crate::bpe`]), `None` when the
    /// model is not plain byte-level BPE (then HF's model merges each word).
    bpe: Option<ByteBpe>,
}

/// Text the load-time check encodes both ways: letters, digits, contractions, whitespace
/// runs (spaces, tabs, newlines, CRLF, trailing), punctuation runs and a chat template's
/// special tokens.
const SELF_CHECK: &str = "<|im_start|>system\nYou're a helper; it's 42, isn't it?\n\n  Code:\n\tfn x() { return 1234567; }\r\n\r\n<|im_end|>\n<|im_start|>user\nHELLO 'LL 'Re   spaces   \n\n\n end.  !!?? --> [a](b) 3.14e-10 <think>\n\n</think>\n\n<|im_end|>\n<|im_start|>assistant\n  ";

/// Pre-tokens whose vocabulary slots are prefetched together ([`ByteBpe::prefetch`]): enough
/// to cover a cache miss's latency with the pre-tokenizing and merging of the batch before,
/// few enough that the lines stay in L1 (16 × 64 B).
const PREFETCH_WORDS: usize = 16;

impl FastEncoder {
    /// The fast path of `inner` with `digits`, or `None` when building it fails or its ids
    /// differ from HF's on [`SELF_CHECK`]. The caller must only call this for a pipeline it
    /// classified as described in the module doc.
    pub fn new(inner: &tokenizers::Tokenizer, digits: Digits) -> Option<Self> {
        let mut tokens: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .iter()
            .map(|(id, t)| (t.content.clone(), *id))
            .filter(|(c, _)| !c.is_empty())
            .collect();
        tokens.sort();
        let added = if tokens.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(tokens.iter().map(|(c, _)| c.as_str()))
                    .ok()?,
            )
        };
        let byte_char = byte_level_alphabet();
        let mut added_first: Vec<u8> = tokens
            .iter()
            .filter_map(|(c, _)| c.as_bytes().first().copied())
            .collect();
        added_first.sort_unstable();
        added_first.dedup();
        let fast = Self {
            added,
            added_ids: tokens.iter().map(|(_, id)| *id).collect(),
            added_first,
            digits,
            bpe: ByteBpe::new(inner.get_model(), &byte_char),
            byte_char,
        };
        let hf = inner
            .encode_fast(SELF_CHECK, false)
            .ok()?
            .get_ids()
            .to_vec();
        (fast.encode(inner, SELF_CHECK).ok()? == hf).then_some(fast)
    }

    /// Ids of `text` as `inner.encode_fast(text, false)` gives them.
    ///
    /// # Errors
    /// The HF model's or pipeline's own error, as text.
    pub fn encode(&self, inner: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(inner, text, &mut ids)?;
        Ok(ids)
    }

    /// [`Self::encode`] appending to `ids`.
    ///
    /// # Errors
    /// As [`Self::encode`]'s; `ids` may then hold some of `text`'s ids.
    pub fn encode_into(
        &self,
        inner: &tokenizers::Tokenizer,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        let mut from = 0;
        if let Some(ac) = &self.added
            && self.may_hold_added(text)
        {
            for m in ac.find_iter(text) {
                self.encode_piece(inner, &text[from..m.start()], ids)?;
                ids.push(self.added_ids[m.pattern().as_usize()]);
                from = m.end();
            }
        }
        self.encode_piece(inner, &text[from..], ids)
    }

    /// False when `text` holds none of the added tokens' first bytes (one `memchr` pass for
    /// up to three distinct first bytes: Qwen3's all start with `<`, so a message's plain
    /// text skips the automaton); true when it may hold one.
    fn may_hold_added(&self, text: &str) -> bool {
        let t = text.as_bytes();
        match *self.added_first.as_slice() {
            [] => false,
            [a] => memchr::memchr(a, t).is_some(),
            [a, b] => memchr::memchr2(a, b, t).is_some(),
            [a, b, c] => memchr::memchr3(a, b, c, t).is_some(),
            _ => true,
        }
    }

    /// One piece without added tokens.
    fn encode_piece(
        &self,
        inner: &tokenizers::Tokenizer,
        piece: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        if piece.is_empty() {
            return Ok(());
        }
        if !piece.is_ascii() {
            let e = inner.encode_fast(piece, false).map_err(|e| e.to_string())?;
            ids.extend_from_slice(e.get_ids());
            return Ok(());
        }
        let model = inner.get_model();
        // Only a word the fast merge leaves to HF fills it (no allocation otherwise).
        let mut word = String::new();
        let bytes = piece.as_bytes();
        let mut ends = [0usize; PREFETCH_WORDS];
        let mut i = 0;
        while i < bytes.len() {
            // A batch of pre-tokens: their table slots are prefetched together, then the
            // words are merged in order.
            let (mut n, mut j) = (0, i);
            while n < PREFETCH_WORDS && j < bytes.len() {
                let end = next_pre_token(bytes, j, self.digits);
                if let Some(bpe) = &self.bpe {
                    bpe.prefetch(&bytes[j..end]);
                }
                ends[n] = end;
                n += 1;
                j = end;
            }
            for &end in &ends[..n] {
                let merged = self
                    .bpe
                    .as_ref()
                    .is_some_and(|bpe| bpe.push_word(&bytes[i..end], ids));
                if !merged {
                    word.clear();
                    word.extend(bytes[i..end].iter().map(|&b| self.byte_char[b as usize]));
                    for t in model.tokenize(&word).map_err(|e| e.to_string())? {
                        ids.push(t.id);
                    }
                }
                i = end;
            }
        }
        Ok(())
    }
}

/// GPT-2's bytes-to-unicode table (HF `ByteLevel`): printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100 onwards in byte order.
pub(crate) fn byte_level_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        *slot = if printable {
            char::from(b as u8)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("U+0100..U+0143 are chars")
        };
    }
    out
}

fn is_space(b: u8) -> bool {
    // Onig's \s on ASCII: \t \n \v \f \r and space.
    matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
}

fn is_punct(b: u8) -> bool {
    !is_space(b) && !b.is_ascii_alphanumeric()
}

fn letters_end(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_alphabetic() {
        i += 1;
    }
    i
}

/// End of the pre-token starting at `i` in ASCII `b` under the split regex
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
/// \s*[\r\n]+|\s+(?!\S)|\s+` (with `\p{N}{1,3}` for [`Digits::UpToThree`]): the first
/// alternative, in order, that matches at `i`, with its backtracking result. Every byte is
/// in some pre-token (the split is `Isolated`: unmatched text would be its own piece, but
/// the last alternative matches any whitespace and the others everything else).
pub fn next_pre_token(b: &[u8], i: usize, digits: Digits) -> usize {
    let n = b.len();
    let c = b[i];
    let lower = |k: usize| b.get(k).map(|x| x.to_ascii_lowercase());
    // 1. contractions
    if c == b'\'' {
        match (lower(i + 1), lower(i + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => {
                return i + 3;
            }
            _ => {}
        }
    }
    // 2. an optional non-letter, non-digit, non-newline, then letters
    if c.is_ascii_alphabetic() {
        return letters_end(b, i);
    }
    if c != b'\r'
        && c != b'\n'
        && !c.is_ascii_digit()
        && i + 1 < n
        && b[i + 1].is_ascii_alphabetic()
    {
        return letters_end(b, i + 1);
    }
    // 3. digits
    if c.is_ascii_digit() {
        let max = match digits {
            Digits::One => 1,
            Digits::UpToThree => 3,
        };
        let mut j = i + 1;
        while j < n && j - i < max && b[j].is_ascii_digit() {
            j += 1;
        }
        return j;
    }
    // 4. an optional space, punctuation, then newlines
    let punct_from = if c == b' ' && i + 1 < n && is_punct(b[i + 1]) {
        Some(i + 1)
    } else if is_punct(c) {
        Some(i)
    } else {
        None
    };
    if let Some(mut j) = punct_from {
        while j < n && is_punct(b[j]) {
            j += 1;
        }
        while j < n && (b[j] == b'\r' || b[j] == b'\n') {
            j += 1;
        }
        return j;
    }
    // c is whitespace from here on.
    let mut run = i;
    while run < n && is_space(b[run]) {
        run += 1;
    }
    // 5. \s*[\r\n]+: up to the last newline of the whitespace run
    if let Some(last) = (i..run).rev().find(|&k| b[k] == b'\r' || b[k] == b'\n') {
        return last + 1;
    }
    // 6. \s+(?!\S): the run, or all of it but its last char when a non-space follows
    if run == n {
        return run;
    }
    if run - i >= 2 {
        return run - 1;
    }
    // 7. \s+
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;
    use proptest::prelude::*;
    use std::sync::OnceLock;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn qwen() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::qwen3().unwrap())
    }

    fn fast() -> &'static FastEncoder {
        static F: OnceLock<FastEncoder> = OnceLock::new();
        F.get_or_init(|| FastEncoder::new(qwen().hf(), Digits::One).expect("the self-check passes"))
    }

    /// HF's own pre-token ends for `text` (Qwen3's pre-tokenizer, byte offsets).
    fn hf_splits(text: &str) -> Vec<usize> {
        let pt = qwen().hf().get_pre_tokenizer().unwrap();
        let mut pre = PreTokenizedString::from(text);
        pt.pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .iter()
            .map(|(_, (_, end), _)| *end)
            .collect()
    }

    fn our_splits(text: &str) -> Vec<usize> {
        let b = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            i = next_pre_token(b, i, Digits::One);
            out.push(i);
        }
        out
    }

    /// Worked examples of each alternative, against the regex read by hand.
    #[test]
    fn scanner_worked_examples() {
        let cases: &[(&str, &[&str])] = &[
            ("it's", &["it", "'s"]),
            ("I'LL go", &["I", "'LL", " go"]),
            (" hello world", &[" hello", " world"]),
            ("\thello", &["\thello"]),
            ("x123", &["x", "1", "2", "3"]),
            ("a  b", &["a", " ", " b"]),
            ("a \n\n  b", &["a", " \n\n", " ", " b"]),
            ("end.  ", &["end", ".", "  "]),
            (" (x) !!\n\nz", &[" (", "x", ")", " !!\n\n", "z"]),
            ("\r\n\r\n", &["\r\n\r\n"]),
        ];
        for (text, want) in cases {
            let mut got = Vec::new();
            let mut i = 0;
            while i < text.len() {
                let j = next_pre_token(text.as_bytes(), i, Digits::One);
                got.push(&text[i..j]);
                i = j;
            }
            assert_eq!(&got, want, "{text:?}");
            assert_eq!(our_splits(text), hf_splits(text), "{text:?}");
        }
        let three: Vec<usize> = {
            let b = b"x12345";
            let mut out = vec![];
            let mut i = 0;
            while i < b.len() {
                i = next_pre_token(b, i, Digits::UpToThree);
                out.push(i);
            }
            out
        };
        assert_eq!(three, [1, 4, 6]);
    }

    #[test]
    fn builds_for_qwen3_and_matches_hf_on_a_chat() {
        let t = qwen();
        let fast = fast();
        let chat = t
            .render_chat(
                &serde_json::json!([
                    {"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "Hi there!  What's 2+2?\n\nThanks — café"},
                ]),
                true,
            )
            .unwrap();
        let hf = t
            .hf()
            .encode_fast(chat.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(fast.encode(t.hf(), &chat).unwrap(), hf);
    }

    /// Adversarial ASCII: every class the regex distinguishes, runs of each, special tokens.
    fn ascii_text() -> impl Strategy<Value = String> {
        let atom = prop_oneof![
            Just(" ".to_string()),
            Just("  ".to_string()),
            Just("\n".to_string()),
            Just("\r\n".to_string()),
            Just("\t".to_string()),
            Just("\x0b".to_string()),
            Just("'".to_string()),
            Just("'s".to_string()),
            Just("'LL".to_string()),
            Just("'re".to_string()),
            Just("<|im_start|>".to_string()),
            Just("<|im_end|>".to_string()),
            Just("<think>".to_string()),
            "[a-zA-Z]{1,6}",
            "[0-9]{1,5}",
            "[!-/:-@\\[-`{-~]{1,3}",
            "[ -~]{1,4}",
        ];
        prop::collection::vec(atom, 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// The scanner splits as HF's pre-tokenizer, and the fast ids equal HF's, on any text
        /// of the adversarial alphabet (plus some non-ASCII through the fallback).
        #[test]
        fn fast_ids_equal_hf(text in ascii_text(), tail in prop_oneof![Just(""), Just("é"), Just(" 日本"), Just("\u{301}")]) {
            let t = qwen();
            if !text.contains('<') {
                prop_assert_eq!(our_splits(&text), hf_splits(&text));
            }
            let text = format!("{text}{tail}");
            let hf = t.hf().encode_fast(text.as_str(), false).unwrap().get_ids().to_vec();
            prop_assert_eq!(fast().encode(t.hf(), &text).unwrap(), hf);
        }
    }
}
