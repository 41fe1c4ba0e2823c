//! Chat templates: `tokenizer_config.json`'s Jinja `chat_template`, rendered with minijinja.
//!
//! Python-isms the HF templates rely on (`str.startswith`, `split`, `rstrip`, ...) come from
//! `minijinja_contrib::pycompat`; `raise_exception` is provided as HF's `apply_chat_template`
//! does.

use crate::TokenizeError;
use minijinja::{Environment, Value};

/// A compiled chat template: turns OpenAI-style `messages` into the prompt text.
///
/// Rendering matches HF `apply_chat_template(messages, tokenize=False,
/// add_generation_prompt=...)` for plain conversations; for the Qwen3 template each message
/// becomes `<|im_start|>{role}\n{content}<|im_end|>\n` (traces.md §6).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source` (Jinja). `bos_token` / `eos_token` are exposed to the template as in
    /// HF (empty string when the config has none).
    ///
    /// # Errors
    /// [`TokenizeError::Template`] when the template does not compile.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(TEMPLATE_NAME.to_string(), source.to_string())?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages` (a JSON array of `{role, content, ...}` objects) to prompt text.
    /// `tools` (a JSON array or null) is passed through for templates that use it.
    ///
    /// # Errors
    /// [`TokenizeError::Template`] when rendering fails (e.g. `messages` is not an array of
    /// objects the template understands).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        Ok(tmpl.render(ctx)?)
    }
}
