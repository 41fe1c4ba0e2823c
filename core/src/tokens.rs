//! Token ids for routing: where they come from, and the per-shard tokenizers (over one shared
//! prefix cache per model) that make them.
//!
//! Order (issue 4, as SMG's token tree, anchors.md §2.1):
//! 1. the body's ids — `input_ids` of `/generate` (first of a batch) or a token-id `prompt` of
//!    `/v1/completions` — set by [`route_key`](crate::route_key::route_key);
//! 2. the `x-kvroute-routing-tokens` header: comma-separated decimal ids, at most
//!    [`MAX_HEADER_IDS`] ids and [`MAX_HEADER_BYTES`] bytes; malformed or oversized → ignored
//!    (and counted), never an error;
//! 3. the prompt as the engine sees it: chat bodies rendered with the model's chat template,
//!    completions `prompt` / generate `text` as is, then tokenized — incrementally, so a new
//!    turn of a long conversation costs only its new messages.
//!
//! Without a tokenizer for the request's model, step 3 is skipped and routing stays in text
//! mode. [`Tokenizers`] is loaded once at start-up and shared; each shard turns it into its
//! own [`ShardTokenizers`] (deep copies of the HF models plus a prefix cache), so no lock or
//! cache is shared between cores.

use crate::CoreError;
use crate::chat_prefix::{
    ChatCache, ChatInsert, OthersMemo, PrefixScanner, SharedChatCache, candidates,
};
use crate::config::Config;
use crate::ids::BlockKeySeq;
use crate::route_key::{Endpoint, RouteKey, TokenSource, route_key};
use kvroute_tokenize::incremental::{PrefixCache, SharedPrefixCache};
use kvroute_tokenize::{IncrementalTokenizer, TokenizeError, Tokenizer};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// `--tokenizer` value naming the Qwen3 tokenizer embedded in the binary (no file needed).
pub const BUILTIN_QWEN3: &str = "builtin:qwen3";

/// Name of the header carrying routing token ids (SMG: `x-smg-routing-tokens`).
pub const ROUTING_TOKENS_HEADER: &str = "x-kvroute-routing-tokens";
/// Most ids accepted in [`ROUTING_TOKENS_HEADER`]. Source: SMG (anchors.md §2.1).
pub const MAX_HEADER_IDS: usize = 512;
/// Longest [`ROUTING_TOKENS_HEADER`] value accepted, bytes. Source: SMG (anchors.md §2.1).
pub const MAX_HEADER_BYTES: usize = 4096;

/// Why a [`ROUTING_TOKENS_HEADER`] value was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderRejection {
    /// Longer than [`MAX_HEADER_BYTES`].
    TooLong,
    /// More than [`MAX_HEADER_IDS`] ids.
    TooMany,
    /// Empty, an empty item, or an item that is not a decimal u32 (spaces around items are
    /// allowed).
    Malformed,
}

impl HeaderRejection {
    /// Metric label: `too_long`, `too_many`, `malformed`.
    pub fn as_str(self) -> &'static str {
        match self {
            HeaderRejection::TooLong => "too_long",
            HeaderRejection::TooMany => "too_many",
            HeaderRejection::Malformed => "malformed",
        }
    }
}

/// Parses a [`ROUTING_TOKENS_HEADER`] value: `"1, 2,3"` → `[1, 2, 3]`.
///
/// # Errors
/// [`HeaderRejection::TooLong`] above [`MAX_HEADER_BYTES`] bytes;
/// [`HeaderRejection::TooMany`] above [`MAX_HEADER_IDS`] ids; [`HeaderRejection::Malformed`]
/// for an empty value or item, or an item that is not a decimal number in 0..=u32::MAX.
pub fn parse_routing_tokens(value: &[u8]) -> Result<Vec<u32>, HeaderRejection> {
    if value.len() > MAX_HEADER_BYTES {
        return Err(HeaderRejection::TooLong);
    }
    let text = std::str::from_utf8(value).map_err(|_| HeaderRejection::Malformed)?;
    let mut ids = Vec::new();
    for item in text.split(',') {
        let item = item.trim_matches([' ', '\t']);
        if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
            return Err(HeaderRejection::Malformed);
        }
        if ids.len() == MAX_HEADER_IDS {
            return Err(HeaderRejection::TooMany);
        }
        ids.push(item.parse().map_err(|_| HeaderRejection::Malformed)?);
    }
    Ok(ids)
}

/// The configured tokenizers, loaded once at start-up: `Send + Sync`, shared by all shards,
/// each with one prefix cache of `cache_tokens` ids shared by every shard's copy (so a
/// conversation's next turn reuses its ids whichever core its connection lands on).
#[derive(Debug, Clone, Default)]
pub struct Tokenizers {
    default: Option<(Tokenizer, SharedPrefixCache)>,
    by_model: Vec<(String, Tokenizer, SharedPrefixCache)>,
    chat: SharedChatCache,
}

impl Tokenizers {
    /// Loads `cfg.tokenizer` and every `cfg.models` entry (files only; no network). Empty when
    /// neither is set (text-mode routing).
    ///
    /// # Errors
    /// [`CoreError::Tokenizer`] naming the model (`*` for `tokenizer`) and path whose files
    /// are missing, unreadable or invalid, or whose chat template does not compile.
    pub fn load(cfg: &Config) -> Result<Self, CoreError> {
        let load = |model: &str, path: &Path| {
            let loaded = if path == Path::new(BUILTIN_QWEN3) {
                Tokenizer::qwen3()
            } else {
                Tokenizer::from_path(path)
            };
            loaded.map_err(|e| CoreError::Tokenizer {
                model: model.to_string(),
                path: path.display().to_string(),
                message: e.to_string(),
            })
        };
        let default = cfg.tokenizer.as_deref().map(|p| load("*", p)).transpose()?;
        let by_model = cfg
            .models
            .iter()
            .map(|(m, p)| Ok((m.clone(), load(m, p)?)))
            .collect::<Result<_, CoreError>>()?;
        Ok(Self::new(default, by_model, cfg.tokenize_cache_tokens))
    }

    /// Already-loaded tokenizers: `default` for any model, `by_model` for named ones; each
    /// caches up to `cache_tokens` prefix tokens, shared by all shards, and the chat prefix
    /// cache ([`crate::chat_prefix`]) holds up to `cache_tokens` token-equivalents for all.
    pub fn new(
        default: Option<Tokenizer>,
        by_model: Vec<(String, Tokenizer)>,
        cache_tokens: usize,
    ) -> Self {
        Self {
            default: default.map(|t| (t, PrefixCache::shared(cache_tokens))),
            by_model: by_model
                .into_iter()
                .map(|(m, t)| (m, t, PrefixCache::shared(cache_tokens)))
                .collect(),
            chat: ChatCache::shared(cache_tokens),
        }
    }

    /// True when no tokenizer is configured (text-mode routing for every model).
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.by_model.is_empty()
    }

    /// One shard's tokenizers: deep copies (see [`Tokenizer::for_shard`]) over the shared
    /// prefix caches. Call once per shard, on its thread.
    pub fn for_shard(&self) -> ShardTokenizers {
        let inc = |t: &Tokenizer, c: &SharedPrefixCache| {
            IncrementalTokenizer::with_cache(t.for_shard(), Arc::clone(c))
        };
        ShardTokenizers {
            default: self.default.as_ref().map(|(t, c)| inc(t, c)),
            by_model: self
                .by_model
                .iter()
                .map(|(m, t, c)| (m.clone(), inc(t, c)))
                .collect(),
            chat: Arc::clone(&self.chat),
            others: OthersMemo::default(),
        }
    }
}

/// Block keys of a request's ids in one namespace at one block size (what
/// [`crate::policy::Router::request`] computes), kept for the requests that extend it.
#[derive(Debug)]
pub struct BlockKeys {
    /// [`RouteKey::namespace`] they were computed in.
    pub namespace: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// [`kvroute_index::keys::block_keys_in`] of the ids: one per full block.
    pub keys: BlockKeySeq,
}

/// The block keys a [`RouteKey`]'s ids share with an earlier request (the chat prefix cache
/// sets it, [`crate::chat_prefix`]): that request's keys and how many of this key's first
/// ids they were computed over, and a slot where [`crate::policy::Router::request`] leaves
/// this key's own keys for the next turn. So a turn's block keys cost its new blocks only.
///
/// A cache riding on the key, not part of its value: any two memos compare equal. It is
/// valid for the ids [`ShardTokenizers::route`] gave the key; a caller that replaces
/// `input_ids` must reset it (`BlockKeyMemo::default()`).
#[derive(Clone, Default)]
pub struct BlockKeyMemo {
    reuse: Option<(Arc<BlockKeys>, usize)>,
    fill: Option<Arc<OnceLock<Arc<BlockKeys>>>>,
}

impl BlockKeyMemo {
    /// A memo reusing `reuse` (keys of an earlier request whose first `tokens` ids are this
    /// key's first `tokens`) and leaving this key's keys in `fill`.
    pub(crate) fn new(
        reuse: Option<(Arc<BlockKeys>, usize)>,
        fill: Arc<OnceLock<Arc<BlockKeys>>>,
    ) -> Self {
        Self {
            reuse,
            fill: Some(fill),
        }
    }

    /// Keys of the key's first `n` full blocks in namespace `ns` at `block_size` that an
    /// earlier request computed (`n` = the shared ids / `block_size`), sharing that
    /// request's buffer; `None` when there are none, or they were computed in another
    /// namespace or at another block size.
    pub fn known(&self, ns: u64, block_size: usize) -> Option<BlockKeySeq> {
        match &self.reuse {
            Some((k, tokens)) if k.namespace == ns && k.block_size == block_size => {
                Some(k.keys.head(k.keys.len().min(tokens / block_size)))
            }
            _ => None,
        }
    }

    /// Leaves `keys` (of the key's whole ids in `ns` at `block_size`) for the requests that
    /// extend this one, shared, not copied; the first call wins, later ones do nothing.
    pub fn keep(&self, ns: u64, block_size: usize, keys: &BlockKeySeq) {
        if let Some(slot) = &self.fill {
            slot.get_or_init(|| {
                Arc::new(BlockKeys {
                    namespace: ns,
                    block_size,
                    keys: keys.clone(),
                })
            });
        }
    }
}

impl BlockKeyMemo {
    /// The key's own block keys in `ns` at `block_size`, when [`Self::keep`] left them.
    pub fn kept(&self, ns: u64, block_size: usize) -> Option<Arc<BlockKeys>> {
        self.fill
            .as_ref()?
            .get()
            .filter(|k| k.namespace == ns && k.block_size == block_size)
            .cloned()
    }
}

impl PartialEq for BlockKeyMemo {
    /// Always true: a memo is a cache, not part of a key's value.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for BlockKeyMemo {}

impl std::fmt::Debug for BlockKeyMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockKeyMemo")
            .field("reuse_tokens", &self.reuse.as_ref().map(|r| r.1))
            .field("fill", &self.fill.is_some())
            .finish()
    }
}

/// What [`ShardTokenizers::attach`] did besides filling the key.
#[derive(Debug, Default)]
pub struct Attached {
    /// The header was present but ignored, and why.
    pub header_rejected: Option<HeaderRejection>,
    /// Prompt tokens taken from the prefix cache (source `prompt` only).
    pub reused_tokens: usize,
    /// Rendering or tokenizing the prompt failed; the key stays in text mode. The engine
    /// will judge the request itself.
    pub prompt_error: Option<TokenizeError>,
    /// The chat-prefix entries this request makes for its next turn, left for the caller to
    /// apply once the request has left for its worker ([`ShardTokenizers::route_scanned`];
    /// [`ShardTokenizers::route`] applies them itself).
    pub chat_insert: Option<ChatInsert>,
}

/// One shard's tokenizers and prefix caches. Not shared: lives in the shard's runtime.
#[derive(Debug)]
pub struct ShardTokenizers {
    default: Option<IncrementalTokenizer>,
    by_model: HashMap<String, IncrementalTokenizer>,
    /// The chat prefix cache of every model, shared by the shards ([`crate::chat_prefix`]).
    pub(crate) chat: SharedChatCache,
    /// The other fields of the shard's recent chat bodies, parsed.
    pub(crate) others: OthersMemo,
}

impl ShardTokenizers {
    /// The tokenizer for `model`: by exact name, then without a `:adapter` suffix, then the
    /// default.
    pub fn for_model(&mut self, model: &str) -> Option<&mut IncrementalTokenizer> {
        let name = if self.by_model.contains_key(model) {
            Some(model)
        } else {
            model
                .split_once(':')
                .map(|(base, _)| base)
                .filter(|b| self.by_model.contains_key(*b))
        };
        match name {
            Some(n) => self.by_model.get_mut(n),
            None => self.default.as_mut(),
        }
    }

    /// [`route_key`] of `body` and its token ids ([`ShardTokenizers::attach`]) in one step,
    /// through the chat prefix cache ([`crate::chat_prefix`]) for chat bodies without a
    /// routing-tokens `header`, so a conversation's turn costs what its new messages do.
    /// `tokenize(model)` is asked (with the body's `model`) before any tokenizing: when it says
    /// no (a request about to be refused, e.g. an unknown model) the key stays in text mode.
    /// The result is the one `route_key` then `attach` give, ids and key alike, except that a
    /// key with token ids has an empty `text`: token-mode routing reads only the ids
    /// ([`crate::policy::Router::request`]), so the chat path never copies a conversation's
    /// text out of its cache for them (at turn 10 of an 8k-token chat, ~35 KB a request).
    ///
    /// # Errors
    /// [`route_key`]'s, for a body it refuses.
    pub fn route(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        header: Option<&[u8]>,
        tokenize: &dyn Fn(&str) -> bool,
    ) -> Result<(RouteKey, Attached), CoreError> {
        let (key, mut attached) = self.route_scanned(endpoint, body, header, tokenize, None)?;
        if let Some(insert) = attached.chat_insert.take() {
            insert.apply();
        }
        Ok((key, attached))
    }

    /// True when [`Self::route`] of a body for `endpoint` scans it for cached chat prefixes
    /// (a chat body and a tokenizer; without a routing-tokens header): a transport then runs
    /// a [`PrefixScanner`] over the body as it arrives and hands it to
    /// [`Self::route_scanned`].
    pub fn scans(&self, endpoint: Endpoint) -> bool {
        endpoint == Endpoint::ChatCompletions
            && (self.default.is_some() || !self.by_model.is_empty())
    }

    /// [`Self::route`], with the prefix scan of `body` done as far as `scanner` was fed
    /// (`None`: all of it here), and the chat-prefix entries of the request left in
    /// [`Attached::chat_insert`] for the caller to apply once the request has left (the next
    /// turn needs them, this request does not). The answer is the same either way.
    ///
    /// # Errors
    /// [`route_key`]'s, for a body it refuses.
    pub fn route_scanned(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        header: Option<&[u8]>,
        tokenize: &dyn Fn(&str) -> bool,
        scanner: Option<PrefixScanner>,
    ) -> Result<(RouteKey, Attached), CoreError> {
        let chat = self.scans(endpoint) && header.is_none();
        // Candidate message ends and their hashes: one pass, for the lookup and the inserts.
        let cands = match scanner {
            _ if !chat => Vec::new(),
            Some(s) => s.finish(body),
            None => candidates(body),
        };
        if chat && let Some(r) = self.route_cached(body, &cands, tokenize) {
            return r;
        }
        let mut key = route_key(endpoint, body)?;
        if !tokenize(&key.model) {
            return Ok((key, Attached::default()));
        }
        if chat
            && key.input_ids.is_none()
            && let Some(r) = self.route_miss(body, &cands, &mut key)
        {
            let mut attached = Attached::default();
            match r {
                Ok((reused, insert)) => {
                    attached.reused_tokens = reused;
                    attached.chat_insert = insert;
                }
                Err(e) => attached.prompt_error = Some(e),
            }
            return Ok((key, attached));
        }
        let attached = self.attach(endpoint, body, header, &mut key);
        if key.input_ids.is_some() {
            key.text = String::new();
        }
        Ok((key, attached))
    }

    /// Fills `key.input_ids` and `key.token_source` from, in order, the body's ids (already
    /// in `key`), the routing-tokens `header` value, or the prompt of `body` rendered and
    /// tokenized with the model's tokenizer (prefix cache keyed by `key.namespace`).
    /// Leaves the key in text mode when none applies.
    pub fn attach(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        header: Option<&[u8]>,
        key: &mut RouteKey,
    ) -> Attached {
        let mut out = Attached::default();
        if key.input_ids.is_some() {
            key.token_source = TokenSource::Body;
            return out;
        }
        if let Some(value) = header {
            match parse_routing_tokens(value) {
                Ok(ids) => {
                    key.input_ids = Some(ids.into());
                    key.token_source = TokenSource::Header;
                    return out;
                }
                Err(why) => out.header_rejected = Some(why),
            }
        }
        let Some(inc) = self.for_model(&key.model) else {
            return out;
        };
        // A completion's prompt is tokenized where it is, not copied.
        let text: Cow<'_, str> = match endpoint {
            Endpoint::ChatCompletions => match inc.tokenizer().render_chat_body(body) {
                Ok(t) => Cow::Owned(t),
                Err(e) => {
                    out.prompt_error = Some(e);
                    return out;
                }
            },
            Endpoint::Completions | Endpoint::Generate => Cow::Borrowed(&key.text),
        };
        match inc.encode(&text, key.namespace) {
            Ok(enc) if !enc.ids.is_empty() => {
                out.reused_tokens = enc.reused_tokens;
                key.input_ids = Some(enc.ids[..].into());
                key.token_source = TokenSource::Prompt;
            }
            Ok(_) => {}
            Err(e) => out.prompt_error = Some(e),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route_key::route_key;
    use std::sync::OnceLock;

    fn qwen() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::qwen3().unwrap())
    }

    fn shard(models: &[&str]) -> ShardTokenizers {
        let by_model = models
            .iter()
            .map(|m| (m.to_string(), qwen().clone()))
            .collect();
        Tokenizers::new(None, by_model, 1 << 20).for_shard()
    }

    fn attach(
        s: &mut ShardTokenizers,
        ep: Endpoint,
        body: &str,
        header: Option<&str>,
    ) -> (RouteKey, Attached) {
        let mut key = route_key(ep, body.as_bytes()).unwrap();
        let a = s.attach(ep, body.as_bytes(), header.map(str::as_bytes), &mut key);
        (key, a)
    }

    #[test]
    fn header_values() {
        assert_eq!(parse_routing_tokens(b"1,2,3"), Ok(vec![1, 2, 3]));
        assert_eq!(
            parse_routing_tokens(b" 7 , 4294967295"),
            Ok(vec![7, u32::MAX])
        );
        for bad in [
            "",
            "1,,2",
            "1,-2",
            "a",
            "1.5",
            "4294967296",
            "1;2",
            "+1",
            "1,",
        ] {
            assert_eq!(
                parse_routing_tokens(bad.as_bytes()),
                Err(HeaderRejection::Malformed),
                "{bad:?}"
            );
        }
        let many = vec!["1"; MAX_HEADER_IDS + 1].join(",");
        assert_eq!(
            parse_routing_tokens(many.as_bytes()),
            Err(HeaderRejection::TooMany)
        );
        let ok = vec!["1"; MAX_HEADER_IDS].join(",");
        assert_eq!(parse_routing_tokens(ok.as_bytes()).unwrap().len(), 512);
        let long = format!("1,{}", "0".repeat(MAX_HEADER_BYTES));
        assert_eq!(
            parse_routing_tokens(long.as_bytes()),
            Err(HeaderRejection::TooLong)
        );
    }

    /// Order: body ids, then a valid header, then the tokenized prompt.
    #[test]
    fn sources_in_order() {
        let mut s = shard(&["qwen3"]);
        let (k, _) = attach(
            &mut s,
            Endpoint::Generate,
            r#"{"model":"qwen3","text":"hello","input_ids":[5,6]}"#,
            Some("1,2"),
        );
        assert_eq!(
            (k.input_ids, k.token_source),
            (Some(vec![5, 6].into()), TokenSource::Body)
        );
        let (k, _) = attach(
            &mut s,
            Endpoint::Generate,
            r#"{"model":"qwen3","text":"hello"}"#,
            Some("1,2"),
        );
        assert_eq!(
            (k.input_ids, k.token_source),
            (Some(vec![1, 2].into()), TokenSource::Header)
        );
        let (k, a) = attach(
            &mut s,
            Endpoint::Generate,
            r#"{"model":"qwen3","text":"hello"}"#,
            Some("1,x"),
        );
        assert_eq!(a.header_rejected, Some(HeaderRejection::Malformed));
        assert_eq!(
            (k.input_ids, k.token_source),
            (Some(vec![14990].into()), TokenSource::Prompt)
        );
        let (k, _) = attach(
            &mut s,
            Endpoint::Completions,
            r#"{"model":"qwen3:lora-a","prompt":"Hello, world!"}"#,
            None,
        );
        assert_eq!(k.input_ids, Some(vec![9707, 11, 1879, 0].into()));
    }

    /// traces.md §3: a chat with one user message is `[151644, 872, 198] ++ text ++
    /// [151645, 198, 151644, 77091, 198]`, as the engine computes it.
    #[test]
    fn chat_prompt_is_rendered_and_tokenized() {
        let mut s = shard(&["qwen3"]);
        let text = " sticky finder vic quieter tendency adultos compuls purely";
        let body =
            serde_json::json!({"model": "qwen3", "messages": [{"role": "user", "content": text}]})
                .to_string();
        let (k, a) = attach(&mut s, Endpoint::ChatCompletions, &body, None);
        let mut want = vec![151644, 872, 198];
        want.extend([27402, 43730, 31431, 89745, 30854, 88631, 47106, 31127]);
        want.extend([151645, 198, 151644, 77091, 198]);
        assert_eq!(k.input_ids, Some(want.into()));
        assert_eq!((k.token_source, a.reused_tokens), (TokenSource::Prompt, 0));
        // The text key is still there for text-mode consumers.
        assert_eq!(k.text, format!("<|user|>{text}"));
    }

    #[test]
    fn unknown_model_stays_in_text_mode() {
        let mut s = shard(&["qwen3"]);
        let (k, a) = attach(
            &mut s,
            Endpoint::Generate,
            r#"{"model":"llama","text":"hello"}"#,
            None,
        );
        assert_eq!((k.input_ids, k.token_source), (None, TokenSource::None));
        assert!(a.prompt_error.is_none());
        let mut empty = Tokenizers::default().for_shard();
        assert!(Tokenizers::default().is_empty());
        let (k, _) = attach(
            &mut empty,
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            None,
        );
        assert_eq!(k.input_ids, None);
    }

    #[test]
    fn builtin_qwen3_needs_no_file() {
        let t = Tokenizers::load(&Config {
            tokenizer: Some(BUILTIN_QWEN3.into()),
            ..Config::default()
        })
        .unwrap();
        assert!(!t.is_empty());
        let err = Tokenizers::load(&Config {
            tokenizer: Some("builtin:nope".into()),
            ..Config::default()
        })
        .unwrap_err();
        assert!(matches!(err, CoreError::Tokenizer { .. }), "{err}");
    }

    #[test]
    fn load_names_the_failing_model() {
        let mut cfg = Config::default();
        cfg.models
            .insert("m1".into(), std::path::PathBuf::from("/nonexistent/tok"));
        let err = Tokenizers::load(&cfg).unwrap_err();
        assert!(
            matches!(&err, CoreError::Tokenizer { model, .. } if model == "m1"),
            "{err}"
        );
        assert!(Tokenizers::load(&Config::default()).unwrap().is_empty());
        let cfg = Config::from_toml_str(
            "tokenizer = \"../shared/data/tokenizers/qwen3\"\n[models]\nq = \"../shared/data/tokenizers/qwen3/tokenizer.json\"\n",
        )
        .unwrap();
        assert_eq!(cfg.models.len(), 1);
        let t = Tokenizers::load(&Config {
            tokenizer: cfg.tokenizer.map(|p| Path::new("..").join(p)),
            models: cfg
                .models
                .into_iter()
                .map(|(m, p)| (m, Path::new("..").join(p)))
                .collect(),
            ..Config::default()
        })
        .unwrap();
        let mut s = t.for_shard();
        assert!(s.for_model("q").is_some() && s.for_model("other").is_some());
    }

    /// Second turn of a chat reuses the first turn's prefix from the shard cache.
    #[test]
    fn second_turn_reuses_prefix() {
        let mut s = shard(&["qwen3"]);
        let t1 = r#"{"model":"qwen3","messages":[{"role":"system","content":"S"},{"role":"user","content":"one"}]}"#;
        let t2 = r#"{"model":"qwen3","messages":[{"role":"system","content":"S"},{"role":"user","content":"one"},{"role":"assistant","content":"ok"},{"role":"user","content":"two"}]}"#;
        let (k1, _) = attach(&mut s, Endpoint::ChatCompletions, t1, None);
        let (k2, a2) = attach(&mut s, Endpoint::ChatCompletions, t2, None);
        let (ids1, ids2) = (k1.input_ids.unwrap(), k2.input_ids.unwrap());
        assert_eq!(a2.reused_tokens, ids1.len() - 3);
        assert_eq!(ids2[..ids1.len() - 3], ids1[..ids1.len() - 3]);
        let full = qwen().encode(&qwen().render_chat_body(t2.as_bytes()).unwrap());
        assert_eq!(ids2[..], full[..]);
    }
}
