//! The one error type of the tokenize crate.

use std::path::PathBuf;

/// Why loading a tokenizer or rendering a prompt failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `tokenizer.json` did not parse as a Hugging Face tokenizer.
    #[error("invalid tokenizer {path}: {message}")]
    InvalidTokenizer {
        /// The file, or `<embedded>`.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("invalid tokenizer config {path}: {source}")]
    InvalidConfig {
        /// The file, or `<embedded>`.
        path: PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// The model has no chat template, so chat messages cannot become a prompt.
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template failed to compile or render (bad template, or messages of the
    /// wrong shape).
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    /// A chat body is not a JSON object with a `messages` array (the parser's message).
    #[error("chat body: {0}")]
    ChatBody(String),
    /// Encoding text failed inside the tokenizer.
    #[error("encode: {0}")]
    Encode(String),
}
