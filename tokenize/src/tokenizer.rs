//! [`Tokenizer`]: a HF `tokenizers` instance plus its chat template.

use crate::fast::{Digits, FastEncoder};
use crate::native::{PlainMessage, RenderOptions, TemplateIds};
use crate::{ChatTemplate, TokenizeError};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// gzip of the Qwen3 `tokenizer.json` (11.4 MB unpacked, 151,669 ids with specials).
static QWEN3_TOKENIZER_GZ: &[u8] = include_bytes!("../assets/qwen3/tokenizer.json.gz");
/// Qwen3 `tokenizer_config.json` with the real chat template.
pub(crate) static QWEN3_CONFIG: &str = include_str!("../assets/qwen3/tokenizer_config.json");

/// A tokenizer as the engine uses it: `encode` adds no special tokens (HF
/// `add_special_tokens=False`) but recognises special tokens written in the text, so a rendered
/// chat prompt encodes to the ids the engine computes.
///
/// Cheap to clone (the HF model is shared behind an `Arc`). Load once per shard at start-up.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    chat: Option<ChatTemplate>,
    cuts: Arc<CutTokens>,
    text_cuts: Arc<TextCutRule>,
    /// The fast path of `encode` for recognised pipelines (`crate::fast`), `None` else.
    fast: Option<Arc<FastEncoder>>,
    /// The native Qwen3 template's fixed texts as ids, with the fast path only
    /// ([`Tokenizer::encode_message_into`]).
    template_ids: Option<Arc<TemplateIds>>,
}

/// [`Tokenizer::template_ids`]: for the native Qwen3 template on a pipeline with the fast path
/// (whose added tokens are all plain: [`crate::fast`]), when the vocabulary allows it.
fn template_ids(
    chat: Option<&ChatTemplate>,
    fast: bool,
    inner: &tokenizers::Tokenizer,
) -> Option<Arc<TemplateIds>> {
    chat.filter(|c| c.is_native_qwen3() && fast)
        .and_then(|_| TemplateIds::new(inner))
        .map(Arc::new)
}

/// Split regexes (HF `Split` pre-tokenizer, `behavior: Isolated`, `invert: false`) for which
/// [`Tokenizer::is_text_cut`]'s rule is proven exact (see there): every alternative that can
/// consume an ASCII letter consumes only letters after its first character, and none looks
/// behind. Sources: Qwen2/2.5/3 `tokenizer.json` (the first, `\p{N}` single digits) and
/// Llama 3 / OpenAI cl100k (the second, `\p{N}{1,3}`).
pub const TEXT_CUT_SPLIT_REGEXES: [&str; 2] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Bytes of text on each side of a text cut that [`Tokenizer::verify_text_cut`] runs through
/// the added-token split, normalizer and pre-tokenizer: enough for the letter before the cut
/// and what follows it; the HF pipeline costs ~0.4 µs per byte, so a check is ~5 µs.
pub const TEXT_CUT_VERIFY_WINDOW: usize = 8;

/// Whether this tokenizer's pipeline was recognised as one where cuts inside plain text are
/// exact (see [`Tokenizer::is_text_cut`]); `Err` names what was not recognised.
#[derive(Debug)]
struct TextCutRule(Result<(), String>);

impl TextCutRule {
    /// Classifies the HF pipeline once, at load time. Text cuts are enabled only for:
    /// - no truncation, no padding, special tokens split out of the text (`encode_special_tokens`
    ///   false), and every added token with `normalized`, `lstrip`, `rstrip`, `single_word`
    ///   false (matched on the raw text, so the template-cut straddle check covers them);
    /// - normalizer absent or NFC (alone or in a `Sequence`): an ASCII character is a
    ///   normalization boundary (combining class 0, never the second of a composition pair);
    /// - pre-tokenizer `Sequence[Split(one of TEXT_CUT_SPLIT_REGEXES, Isolated, invert false),
    ///   ByteLevel(add_prefix_space false, use_regex false)]`, or `ByteLevel(add_prefix_space
    ///   false, use_regex true)` alone (GPT-2 regex, same proof);
    /// - model BPE without dropout (ids of a pre-token depend on that pre-token only).
    ///
    /// Post-processors are not checked: with `add_special_tokens=false` none of HF's adds ids.
    fn classify(inner: &tokenizers::Tokenizer) -> Self {
        Self(Self::check(inner))
    }

    /// For a recognised pipeline whose pre-tokenizer is a `Split` on one of
    /// [`TEXT_CUT_SPLIT_REGEXES`], how that regex splits digits; `None` otherwise (the GPT-2
    /// `ByteLevel` regex has no fast path).
    fn digits(&self, inner: &tokenizers::Tokenizer) -> Option<Digits> {
        self.0.as_ref().ok()?;
        let pre = serde_json::to_value(inner.get_pre_tokenizer()?).ok()?;
        let pattern = pre["pretokenizers"][0]["pattern"]["Regex"].as_str()?;
        match TEXT_CUT_SPLIT_REGEXES.iter().position(|r| *r == pattern)? {
            0 => Some(Digits::One),
            _ => Some(Digits::UpToThree),
        }
    }

    fn check(inner: &tokenizers::Tokenizer) -> Result<(), String> {
        if inner.get_truncation().is_some() || inner.get_padding().is_some() {
            return Err("truncation or padding is set".into());
        }
        if inner.get_encode_special_tokens() {
            return Err("encode_special_tokens is set".into());
        }
        for t in inner.get_added_tokens_decoder().values() {
            if t.normalized || t.lstrip || t.rstrip || t.single_word {
                return Err(format!("added token {:?} is not plain", t.content));
            }
        }
        let json = |v: Result<serde_json::Value, serde_json::Error>| v.unwrap_or_default();
        if let Some(n) = inner.get_normalizer() {
            let n = json(serde_json::to_value(n));
            let nfc = |v: &serde_json::Value| v["type"] == "NFC";
            let ok = nfc(&n)
                || (n["type"] == "Sequence"
                    && n["normalizers"]
                        .as_array()
                        .is_some_and(|a| a.iter().all(nfc)));
            if !ok {
                return Err(format!("normalizer {} is not NFC", n["type"]));
            }
        }
        let Some(pre) = inner.get_pre_tokenizer() else {
            return Err("no pre-tokenizer".into());
        };
        let pre = json(serde_json::to_value(pre));
        let byte_level = |v: &serde_json::Value, regex: bool| {
            v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == regex
        };
        let split = |v: &serde_json::Value| {
            v["type"] == "Split"
                && v["behavior"] == "Isolated"
                && v["invert"] == false
                && v["pattern"]["Regex"]
                    .as_str()
                    .is_some_and(|r| TEXT_CUT_SPLIT_REGEXES.contains(&r))
        };
        let ok = byte_level(&pre, true)
            || (pre["type"] == "Sequence"
                && pre["pretokenizers"]
                    .as_array()
                    .is_some_and(|a| a.len() == 2 && split(&a[0]) && byte_level(&a[1], false)));
        if !ok {
            return Err(format!(
                "pre-tokenizer {pre} is not a known byte-level regex split"
            ));
        }
        match inner.get_model() {
            tokenizers::ModelWrapper::BPE(b) if b.dropout.is_none_or(|d| d == 0.0) => Ok(()),
            tokenizers::ModelWrapper::BPE(_) => Err("BPE dropout is set".into()),
            _ => Err("model is not BPE".into()),
        }
    }
}

/// Where a prompt may be cut so that tokenizing the pieces gives the ids of the whole.
///
/// The HF pipeline splits the text on added tokens (leftmost-longest, before normalization for
/// tokens with `normalized: false`) and then normalizes, pre-tokenizes and BPE-merges each
/// piece on its own. So a cut at the start of an added-token occurrence is exact as long as no
/// added token occurs across the cut. Only tokens with `normalized`, `lstrip`, `rstrip` and
/// `single_word` all false qualify, and when the chat template is known only those it spells
/// (e.g. `<|im_start|>`), i.e. message boundaries.
#[derive(Debug, Default)]
struct CutTokens {
    /// Contents of the added tokens a cut may start at.
    at: Vec<String>,
    /// Contents of every added token (for the straddle check).
    all: Vec<String>,
    /// Distinct first bytes of `at` (what the scan looks for).
    first_bytes: Vec<u8>,
    /// Every pair of adjacent bytes inside an added token (`a << 8 | b`), sorted: a token can
    /// straddle byte `p` only if `(text[p-1], text[p])` is one of them.
    pairs: Vec<u16>,
}

impl CutTokens {
    fn new(inner: &tokenizers::Tokenizer, template: Option<&str>) -> Self {
        let mut all = Vec::new();
        let mut at = Vec::new();
        for t in inner.get_added_tokens_decoder().values() {
            if t.content.is_empty() {
                continue;
            }
            all.push(t.content.clone());
            let plain = !t.normalized && !t.lstrip && !t.rstrip && !t.single_word;
            let in_template = template.is_none_or(|src| src.contains(&t.content));
            if plain && in_template && (t.special || template.is_some()) {
                at.push(t.content.clone());
            }
        }
        at.sort();
        all.sort();
        let mut first_bytes: Vec<u8> = at.iter().map(|t| t.as_bytes()[0]).collect();
        first_bytes.sort_unstable();
        first_bytes.dedup();
        let mut pairs: Vec<u16> = all
            .iter()
            .flat_map(|t| {
                t.as_bytes()
                    .windows(2)
                    .map(|w| u16::from(w[0]) << 8 | u16::from(w[1]))
            })
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        Self {
            at,
            all,
            first_bytes,
            pairs,
        }
    }

    /// True when no added token occurs in `text` across byte `p` (starting before it and
    /// ending after it).
    fn no_straddle(&self, text: &str, p: usize) -> bool {
        let bytes = text.as_bytes();
        if p == 0 || p >= bytes.len() {
            return true;
        }
        let pair = u16::from(bytes[p - 1]) << 8 | u16::from(bytes[p]);
        if self.pairs.binary_search(&pair).is_err() {
            return true;
        }
        self.all.iter().all(|t| {
            let t = t.as_bytes();
            (1..t.len().min(p + 1)).all(|back| {
                let start = p - back;
                !(bytes.len() >= start + t.len() && &bytes[start..start + t.len()] == t)
            })
        })
    }
}

impl Tokenizer {
    /// The embedded Qwen3 tokenizer and chat template (see the crate doc for its origin).
    ///
    /// # Errors
    /// Never for the shipped assets; the `Result` covers a corrupted build.
    pub fn qwen3() -> Result<Self, TokenizeError> {
        let embedded = PathBuf::from("<embedded qwen3>");
        let mut json = Vec::with_capacity(12 << 20);
        flate2::read::GzDecoder::new(QWEN3_TOKENIZER_GZ)
            .read_to_end(&mut json)
            .map_err(|source| TokenizeError::Io {
                path: embedded.clone(),
                source,
            })?;
        Self::from_parts(&json, Some(QWEN3_CONFIG), &embedded)
    }

    /// Loads `path`: a `tokenizer.json`, or a directory holding `tokenizer.json` and
    /// optionally `tokenizer_config.json` (for the chat template).
    ///
    /// # Errors
    /// [`TokenizeError::Io`] when a file cannot be read, [`TokenizeError::InvalidTokenizer`] /
    /// [`TokenizeError::InvalidConfig`] when it does not parse, [`TokenizeError::Template`]
    /// when the chat template does not compile.
    pub fn from_path(path: &Path) -> Result<Self, TokenizeError> {
        let (json_path, config_path) = if path.is_dir() {
            (
                path.join("tokenizer.json"),
                path.join("tokenizer_config.json"),
            )
        } else {
            let dir = path.parent().unwrap_or(Path::new("."));
            (path.to_path_buf(), dir.join("tokenizer_config.json"))
        };
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| TokenizeError::Io {
                path: p.to_path_buf(),
                source,
            })
        };
        let json = read(&json_path)?;
        let config = if config_path.is_file() {
            Some(String::from_utf8_lossy(&read(&config_path)?).into_owned())
        } else {
            None
        };
        Self::from_parts(&json, config.as_deref(), &json_path)
    }

    fn from_parts(json: &[u8], config: Option<&str>, path: &Path) -> Result<Self, TokenizeError> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| {
            TokenizeError::InvalidTokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            }
        })?;
        let chat = match config {
            None => None,
            Some(text) => {
                let cfg: serde_json::Value =
                    serde_json::from_str(text).map_err(|source| TokenizeError::InvalidConfig {
                        path: path.to_path_buf(),
                        source,
                    })?;
                let token = |key: &str| match &cfg[key] {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Object(o) => o
                        .get("content")
                        .and_then(|c| c.as_str())
                        .unwrap_or_default()
                        .to_string(),
                    _ => String::new(),
                };
                match cfg["chat_template"].as_str() {
                    Some(src) => Some(ChatTemplate::new(
                        src,
                        &token("bos_token"),
                        &token("eos_token"),
                    )?),
                    None => None,
                }
            }
        };
        let template_src = config.and_then(|text| {
            serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|c| c["chat_template"].as_str().map(str::to_string))
        });
        let cuts = CutTokens::new(&inner, template_src.as_deref());
        let text_cuts = TextCutRule::classify(&inner);
        let fast = text_cuts
            .digits(&inner)
            .and_then(|d| FastEncoder::new(&inner, d))
            .map(Arc::new);
        let template_ids = template_ids(chat.as_ref(), fast.is_some(), &inner);
        Ok(Self {
            inner: Arc::new(inner),
            chat,
            cuts: Arc::new(cuts),
            text_cuts: Arc::new(text_cuts),
            fast,
            template_ids,
        })
    }

    /// A copy for one shard: the HF model is deep-copied, so each shard has its own BPE word
    /// cache and no lock or cache line is shared between cores. Costs one copy of the
    /// vocabulary (~tens of MB for a 150k vocabulary); call once per shard at start-up.
    pub fn for_shard(&self) -> Tokenizer {
        Tokenizer {
            inner: Arc::new((*self.inner).clone()),
            chat: self.chat.clone(),
            cuts: self.cuts.clone(),
            text_cuts: self.text_cuts.clone(),
            fast: self.fast.clone(),
            template_ids: self.template_ids.clone(),
        }
    }

    /// True when `encode` takes the fast path ([`crate::fast`]) for ASCII text.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// The HF tokenizer itself.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Byte offsets in `text` (ascending, each in `1..text.len()`) where the prompt may be cut
    /// so that `encode(&text[..p]) ++ encode(&text[p..]) == encode(text)`: starts of the chat
    /// template's special tokens (e.g. `<|im_start|>`) with no added token across them.
    pub fn cut_points(&self, text: &str) -> Vec<usize> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let check = |p: usize, out: &mut Vec<usize>| {
            if p > 0
                && self
                    .cuts
                    .at
                    .iter()
                    .any(|t| bytes[p..].starts_with(t.as_bytes()))
                && self.cuts.no_straddle(text, p)
            {
                out.push(p);
            }
        };
        match self.cuts.first_bytes.as_slice() {
            [] => {}
            [b] => memchr::memchr_iter(*b, bytes).for_each(|p| check(p, &mut out)),
            [a, b] => memchr::memchr2_iter(*a, *b, bytes).for_each(|p| check(p, &mut out)),
            [a, b, c] => memchr::memchr3_iter(*a, *b, *c, bytes).for_each(|p| check(p, &mut out)),
            many => (0..bytes.len())
                .filter(|&p| many.contains(&bytes[p]))
                .for_each(|p| check(p, &mut out)),
        }
        out
    }

    /// True when this tokenizer's pipeline allows cuts inside plain text
    /// ([`Tokenizer::is_text_cut`]); false means only template cuts ([`Tokenizer::cut_points`]).
    pub fn text_cuts_enabled(&self) -> bool {
        self.text_cuts.0.is_ok()
    }

    /// Why text cuts are disabled for this tokenizer (which part of the normalizer,
    /// pre-tokenizer, model or added tokens was not recognised), or `None` when enabled.
    pub fn text_cuts_disabled_reason(&self) -> Option<&str> {
        self.text_cuts.0.as_ref().err().map(String::as_str)
    }

    /// Byte offsets `p` (ascending, in `1..text.len()`) where the byte rule of a text cut holds:
    /// `text[p-1]` is an ASCII letter and `text[p]` an ASCII byte that is not a letter (space,
    /// newline, digit, punctuation, …). A candidate is a cut only if
    /// [`Tokenizer::is_text_cut`] also holds (no added token across it). Empty when text cuts
    /// are disabled.
    pub fn text_cut_candidates<'a>(&self, text: &'a str) -> impl Iterator<Item = usize> + 'a {
        let bytes = if self.text_cuts_enabled() {
            text.as_bytes()
        } else {
            &[]
        };
        // Eight bytes at a time (SWAR, ~0.2 ns/byte): high bit of byte j of `letters` set iff
        // byte j is an ASCII letter, of `others` iff it is ASCII and not a letter; a candidate
        // is an `others` byte whose previous byte (carried across words) is a letter.
        const HI: u64 = 0x8080_8080_8080_8080;
        const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
        let classify = |x: u64| {
            let y = (x | 0x2020_2020_2020_2020) & LOW7; // ASCII letters fold to a..z
            let ge_a = (y + 0x1F1F_1F1F_1F1F_1F1F) & HI; // y >= 0x61
            let gt_z = (y + 0x0505_0505_0505_0505) & HI; // y >= 0x7B
            let letters = ge_a & !gt_z & !x & HI;
            (letters, !letters & !x & HI)
        };
        let (mut chunk, mut pending, mut carry) = (0usize, 0u64, 0u64);
        std::iter::from_fn(move || {
            loop {
                if pending != 0 {
                    let j = pending.trailing_zeros() as usize / 8;
                    pending &= pending - 1;
                    return Some((chunk - 1) * 8 + j);
                }
                let base = chunk * 8;
                if base >= bytes.len() {
                    return None;
                }
                let mut word = [0u8; 8];
                let n = (bytes.len() - base).min(8);
                word[..n].copy_from_slice(&bytes[base..base + n]);
                let (letters, others) = classify(u64::from_le_bytes(word));
                let valid = if n == 8 {
                    u64::MAX
                } else {
                    (1u64 << (8 * n)) - 1
                };
                pending = ((letters << 8) | carry) & others & valid;
                carry = (letters >> 56) & 0x80;
                chunk += 1;
            }
        })
    }

    /// True when `p` is a cut inside plain text, i.e. `encode(&text[..p]) ++ encode(&text[p..])
    /// == encode(text)`: text cuts are enabled for this pipeline, `text[p-1]` is an ASCII
    /// letter, `text[p]` an ASCII non-letter, and no added token occurs across `p`.
    ///
    /// Why it is exact (HF pipeline order: added-token split, normalizer, pre-tokenizer, model):
    /// 1. Added tokens are matched leftmost-longest on the raw text; with none across `p`, the
    ///    matches of the two pieces are those of the whole, and `p` falls inside one plain span.
    /// 2. NFC cannot change anything across `p`: `text[p]` is ASCII, a starter that is never the
    ///    second of a composition pair, so NFC(a ++ b) = NFC(a) ++ NFC(b); both bytes stay put.
    /// 3. The split regex (one of [`TEXT_CUT_SPLIT_REGEXES`], or the GPT-2 one) has no
    ///    look-behind or anchor, and the only alternatives that consume the letter `text[p-1]`
    ///    are `\p{L}+` runs (with at most one leading non-letter) and contractions ending in a
    ///    letter: greedy, they stop at the non-letter `text[p]` whatever follows (end of text or
    ///    more), so the whole text has a pre-token boundary at `p`, the pre-tokens before it are
    ///    those of `text[..p]`, and matching resumes at `p` exactly as on `text[p..]`.
    /// 4. ByteLevel (without regex) maps bytes one to one, and BPE merges within a pre-token.
    pub fn is_text_cut(&self, text: &str, p: usize) -> bool {
        let b = text.as_bytes();
        self.text_cuts_enabled()
            && p > 0
            && p < b.len()
            && b[p - 1].is_ascii_alphabetic()
            && b[p] < 0x80
            && !b[p].is_ascii_alphabetic()
            && self.cuts.no_straddle(text, p)
    }

    /// [`Tokenizer::is_text_cut`], plus a check of the running pipeline itself: the
    /// [`TEXT_CUT_VERIFY_WINDOW`] bytes each side of `p` go through the tokenizer's own
    /// added-token split, normalizer and pre-tokenizer, and one pre-token must end exactly at
    /// `p`. Costs a few µs; meant for each cut actually used (a defence in depth against a
    /// pipeline misclassified by [`Tokenizer::text_cuts_enabled`]).
    pub fn verify_text_cut(&self, text: &str, p: usize) -> bool {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizer};
        if !self.is_text_cut(text, p) {
            return false;
        }
        let mut a = p.saturating_sub(TEXT_CUT_VERIFY_WINDOW);
        while !text.is_char_boundary(a) {
            a -= 1;
        }
        let mut b = (p + TEXT_CUT_VERIFY_WINDOW).min(text.len());
        while !text.is_char_boundary(b) {
            b += 1;
        }
        let mut pre = self
            .inner
            .get_added_vocabulary()
            .extract_and_normalize(self.inner.get_normalizer(), &text[a..b]);
        if let Some(pt) = self.inner.get_pre_tokenizer()
            && pt.pre_tokenize(&mut pre).is_err()
        {
            return false;
        }
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .iter()
            .any(|(_, (_, end), _)| *end == p - a)
    }

    /// Token ids of `text`, without added special tokens (HF `add_special_tokens=False`);
    /// special tokens spelled in the text (e.g. `<|im_start|>`) become their ids.
    ///
    /// # Panics
    /// Never in practice: the HF encoder only fails on internal errors, which are reported
    /// as an empty result by [`Tokenizer::try_encode`]'s caller here.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).unwrap_or_default()
    }

    /// Like [`Tokenizer::encode`], but reports the tokenizer's internal error.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails.
    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(text, &mut ids)?;
        Ok(ids)
    }

    /// [`Tokenizer::try_encode`] appending to `ids` (a caller joining several texts' ids,
    /// such as a chat turn's messages, makes no buffer per text). On an error `ids` may hold
    /// some of `text`'s ids after its old contents.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails.
    pub fn encode_into(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if let Some(fast) = &self.fast {
            return fast
                .encode_into(&self.inner, text, ids)
                .map_err(TokenizeError::Encode);
        }
        self.inner
            .encode_fast(text, false)
            .map(|e| ids.extend_from_slice(e.get_ids()))
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Appends to `ids` the ids of message `m`'s text under the native Qwen3 template
    /// ([`crate::native::render_message`]; `wrapped`: [`crate::native::think_wrapped`]), as
    /// [`Tokenizer::encode_into`] of that text gives them: from the template's known ids
    /// ([`TemplateIds`]) when this tokenizer has them, else by rendering into `buf` (scratch)
    /// and encoding it.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails.
    pub fn encode_message_into(
        &self,
        m: &PlainMessage<'_>,
        wrapped: bool,
        buf: &mut String,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        match &self.template_ids {
            Some(t) => t.encode_message(m, wrapped, buf, ids, |s, ids| self.encode_into(s, ids)),
            None => {
                buf.clear();
                crate::native::render_message(buf, m, wrapped);
                self.encode_into(buf, ids)
            }
        }
    }

    /// [`Tokenizer::encode_message_into`] for the generation prompt
    /// ([`crate::native::render_generation`]).
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] when the HF pipeline fails.
    pub fn encode_generation_into(
        &self,
        opts: RenderOptions,
        buf: &mut String,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        match &self.template_ids {
            Some(t) => t.encode_generation(opts, ids, |s, ids| self.encode_into(s, ids)),
            None => {
                buf.clear();
                crate::native::render_generation(buf, opts);
                self.encode_into(buf, ids)
            }
        }
    }

    /// Text of `ids`, special tokens kept (HF `skip_special_tokens=False`).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// The vocabulary string of `id` (byte-level BPE form, e.g. `Ġhello`), or `None` when out of
    /// range.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, special tokens included (151,669 for Qwen3).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The chat template, if `tokenizer_config.json` had one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// Renders a Chat Completions body (JSON bytes: `messages`, `tools`,
    /// `chat_template_kwargs`, `add_generation_prompt`) with the chat template, keys in request
    /// order (see [`ChatTemplate::render_body`]).
    ///
    /// # Errors
    /// [`TokenizeError::NoChatTemplate`] without a template; [`TokenizeError::ChatBody`] when
    /// the body has no `messages` array; [`TokenizeError::Template`] when rendering fails.
    pub fn render_chat_body(&self, body: &[u8]) -> Result<String, TokenizeError> {
        self.chat
            .as_ref()
            .ok_or(TokenizeError::NoChatTemplate)?
            .render_body(body)
    }

    /// Renders `messages` with the chat template (no tools).
    ///
    /// # Errors
    /// [`TokenizeError::NoChatTemplate`] without a template; [`TokenizeError::Template`] when
    /// rendering fails.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        self.chat
            .as_ref()
            .ok_or(TokenizeError::NoChatTemplate)?
            .render(messages, None, add_generation_prompt)
    }
}

impl Tokenizer {
    /// A copy whose HF pipeline is changed by `edit` (template cuts kept, text-cut rule
    /// re-classified, or forced on to test the run-time check). Tests only.
    #[cfg(test)]
    pub(crate) fn with_pipeline(
        &self,
        edit: impl FnOnce(&mut tokenizers::Tokenizer),
        force_text_cuts: bool,
    ) -> Self {
        let mut inner = (*self.inner).clone();
        edit(&mut inner);
        let mut text_cuts = TextCutRule::classify(&inner);
        let fast = text_cuts
            .digits(&inner)
            .and_then(|d| FastEncoder::new(&inner, d))
            .map(Arc::new);
        if force_text_cuts {
            text_cuts = TextCutRule(Ok(()));
        }
        Tokenizer {
            template_ids: template_ids(self.chat.as_ref(), fast.is_some(), &inner),
            inner: Arc::new(inner),
            chat: self.chat.clone(),
            cuts: self.cuts.clone(),
            text_cuts: Arc::new(text_cuts),
            fast,
        }
    }
}

/// The embedded Qwen3 tokenizer, loaded once per test binary (tests only).
#[cfg(test)]
pub(crate) fn test_qwen() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| Tokenizer::qwen3().expect("embedded qwen3"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use super::test_qwen as qwen;

    /// Test vectors from traces.md §6, checked there against the file.
    #[test]
    fn qwen3_vectors() {
        let t = qwen();
        assert_eq!(t.vocab_size(), 151_669);
        assert_eq!(t.encode("hello"), vec![14990]);
        assert_eq!(t.encode("Hello, world!"), vec![9707, 11, 1879, 0]);
        assert_eq!(
            t.encode("<|im_start|>user\nHello<|im_end|>\n"),
            vec![151644, 872, 198, 9707, 151645, 198]
        );
        assert_eq!(
            t.encode("<|im_start|>assistant\n"),
            vec![151644, 77091, 198]
        );
        assert_eq!(
            t.encode("  spaces   and\n\nnewlines 12345"),
            vec![
                220, 12621, 256, 323, 271, 931, 7969, 220, 16, 17, 18, 19, 20
            ]
        );
        assert_eq!(
            t.encode("café é 中文 😀"),
            vec![924, 58858, 3958, 72858, 16744, 90316]
        );
        assert_eq!(t.encode("cafe\u{301}"), vec![924, 58858]);
        assert_eq!(t.id_to_token(279).as_deref(), Some("Ġthe"));
    }

    /// traces.md §3: a chat with one user message gains `[151644, 872, 198]` before and
    /// `[151645, 198, 151644, 77091, 198]` after its text.
    #[test]
    fn qwen3_chat_template_wraps_one_user_message() {
        let t = qwen();
        let text = " sticky finder vic quieter tendency adultos compuls purely";
        let prompt = t
            .render_chat(&json!([{"role": "user", "content": text}]), true)
            .unwrap();
        assert_eq!(
            prompt,
            format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        );
        let ids = t.encode(&prompt);
        let body = vec![27402, 43730, 31431, 89745, 30854, 88631, 47106, 31127];
        let mut want = vec![151644, 872, 198];
        want.extend(&body);
        want.extend([151645, 198, 151644, 77091, 198]);
        assert_eq!(ids, want);
    }

    #[test]
    fn qwen3_chat_template_system_and_turns() {
        let t = qwen();
        let msgs = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}
        ]);
        let prompt = t.render_chat(&msgs, false).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
    }

    proptest::proptest! {
        /// The word-at-a-time scan finds exactly the offsets of the byte rule (random bytes,
        /// biased to ASCII letters and the punctuation around them, lossy UTF-8).
        #[test]
        fn text_cut_candidates_match_the_byte_rule(
            v in proptest::collection::vec(
                proptest::prop_oneof![proptest::prelude::any::<u8>(), 0x20u8..0x7F],
                0..80,
            )
        ) {
            let text = String::from_utf8_lossy(&v).into_owned();
            let b = text.as_bytes();
            let want: Vec<usize> = (1..b.len())
                .filter(|&p| {
                    b[p - 1].is_ascii_alphabetic() && b[p].is_ascii() && !b[p].is_ascii_alphabetic()
                })
                .collect();
            proptest::prop_assert_eq!(qwen().text_cut_candidates(&text).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn missing_file_is_a_named_error() {
        let err = Tokenizer::from_path(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(matches!(err, TokenizeError::Io { .. }), "{err}");
    }
}
