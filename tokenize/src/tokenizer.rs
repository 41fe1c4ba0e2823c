//! [`Tokenizer`]: a HF `tokenizers` instance plus its chat template.

use crate::{ChatTemplate, TokenizeError};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// gzip of the Qwen3 `tokenizer.json` (11.4 MB unpacked, 151,669 ids with specials).
static QWEN3_TOKENIZER_GZ: &[u8] = include_bytes!("../assets/qwen3/tokenizer.json.gz");
/// Qwen3 `tokenizer_config.json` with the real chat template.
static QWEN3_CONFIG: &str = include_str!("../assets/qwen3/tokenizer_config.json");

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
        Self {
            at,
            all,
            first_bytes,
        }
    }

    /// True when no added token occurs in `text` across byte `p` (starting before it and
    /// ending after it).
    fn no_straddle(&self, text: &str, p: usize) -> bool {
        let bytes = text.as_bytes();
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
        Ok(Self {
            inner: Arc::new(inner),
            chat,
            cuts: Arc::new(cuts),
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
        }
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
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
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

    #[test]
    fn missing_file_is_a_named_error() {
        let err = Tokenizer::from_path(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(matches!(err, TokenizeError::Io { .. }), "{err}");
    }
}
