//! A native renderer of the Qwen3 chat template for plain conversations: the text minijinja
//! renders, without the interpreter.
//!
//! Why (measured, `perf/runs/2026-12-01-tokenizer/`): under `perf/compare.sh` load the Qwen3
//! template through minijinja was a quarter of a token-mode request's CPU (~35 µs for a
//! system prompt and one question), more than the rest of the routing decision.
//!
//! Scope: only the exact Qwen3 template ([`QWEN3_TEMPLATE`], compared byte for byte at load),
//! and only bodies where it reduces to string concatenation: no `tools`, every message a
//! `system` / `user` / `assistant` object with string `content` and no `reasoning_content` or
//! `tool_calls`, no assistant content containing `</think>`, and `chat_template_kwargs`
//! absent or only a boolean `enable_thinking`. Anything else returns `None` and goes through
//! minijinja. What it renders (the template's branches for that scope):
//! - a first `system` message: `<|im_start|>system\n{content}<|im_end|>\n`;
//! - `user` and later `system` messages: `<|im_start|>{role}\n{content}<|im_end|>\n`;
//! - `assistant`: `<|im_start|>assistant\n{content}<|im_end|>\n`, except the last message
//!   when it comes after the last real user query (one whose content is not a
//!   `<tool_response>…</tool_response>`): `<|im_start|>assistant\n<think>\n\n</think>\n\n
//!   {content without leading newlines}<|im_end|>\n`;
//! - with `add_generation_prompt`: `<|im_start|>assistant\n`, then `<think>\n\n</think>\n\n`
//!   when `enable_thinking` is false.
//!
//! Equality with minijinja is a property test over random conversations in that scope
//! (`native_equals_minijinja`).

use serde::Deserialize;
use std::borrow::Cow;

/// The Qwen3 chat template this renderer implements (the embedded `tokenizer_config.json`'s).
pub static QWEN3_TEMPLATE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let cfg: serde_json::Value =
        serde_json::from_str(crate::tokenizer::QWEN3_CONFIG).expect("the embedded config parses");
    cfg["chat_template"]
        .as_str()
        .expect("the embedded config has a template")
        .to_string()
});

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    messages: Vec<PlainMessage<'a>>,
    #[serde(flatten)]
    options: OptionFields,
}

/// The top-level fields besides `messages` that the template reads.
#[derive(Deserialize)]
struct OptionFields {
    #[serde(default)]
    tools: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    chat_template_kwargs: Option<Kwargs>,
    #[serde(default)]
    add_generation_prompt: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Kwargs {
    #[serde(default)]
    enable_thinking: Option<bool>,
}

/// One chat message in the renderer's scope (see the module doc): `role` is `system`, `user`
/// or `assistant`, `content` a string.
#[derive(Debug, Deserialize)]
pub struct PlainMessage<'a> {
    /// `system`, `user` or `assistant`.
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    /// The message's text.
    #[serde(borrow)]
    pub content: Cow<'a, str>,
    #[serde(default)]
    reasoning_content: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
}

impl<'a> PlainMessage<'a> {
    /// One message object (JSON bytes), or `None` when it is not one or is outside the
    /// renderer's scope.
    pub fn parse(json: &'a [u8]) -> Option<Self> {
        let m: Self = match Self::parse_plain(json) {
            Some(m) => m,
            None => serde_json::from_slice(json).ok()?,
        };
        m.in_scope().then_some(m)
    }

    /// The shape nearly every client sends, `{"role": S, "content": S}` (either order, JSON
    /// whitespace anywhere serde allows it), read without serde's derived visitor; `None`
    /// for anything else: another or a repeated field, an escaped key, a non-string value,
    /// invalid UTF-8, a control byte in a string, bytes after the object. [`Self::parse`]
    /// then asks serde, so the answer is serde's for every input (`plain_equals_serde`).
    /// A string with escapes is unescaped by serde (`Cow<str>` of that string alone).
    ///
    /// Why: serde's derived visitor for the turn's two new messages was ~5 % of the samples
    /// of a 4,096-worker × 32k-token decision; this reads the same two messages in ~0.7× its
    /// time warm (perf/runs/2026-12-07-decision-trims).
    fn parse_plain(json: &'a [u8]) -> Option<Self> {
        let mut at = skip_ws(json, 0);
        (json.get(at) == Some(&b'{')).then_some(())?;
        let (mut role, mut content) = (None, None);
        loop {
            at = skip_ws(json, at + 1);
            // Keys with escapes are serde's to read (`"rol\u0065"` is `role`).
            let (Cow::Borrowed(key), next) = json_string(json, at)? else {
                return None;
            };
            let field = match key {
                "role" if role.is_none() => &mut role,
                "content" if content.is_none() => &mut content,
                _ => return None,
            };
            at = skip_ws(json, next);
            (json.get(at) == Some(&b':')).then_some(())?;
            let (value, next) = json_string(json, skip_ws(json, at + 1))?;
            *field = Some(value);
            at = skip_ws(json, next);
            match json.get(at) {
                Some(b',') if role.is_none() || content.is_none() => {}
                Some(b'}') => break,
                _ => return None,
            }
        }
        (skip_ws(json, at + 1) == json.len()).then_some(())?;
        Some(Self {
            role: role?,
            content: content?,
            reasoning_content: None,
            tool_calls: None,
        })
    }

    fn in_scope(&self) -> bool {
        let known = matches!(&*self.role, "system" | "user" | "assistant");
        known
            && self.reasoning_content.is_none()
            && self.tool_calls.is_none()
            && !(self.role == "assistant" && self.content.contains("</think>"))
    }

    /// A real user query in the template's sense: a `user` message whose content is not a
    /// `<tool_response>…</tool_response>`. The last one decides [`think_wrapped`].
    pub fn is_query(&self) -> bool {
        self.role == "user"
            && !(self.content.starts_with("<tool_response>")
                && self.content.ends_with("</tool_response>"))
    }
}

/// The first byte at or after `at` that is not JSON whitespace (RFC 8259: space, tab, line
/// feed, carriage return); `json.len()` when none is. Shared with the router's body scan
/// (`kvroute_core::chat_prefix`).
pub fn skip_ws(json: &[u8], mut at: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = json.get(at) {
        at += 1;
    }
    at
}

/// The JSON string starting at `json[at]` (a `"`), and the offset just past its closing
/// quote: borrowed when it has no escape, else unescaped by serde. `None` when there is no
/// string there, or it is not valid (a control byte, invalid UTF-8, a bad escape).
fn json_string(json: &[u8], at: usize) -> Option<(Cow<'_, str>, usize)> {
    (json.get(at) == Some(&b'"')).then_some(())?;
    let body = &json[at + 1..];
    let stop = memchr::memchr2(b'"', b'\\', body)?;
    if body[stop] == b'"' {
        let raw = &body[..stop];
        // RFC 8259 § 7: U+0000 to U+001F must be escaped.
        // A min over the bytes, not `all` (whose early exit keeps it byte by byte).
        (raw.iter().fold(u8::MAX, |m, &b| m.min(b)) >= 0x20).then_some(())?;
        return Some((Cow::Borrowed(std::str::from_utf8(raw).ok()?), at + stop + 2));
    }
    // Escapes: serde unescapes the string alone.
    let end = skip_string(json, at)?;
    let s: String = serde_json::from_slice(&json[at..end]).ok()?;
    Some((Cow::Owned(s), end))
}

/// Just past the JSON string starting at `json[at] == '"'` (an escape's next byte never ends
/// it); `None` when it is not closed. Structure only: the escapes are not checked. Shared
/// with the router's body scan (`kvroute_core::chat_prefix`).
pub fn skip_string(json: &[u8], at: usize) -> Option<usize> {
    let mut j = at + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', &json[j..])?;
        if json[j] == b'"' {
            return Some(j + 1);
        }
        j += 2;
        if j > json.len() {
            return None;
        }
    }
}

/// What the template reads besides the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderOptions {
    /// Append the generation prompt (`add_generation_prompt`: the body's boolean, else true,
    /// as vLLM does).
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs.enable_thinking`, when given.
    pub enable_thinking: Option<bool>,
}

impl RenderOptions {
    /// The options of a chat body (a JSON object's bytes; its `messages` field, if any, is
    /// not read), or `None` when the body is outside the renderer's scope (`tools`, other
    /// `chat_template_kwargs`) or not an object.
    pub fn parse(json: &[u8]) -> Option<Self> {
        let f: OptionFields = serde_json::from_slice(json).ok()?;
        Self::from_fields(f)
    }

    fn from_fields(f: OptionFields) -> Option<Self> {
        if f.tools.is_some() {
            return None;
        }
        Some(Self {
            // vLLM: a boolean field is used as is, anything else means true
            // (ChatTemplate::render_body).
            add_generation_prompt: f
                .add_generation_prompt
                .as_ref()
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
            enable_thinking: f.chat_template_kwargs.and_then(|k| k.enable_thinking),
        })
    }
}

/// The template's special case for message `index` of `count`: the last message, an
/// assistant's, after the last real user query `last_query` ([`PlainMessage::is_query`]) is
/// rendered inside an empty `<think>` block.
pub fn think_wrapped(
    m: &PlainMessage<'_>,
    index: usize,
    count: usize,
    last_query: Option<usize>,
) -> bool {
    m.role == "assistant" && index + 1 == count && last_query.is_some_and(|q| index > q)
}

/// Appends message `index`'s text to `out` (`wrapped`: [`think_wrapped`]). Every message's
/// text starts with `<|im_start|>` and ends with `<|im_end|>\n`.
pub fn render_message(out: &mut String, m: &PlainMessage<'_>, wrapped: bool) {
    out.push_str("<|im_start|>");
    out.push_str(&m.role);
    out.push('\n');
    if wrapped {
        out.push_str("<think>\n\n</think>\n\n");
        out.push_str(m.content.trim_start_matches('\n'));
    } else {
        out.push_str(&m.content);
    }
    out.push_str("<|im_end|>\n");
}

/// Appends the generation prompt `opts` asks for (nothing, or `<|im_start|>assistant\n`
/// then an empty `<think>` block when `enable_thinking` is false).
pub fn render_generation(out: &mut String, opts: RenderOptions) {
    if opts.add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
        if opts.enable_thinking == Some(false) {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
}

/// The template's fixed texts as ids, so that a message's ids are made without finding them
/// again in its rendered text ([`TemplateIds::encode_message`]): the four added tokens it
/// writes and the ids of the text between them (`\n`, `\n\n`).
///
/// Why (profile of `kvroute bench fleet` at 4,096 × 32k, perf/runs/2026-12-07-template-ids):
/// the added-token search (Aho-Corasick, leftmost-longest) over each rendered message was ~3 %
/// of a turn's samples, nearly all of it matching the template's own `<|im_start|>`,
/// `<|im_end|>`, `<think>` and `</think>`, which the renderer wrote and so knows.
///
/// Exact: a message's text is `<|im_start|>`, a piece, (when wrapped: `<think>` `\n\n`
/// `</think>` and a piece), `<|im_end|>` and `\n`, and the HF pipeline tokenizes the text
/// between added tokens piece by piece, so the ids are the same pieces' ids joined, provided
/// the search over the whole text matches the template's tokens where the renderer put
/// them. That holds unless some added token could start before one of them and overlap it,
/// or start at it and be longer; [`TemplateIds::new`] refuses such a vocabulary. Test:
/// `template_ids_equal_the_rendered_texts_ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateIds {
    im_start: u32,
    im_end: u32,
    think: u32,
    end_think: u32,
    newline: Vec<u32>,
    two_newlines: Vec<u32>,
}

/// The added tokens the Qwen3 template writes.
const TEMPLATE_TOKENS: [&str; 4] = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"];

impl TemplateIds {
    /// The ids of `inner`'s vocabulary, or `None` when one of the template's tokens is not an
    /// added token of it, or an added token could overlap one where the template writes it
    /// (type doc).
    pub fn new(inner: &tokenizers::Tokenizer) -> Option<Self> {
        let added: Vec<String> = inner
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.clone())
            .collect();
        let id = |s: &str| {
            added
                .iter()
                .any(|a| a == s)
                .then(|| inner.token_to_id(s))
                .flatten()
        };
        for s in TEMPLATE_TOKENS {
            for a in &added {
                // Starting at it and longer, or starting inside the text before it and
                // reaching into it.
                let longer = a.len() > s.len() && a.starts_with(s);
                let overlaps = (1..a.len())
                    .filter(|&k| a.is_char_boundary(k))
                    .any(|k| s.starts_with(&a[k..]) || a[k..].starts_with(s));
                if longer || overlaps {
                    return None;
                }
            }
        }
        let ids = |s: &str| Some(inner.encode_fast(s, false).ok()?.get_ids().to_vec());
        Some(Self {
            im_start: id(TEMPLATE_TOKENS[0])?,
            im_end: id(TEMPLATE_TOKENS[1])?,
            think: id(TEMPLATE_TOKENS[2])?,
            end_think: id(TEMPLATE_TOKENS[3])?,
            newline: ids("\n")?,
            two_newlines: ids("\n\n")?,
        })
    }

    /// Appends to `ids` the ids of [`render_message`]'s text for `m` (`wrapped`:
    /// [`think_wrapped`]), as `encode(text)` gives them (type doc). `encode` appends the ids
    /// of a text; `buf` is scratch.
    ///
    /// # Errors
    /// `encode`'s.
    pub fn encode_message<E>(
        &self,
        m: &PlainMessage<'_>,
        wrapped: bool,
        buf: &mut String,
        ids: &mut Vec<u32>,
        mut encode: impl FnMut(&str, &mut Vec<u32>) -> Result<(), E>,
    ) -> Result<(), E> {
        ids.push(self.im_start);
        buf.clear();
        buf.push_str(&m.role);
        buf.push('\n');
        if wrapped {
            encode(buf, ids)?;
            ids.push(self.think);
            ids.extend_from_slice(&self.two_newlines);
            ids.push(self.end_think);
            buf.clear();
            buf.push_str("\n\n");
            buf.push_str(m.content.trim_start_matches('\n'));
        } else {
            buf.push_str(&m.content);
        }
        encode(buf, ids)?;
        ids.push(self.im_end);
        ids.extend_from_slice(&self.newline);
        Ok(())
    }

    /// Appends to `ids` the ids of [`render_generation`]'s text for `opts` (no text to
    /// tokenize: `assistant\n` between two added tokens is one piece, `encode`d).
    ///
    /// # Errors
    /// `encode`'s.
    pub fn encode_generation<E>(
        &self,
        opts: RenderOptions,
        ids: &mut Vec<u32>,
        mut encode: impl FnMut(&str, &mut Vec<u32>) -> Result<(), E>,
    ) -> Result<(), E> {
        if opts.add_generation_prompt {
            ids.push(self.im_start);
            encode("assistant\n", ids)?;
            if opts.enable_thinking == Some(false) {
                ids.push(self.think);
                ids.extend_from_slice(&self.two_newlines);
                ids.push(self.end_think);
                ids.extend_from_slice(&self.two_newlines);
            }
        }
        Ok(())
    }
}

/// The prompt text of a chat completions `body` under the Qwen3 template, or `None` when the
/// body is outside the scope of the module doc (or not such a JSON object at all: the caller's
/// own parse then reports it).
pub fn render_qwen3(body: &[u8]) -> Option<String> {
    let b: Body<'_> = serde_json::from_slice(body).ok()?;
    let opts = RenderOptions::from_fields(b.options)?;
    if b.messages.is_empty() || !b.messages.iter().all(PlainMessage::in_scope) {
        return None;
    }
    let n = b.messages.len();
    let last_query = b.messages.iter().rposition(PlainMessage::is_query);
    let mut out = String::with_capacity(b.messages.iter().map(|m| m.content.len() + 32).sum());
    for (i, m) in b.messages.iter().enumerate() {
        render_message(&mut out, m, think_wrapped(m, i, n, last_query));
    }
    render_generation(&mut out, opts);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatTemplate;
    use proptest::prelude::*;
    use serde_json::json;
    use std::sync::OnceLock;

    fn jinja() -> &'static ChatTemplate {
        static T: OnceLock<ChatTemplate> = OnceLock::new();
        T.get_or_init(|| ChatTemplate::interpreted(&QWEN3_TEMPLATE, "", "<|im_end|>").unwrap())
    }

    #[test]
    fn worked_example() {
        let body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
        ]});
        let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
                    <|im_start|>assistant\n";
        let bytes = serde_json::to_vec(&body).unwrap();
        assert_eq!(render_qwen3(&bytes).as_deref(), Some(want));
        assert_eq!(jinja().render_body(&bytes).unwrap(), want);
    }

    #[test]
    fn out_of_scope_bodies_are_refused() {
        for body in [
            json!({"messages": []}),
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
            json!({"messages": [{"role": "assistant", "content": "<think>a</think>b"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": 1}}),
            json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}),
        ] {
            assert_eq!(
                render_qwen3(&serde_json::to_vec(&body).unwrap()),
                None,
                "{body}"
            );
        }
    }

    fn message() -> impl Strategy<Value = serde_json::Value> {
        let content = prop_oneof![
            Just(String::new()),
            Just("\n\nhi".to_string()),
            Just("<tool_response>r</tool_response>".to_string()),
            Just("<think>t".to_string()),
            Just("a \"q\" \\ é 日本\n".to_string()),
            "[a-z \n]{0,12}",
        ];
        (
            prop_oneof![Just("system"), Just("user"), Just("assistant")],
            content,
        )
            .prop_map(|(r, c)| json!({"role": r, "content": c}))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
        /// In its scope the native text is minijinja's, byte for byte.
        #[test]
        fn native_equals_minijinja(
            messages in prop::collection::vec(message(), 1..7),
            generation in prop_oneof![Just(None), Just(Some(true)), Just(Some(false))],
            thinking in prop_oneof![Just(None), Just(Some(true)), Just(Some(false))],
        ) {
            let mut body = json!({"model": "m", "messages": messages});
            if let Some(g) = generation { body["add_generation_prompt"] = json!(g); }
            if let Some(t) = thinking { body["chat_template_kwargs"] = json!({"enable_thinking": t}); }
            let bytes = serde_json::to_vec(&body).unwrap();
            let native = render_qwen3(&bytes).expect("in scope");
            prop_assert_eq!(native, jinja().render_body(&bytes).unwrap());
        }

        /// A message's and the generation prompt's ids from the template's known ids equal
        /// the ids of their rendered text, whatever the content holds (added tokens,
        /// newlines the wrapped form trims, non-ASCII), wrapped or not.
        #[test]
        fn template_ids_equal_the_rendered_texts_ids(
            role in prop_oneof![Just("system"), Just("user"), Just("assistant")],
            content in prop_oneof![
                Just(String::new()),
                Just("\n\n  hi\n".to_string()),
                Just("a<|im_end|>b<|im_start|>".to_string()),
                Just("x<think>\n\n</think>\n\ny <tool_call>".to_string()),
                Just("< | <|im_end <|im_start|".to_string()),
                Just("a \"q\" \\ é 日本\n".to_string()),
                "[a-z <|>\n]{0,24}",
            ],
            wrapped in any::<bool>(),
            generation in any::<bool>(),
            thinking in prop_oneof![Just(None), Just(Some(true)), Just(Some(false))],
        ) {
            let tok = crate::tokenizer::test_qwen();
            let m = PlainMessage {
                role: role.into(),
                content: content.into(),
                reasoning_content: None,
                tool_calls: None,
            };
            let (mut buf, mut ids) = (String::new(), vec![7]);
            tok.encode_message_into(&m, wrapped, &mut buf, &mut ids).unwrap();
            let mut text = String::new();
            render_message(&mut text, &m, wrapped);
            let want = tok.try_encode(&text).unwrap();
            prop_assert_eq!(&ids[1..], want.as_slice(), "{:?}", text);
            let opts = RenderOptions { add_generation_prompt: generation, enable_thinking: thinking };
            ids.clear();
            tok.encode_generation_into(opts, &mut buf, &mut ids).unwrap();
            text.clear();
            render_generation(&mut text, opts);
            prop_assert_eq!(ids, tok.try_encode(&text).unwrap(), "{:?}", text);
        }
    }

    #[test]
    fn the_embedded_qwen3_has_template_ids_and_a_straddling_token_refuses_them() {
        let tok = crate::tokenizer::test_qwen();
        assert!(TemplateIds::new(tok.hf()).is_some());
        // An added token that would start inside a message's text and reach into
        // `<|im_end|>`: the template's tokens are then not where the renderer wrote them.
        let mut hf = tok.hf().clone();
        hf.add_tokens([tokenizers::AddedToken::from("x<|im", true)])
            .expect("a new added token");
        assert_eq!(TemplateIds::new(&hf), None);
        let mut hf = tok.hf().clone();
        hf.add_tokens([tokenizers::AddedToken::from("<|im_start|>user", true)])
            .expect("a new added token");
        assert_eq!(TemplateIds::new(&hf), None);
    }

    /// Serde's reading of `json`, the reference [`PlainMessage::parse`] must equal.
    fn by_serde(json: &[u8]) -> Option<(String, String)> {
        let m: PlainMessage<'_> = serde_json::from_slice(json).ok()?;
        m.in_scope()
            .then(|| (m.role.into_owned(), m.content.into_owned()))
    }

    fn by_parse(json: &[u8]) -> Option<(String, String)> {
        PlainMessage::parse(json).map(|m| (m.role.into_owned(), m.content.into_owned()))
    }

    #[test]
    fn plain_messages_take_the_fast_path() {
        for (json, role, content) in [
            (r#"{"role":"user","content":"Hi"}"#, "user", "Hi"),
            (
                r#" { "content" : "a\n\"b\u00e9" ,"role": "assistant" } "#,
                "assistant",
                "a\n\"b\u{e9}",
            ),
            (
                "{\"role\":\"system\",\n\t\"content\":\"\"}\r\n",
                "system",
                "",
            ),
        ] {
            let m = PlainMessage::parse_plain(json.as_bytes()).expect(json);
            assert_eq!((&*m.role, &*m.content), (role, content), "{json}");
            assert_eq!(
                by_serde(json.as_bytes()),
                Some((role.into(), content.into()))
            );
        }
        // Left to serde, which gives the same answers (None for the malformed ones).
        for json in [
            r#"{"role":"user","content":"Hi","name":"x"}"#,
            r#"{"role":"user","role":"user","content":"Hi"}"#,
            r#"{"rol\u0065":"user","content":"Hi"}"#,
            r#"{"role":"user","content":null}"#,
            r#"{"role":"user","content":"Hi"} x"#,
            "{\"role\":\"user\",\"content\":\"a\u{1}b\"}",
            r#"{"role":"user","content":"\ud800"}"#,
        ] {
            assert!(
                PlainMessage::parse_plain(json.as_bytes()).is_none(),
                "{json}"
            );
            assert_eq!(
                by_parse(json.as_bytes()),
                by_serde(json.as_bytes()),
                "{json}"
            );
        }
        assert_eq!(
            by_parse(br#"{"role":"user","content":"Hi","name":"x"}"#),
            Some(("user".into(), "Hi".into()))
        );
    }

    /// Bytes of one message-like object: `fields` of (key, value) pieces, whitespace `ws`
    /// between every token, optional trailing bytes.
    fn message_bytes(fields: &[(usize, usize)], ws: &[usize], tail: usize) -> Vec<u8> {
        const KEYS: [&str; 6] = [
            r#""role""#,
            r#""content""#,
            r#""name""#,
            r#""rol\u0065""#,
            r#""tool_calls""#,
            r#""reasoning_content""#,
        ];
        const VALUES: [&[u8]; 12] = [
            br#""user""#,
            br#""assistant""#,
            br#""system""#,
            br#""tool""#,
            br#""plain text""#,
            br#""line\nbreak \"quoted\" \\ \u00e9\ud83d\ude00""#,
            b"\"raw \x01 control\"",
            b"\"bad \xff utf8\"",
            br#""lone \ud800""#,
            b"null",
            b"[1, {}]",
            br#""ends in a backslash\""#,
        ];
        const WS: [&str; 4] = ["", " ", "\n\t", "\r\n  "];
        let mut w = ws.iter().cycle().map(|&i| WS[i % WS.len()].as_bytes());
        let mut out = Vec::new();
        out.extend_from_slice(w.next().unwrap());
        out.push(b'{');
        for (i, &(k, v)) in fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(w.next().unwrap());
            out.extend_from_slice(KEYS[k % KEYS.len()].as_bytes());
            out.extend_from_slice(w.next().unwrap());
            out.push(b':');
            out.extend_from_slice(w.next().unwrap());
            out.extend_from_slice(VALUES[v % VALUES.len()]);
            out.extend_from_slice(w.next().unwrap());
        }
        out.push(b'}');
        out.extend_from_slice(w.next().unwrap());
        out.extend_from_slice([b"" as &[u8], b"}", b" x", b","][tail % 4]);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]
        /// Against serde's derived reading: the same role and content, or both refusing, for
        /// a role and a content field (either order) with any of the values, sometimes an
        /// extra or repeated field, well-formed or not; and the plain shape never falls back.
        #[test]
        fn plain_equals_serde(
            role in 0usize..12,
            content in 0usize..12,
            swap in any::<bool>(),
            extra in prop::collection::vec((0usize..6, 0usize..12, 0usize..3), 0..2),
            ws in prop::collection::vec(0usize..4, 1..8),
            tail in 0usize..4,
            cut in 0usize..64,
        ) {
            let mut fields = vec![(0, role), (1, content)];
            if swap {
                fields.swap(0, 1);
            }
            for &(k, v, at) in &extra {
                fields.insert(at, (k, v));
            }
            let json = message_bytes(&fields, &ws, tail);
            prop_assert_eq!(by_parse(&json), by_serde(&json), "{}", String::from_utf8_lossy(&json));
            // A truncated object: both refuse.
            let short = &json[..json.len().saturating_sub(1 + cut % json.len().max(1))];
            prop_assert_eq!(by_parse(short), by_serde(short));
            if tail == 0 && extra.is_empty() && role < 6 && content < 6 {
                prop_assert!(PlainMessage::parse_plain(&json).is_some());
            }
        }
    }
}
