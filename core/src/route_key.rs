//! [`route_key`]: the part of a request body routing needs, parsed once; the body itself is
//! forwarded unchanged.
//!
//! The parse is a single typed pass over the bytes (serde visitors): routing fields are read,
//! strings are borrowed from the body where they have no escapes, and every other field
//! (sampling parameters, tools, images) is skipped without being built.

use crate::CoreError;
use kvroute_tokenize::blocks::{media_key, namespace_hash};
use serde::de::{
    Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use std::borrow::Cow;
use std::fmt;

/// The inference endpoints kvroute routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (OpenAI).
    ChatCompletions,
    /// `POST /v1/completions` (OpenAI).
    Completions,
    /// `POST /generate` (SGLang native).
    Generate,
}

/// What routing needs from one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteKey {
    /// `model` field; empty when absent or not a string. The index is kept per model.
    pub model: String,
    /// `stream` field; false when absent or not a boolean.
    pub stream: bool,
    /// Routing text. Chat: each message as `<|role|>` + its text, in order (content as a
    /// string, or the `text` of its `type: "text"` parts), so turn N+1's text extends turn N's
    /// and two conversations that share only a system prompt diverge right after it (bug
    /// B19). Completions: `prompt` (first of a batch). Generate: `text` (first of a batch).
    /// Empty when the request carries only token ids, and once
    /// [`crate::tokens::ShardTokenizers::route`] attached ids (token mode reads only those).
    pub text: String,
    /// Token ids, first sequence of a batch. [`route_key`] sets them when the body carries
    /// them (`input_ids` of `/generate`, or a token-id `prompt` of `/v1/completions`);
    /// [`crate::tokens`] then fills them from the `x-kvroute-routing-tokens` header or the
    /// rendered and tokenized prompt when a tokenizer is configured. `Some` → token-mode
    /// routing. Shared, so that recording them in an index costs no copy.
    pub input_ids: Option<crate::ids::TokenIds>,
    /// Where `input_ids` came from.
    pub token_source: TokenSource,
    /// Cache partition: [`namespace_hash`] of `cache_salt`, `extra_key` and the LoRA adapter
    /// (`lora_path`, else `lora_id`, else the suffix of a `model` written `base:adapter`);
    /// empty strings are unset; 0 = no partition (anchors.md §2.7).
    pub namespace: u64,
    /// [`media_key`] of each image / audio / video reference, in request order: chat content
    /// parts `image_url` (object `url` or string), `image`, `video_url`, `input_audio`
    /// (`data`), and `/generate` `image_data` (string, or first-level array of strings).
    pub image_keys: Vec<u64>,
    /// Session key of `consistent_hash`: the `x-kvroute-routing-key` header, else
    /// `x-session-id` (Ray Serve's convention, anchors.md §5); set by the transport, `None`
    /// when neither is present.
    pub session: Option<String>,
    /// Block keys shared with an earlier request, set by the chat prefix cache (a cache:
    /// always equal, see [`crate::tokens::BlockKeyMemo`]).
    pub block_key_memo: crate::tokens::BlockKeyMemo,
}

/// Where a [`RouteKey`]'s token ids came from (issue 4 order: body, header, prompt).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TokenSource {
    /// No ids: text-mode routing.
    #[default]
    None,
    /// `input_ids` of `/generate` or a token-id `prompt` of `/v1/completions`.
    Body,
    /// The `x-kvroute-routing-tokens` header.
    Header,
    /// The prompt rendered (chat template) and tokenized by the router.
    Prompt,
}

impl TokenSource {
    /// Metric label: `none`, `body`, `header`, `prompt`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenSource::None => "none",
            TokenSource::Body => "body",
            TokenSource::Header => "header",
            TokenSource::Prompt => "prompt",
        }
    }
}

/// Parses the routing fields of `body` (JSON bytes) for `endpoint`; other fields are skipped.
///
/// | endpoint | routing fields |
/// |---|---|
/// | chat | `messages`: array of objects with `role` and `content` (string or array of parts) |
/// | completions | `prompt`: string, array of strings (first), token ids, or array of token-id arrays (first) |
/// | generate | `text` (string or first of an array) and/or `input_ids` (ids, or first of a batch) |
///
/// `model` and `stream` are read for every endpoint, and so are the partition fields
/// (`cache_salt`, `extra_key`, `lora_path`, `lora_id` — string or integer) and media
/// references (see [`RouteKey::namespace`], [`RouteKey::image_keys`]).
///
/// # Errors
/// - [`CoreError::BodyNotJson`]: the bytes are not one JSON value, or not UTF-8 anywhere,
///   skipped fields included (RFC 8259 §8.1); at the first error a parse from the start
///   meets.
/// - [`CoreError::BodyNotObject`]: the value is not an object.
/// - [`CoreError::MissingField`]: chat without `messages`, completions without `prompt`,
///   generate with neither `text` nor non-empty `input_ids` (null counts as absent).
/// - [`CoreError::WrongType`]: `model` neither a string nor null, `messages` not an array
///   or empty (OpenAI's API rejects an empty one, and a chat template has nothing to render),
///   a message not an object, a prompt / `text` / `input_ids` of the wrong shape, or a token
///   id that is not an integer in 0..=u32::MAX.
pub fn route_key(endpoint: Endpoint, body: &[u8]) -> Result<RouteKey, CoreError> {
    key_from_fields(endpoint, parse_fields(body)?)
}

/// The routing fields of a top-level object's bytes (the first half of [`route_key`]).
///
/// # Errors
/// [`CoreError::BodyNotJson`], [`CoreError::BodyNotObject`].
pub(crate) fn parse_fields(body: &[u8]) -> Result<Fields<'_>, CoreError> {
    // JSON is UTF-8 (RFC 8259 §8.1): the body is checked once, whole, and parsed as a `str`,
    // so serde_json does not check each string again (`from_slice` validated every string
    // on its own: ~1.6k of the ~11k instructions of a 1 KB chat body's parse, callgrind,
    // perf/runs/2026-12-02-sse-serial).
    let text = std::str::from_utf8(body).map_err(|e| not_utf8(&body[..e.valid_up_to()]))?;
    let mut de = serde_json::Deserializer::from_str(text);
    let not_json = |e: serde_json::Error| CoreError::BodyNotJson {
        line: e.line(),
        column: e.column(),
    };
    let top = DeserializeSeed::deserialize(TopVisitor(body.len()), &mut de).map_err(not_json)?;
    de.end().map_err(not_json)?;
    match top {
        Top::Object(boxed) => Ok(*boxed),
        Top::NotObject => Err(CoreError::BodyNotObject),
    }
}

/// The error of a body that is valid UTF-8 only up to the end of `before`: a JSON syntax
/// error inside `before` when there is one (what a parse from the start meets first), else
/// the position of the first invalid byte (1-based line and column, as serde_json counts).
fn not_utf8(before: &[u8]) -> CoreError {
    match serde_json::from_slice::<IgnoredAny>(before) {
        Err(e) if !e.is_eof() => CoreError::BodyNotJson {
            line: e.line(),
            column: e.column(),
        },
        _ => {
            let line_start = before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            CoreError::BodyNotJson {
                line: 1 + before.iter().filter(|&&b| b == b'\n').count(),
                column: 1 + before.len() - line_start,
            }
        }
    }
}

/// The [`RouteKey`] of parsed fields (the second half of [`route_key`]).
///
/// # Errors
/// [`CoreError::MissingField`], [`CoreError::WrongType`] as [`route_key`] documents.
pub(crate) fn key_from_fields(endpoint: Endpoint, f: Fields<'_>) -> Result<RouteKey, CoreError> {
    if f.model_wrong_type {
        return Err(CoreError::WrongType {
            field: "model",
            expected: "a string",
        });
    }
    let model = f.model.map(Cow::into_owned).unwrap_or_default();
    let suffix = model.split_once(':').map(|(_, adapter)| adapter);
    let lora = [f.lora_path.as_deref(), f.lora_id.as_deref(), suffix]
        .into_iter()
        .flatten()
        .find(|s| !s.is_empty());
    let namespace = namespace_hash(f.cache_salt.as_deref(), f.extra_key.as_deref(), lora);
    let mut key = RouteKey {
        stream: f.stream.unwrap_or(false),
        namespace,
        image_keys: f.image_data,
        ..RouteKey::default()
    };
    key.model = model;
    match endpoint {
        Endpoint::ChatCompletions => match f.messages {
            None => return Err(CoreError::MissingField { field: "messages" }),
            Some(Messages::NotArray) => {
                return Err(CoreError::WrongType {
                    field: "messages",
                    expected: "an array",
                });
            }
            Some(Messages::EntryNotObject) => {
                return Err(CoreError::WrongType {
                    field: "messages[]",
                    expected: "an object",
                });
            }
            Some(Messages::Empty) => {
                return Err(CoreError::WrongType {
                    field: "messages",
                    expected: "a non-empty array",
                });
            }
            Some(Messages::List(text, media)) => {
                key.text = text;
                key.image_keys.splice(0..0, media);
            }
        },
        Endpoint::Completions => match f.prompt {
            None | Some(Prompt::Null) => return Err(CoreError::MissingField { field: "prompt" }),
            Some(Prompt::Text(t)) => key.text = t.into_owned(),
            Some(Prompt::Empty) => {}
            Some(Prompt::Ids(ids)) => key.input_ids = Some(ids.into()),
            Some(Prompt::Invalid) => {
                return Err(CoreError::WrongType {
                    field: "prompt",
                    expected: "a string, an array of strings, or token ids",
                });
            }
        },
        Endpoint::Generate => {
            match f.input_ids {
                Some(Prompt::Ids(ids)) if !ids.is_empty() => key.input_ids = Some(ids.into()),
                None | Some(Prompt::Null | Prompt::Empty | Prompt::Ids(_)) => {}
                Some(Prompt::Text(_)) | Some(Prompt::Invalid) => {
                    return Err(CoreError::WrongType {
                        field: "input_ids",
                        expected: "token ids or an array of token-id arrays",
                    });
                }
            }
            match f.text {
                Some(Prompt::Text(t)) => key.text = t.into_owned(),
                Some(Prompt::Empty) => {}
                Some(Prompt::Ids(_)) | Some(Prompt::Invalid) => {
                    return Err(CoreError::WrongType {
                        field: "text",
                        expected: "a string or an array of strings",
                    });
                }
                None | Some(Prompt::Null) if key.input_ids.is_none() => {
                    return Err(CoreError::MissingField {
                        field: "text or input_ids",
                    });
                }
                None | Some(Prompt::Null) => {}
            }
        }
    }
    if key.input_ids.is_some() {
        key.token_source = TokenSource::Body;
    }
    Ok(key)
}

/// The top-level value: an object's routing fields, or "not an object".
enum Top<'a> {
    Object(Box<Fields<'a>>),
    NotObject,
}

/// The top-level fields routing reads, as [`parse_fields`] found them.
#[derive(Default)]
pub(crate) struct Fields<'a> {
    model: Option<Cow<'a, str>>,
    /// `model` was there, neither a string nor null.
    model_wrong_type: bool,
    stream: Option<bool>,
    /// `messages`, flattened (`crate::chat_prefix` sets it from the messages it parsed).
    pub(crate) messages: Option<Messages>,
    prompt: Option<Prompt<'a>>,
    text: Option<Prompt<'a>>,
    input_ids: Option<Prompt<'a>>,
    cache_salt: Option<Cow<'a, str>>,
    extra_key: Option<Cow<'a, str>>,
    lora_path: Option<Cow<'a, str>>,
    lora_id: Option<String>,
    image_data: Vec<u64>,
}

/// `messages`, already flattened into routing text and media keys.
pub(crate) enum Messages {
    List(String, Vec<u64>),
    /// `[]`.
    Empty,
    NotArray,
    EntryNotObject,
}

/// A prompt-like field (`prompt`, `text`, `input_ids`), first sequence of a batch.
enum Prompt<'a> {
    Text(Cow<'a, str>),
    Ids(Vec<u32>),
    /// `[]`.
    Empty,
    Null,
    Invalid,
}

/// Implements `Deserialize` through `deserialize_any` with the visitor `$visitor`.
macro_rules! deserialize_any_with {
    ($ty:ty, $visitor:expr) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any($visitor)
            }
        }
    };
}

/// Drains a sequence the caller does not need.
fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Drains a map the caller does not need.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A value kept only when it has the expected JSON type; anything else is skipped.
struct Loose<T>(Option<T>);

/// A string borrowed from the body when it has no escapes.
struct Str<'a>(Cow<'a, str>);

struct StrVisitor;
impl<'de> Visitor<'de> for StrVisitor {
    type Value = Loose<Str<'de>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Loose(Some(Str(Cow::Borrowed(v)))))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Loose(Some(Str(Cow::Owned(v.to_owned())))))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Loose(Some(Str(Cow::Owned(v)))))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        skip_seq(seq).map(|()| Loose(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map).map(|()| Loose(None))
    }
}
deserialize_any_with!(Loose<Str<'de>>, StrVisitor);

struct BoolVisitor;
impl<'de> Visitor<'de> for BoolVisitor {
    type Value = Loose<bool>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a boolean")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Loose(Some(v)))
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Loose(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        skip_seq(seq).map(|()| Loose(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map).map(|()| Loose(None))
    }
}
deserialize_any_with!(Loose<bool>, BoolVisitor);

/// Object keys routing reads; `Other` for the rest (matched without allocating). Variants are
/// named after the JSON keys (`extra_key` → `ExtraKey`).
#[allow(clippy::enum_variant_names)]
enum Key {
    Model,
    Stream,
    Messages,
    Prompt,
    Text,
    InputIds,
    Role,
    Content,
    Type,
    CacheSalt,
    ExtraKey,
    LoraPath,
    LoraId,
    ImageData,
    ImageUrl,
    Image,
    VideoUrl,
    InputAudio,
    Url,
    Data,
    Other,
}

struct KeyVisitor;
impl Visitor<'_> for KeyVisitor {
    type Value = Key;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E>(self, v: &str) -> Result<Key, E> {
        Ok(match v {
            "model" => Key::Model,
            "stream" => Key::Stream,
            "messages" => Key::Messages,
            "prompt" => Key::Prompt,
            "text" => Key::Text,
            "input_ids" => Key::InputIds,
            "role" => Key::Role,
            "content" => Key::Content,
            "type" => Key::Type,
            "cache_salt" => Key::CacheSalt,
            "extra_key" => Key::ExtraKey,
            "lora_path" => Key::LoraPath,
            "lora_id" => Key::LoraId,
            "image_data" => Key::ImageData,
            "image_url" => Key::ImageUrl,
            "image" => Key::Image,
            "video_url" => Key::VideoUrl,
            "input_audio" => Key::InputAudio,
            "url" => Key::Url,
            "data" => Key::Data,
            _ => Key::Other,
        })
    }
}
impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_identifier(KeyVisitor)
    }
}

/// The top-level object; its field is the body's length in bytes, the capacity of the
/// messages' text (never more than the body holds, so it is allocated once).
struct TopVisitor(usize);
impl<'de> DeserializeSeed<'de> for TopVisitor {
    type Value = Top<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Top<'de>, D::Error> {
        d.deserialize_any(self)
    }
}
impl<'de> Visitor<'de> for TopVisitor {
    type Value = Top<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top<'de>, A::Error> {
        let mut f = Fields::default();
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                // `null` is absent; any other value that is not a string, a wrong type.
                Key::Model => match map.next_value::<Option<Loose<Str>>>()? {
                    Some(Loose(m)) => {
                        f.model_wrong_type = m.is_none();
                        f.model = m.map(|s| s.0);
                    }
                    None => (f.model, f.model_wrong_type) = (None, false),
                },
                Key::Stream => f.stream = map.next_value::<Loose<bool>>()?.0,
                Key::Messages => f.messages = Some(map.next_value_seed(MessagesVisitor(self.0))?),
                Key::Prompt => f.prompt = Some(map.next_value()?),
                Key::Text => f.text = Some(map.next_value()?),
                Key::InputIds => f.input_ids = Some(map.next_value()?),
                Key::CacheSalt => f.cache_salt = map.next_value::<Loose<Str>>()?.0.map(|s| s.0),
                Key::ExtraKey => f.extra_key = map.next_value::<Loose<Str>>()?.0.map(|s| s.0),
                Key::LoraPath => f.lora_path = map.next_value::<Loose<Str>>()?.0.map(|s| s.0),
                Key::LoraId => f.lora_id = map.next_value::<LoraId>()?.0,
                Key::ImageData => f.image_data = map.next_value::<MediaList>()?.0,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Top::Object(Box::new(f)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Top<'de>, A::Error> {
        skip_seq(seq).map(|()| Top::NotObject)
    }
    fn visit_str<E>(self, _: &str) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
    fn visit_unit<E>(self) -> Result<Top<'de>, E> {
        Ok(Top::NotObject)
    }
}

/// `messages`: appends `<|role|>` + content text per message straight into one `String`.
/// Its field: the capacity of the text, bytes (the body's length).
struct MessagesVisitor(usize);
impl<'de> DeserializeSeed<'de> for MessagesVisitor {
    type Value = Messages;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Messages, D::Error> {
        d.deserialize_any(self)
    }
}
impl<'de> Visitor<'de> for MessagesVisitor {
    type Value = Messages;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
        let mut text = String::new();
        let mut media = Vec::new();
        let mut all_objects = true;
        let mut any = false;
        let cap = self.0;
        while let Some(m) = seq.next_element::<Message>()? {
            any = true;
            match m {
                Message::Object {
                    role,
                    content,
                    media: m,
                } if all_objects => {
                    media.extend(m);
                    if text.capacity() == 0 {
                        text.reserve(cap);
                    }
                    text.push_str("<|");
                    text.push_str(role.as_deref().unwrap_or(""));
                    text.push_str("|>");
                    for part in content.as_slice() {
                        text.push_str(part);
                    }
                }
                Message::Object { .. } => {}
                Message::NotObject => all_objects = false,
            }
        }
        Ok(match (any, all_objects) {
            (false, _) => Messages::Empty,
            (true, true) => Messages::List(text, media),
            (true, false) => Messages::EntryNotObject,
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Messages, A::Error> {
        skip_map(map).map(|()| Messages::NotArray)
    }
    fn visit_str<E>(self, _: &str) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
    fn visit_unit<E>(self) -> Result<Messages, E> {
        Ok(Messages::NotArray)
    }
}

/// One chat message: role and the text pieces of its content.
enum Message<'a> {
    Object {
        role: Option<Cow<'a, str>>,
        content: Texts<'a>,
        media: Vec<u64>,
    },
    NotObject,
}

/// The text pieces of one message's content: a string (one piece, no vector to allocate),
/// or the texts of its parts.
enum Texts<'a> {
    One(Cow<'a, str>),
    Parts(Vec<Cow<'a, str>>),
}

impl<'a> Texts<'a> {
    const NONE: Self = Texts::Parts(Vec::new());

    fn as_slice(&self) -> &[Cow<'a, str>] {
        match self {
            Texts::One(t) => std::slice::from_ref(t),
            Texts::Parts(p) => p,
        }
    }
}

struct MessageVisitor;
impl<'de> Visitor<'de> for MessageVisitor {
    type Value = Message<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message<'de>, A::Error> {
        let mut role = None;
        let mut content = Texts::NONE;
        let mut media = Vec::new();
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Role => role = map.next_value::<Loose<Str>>()?.0.map(|s| s.0),
                Key::Content => {
                    let c = map.next_value::<Content>()?;
                    content = c.0;
                    media = c.1;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Message::Object {
            role,
            content,
            media,
        })
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Message<'de>, A::Error> {
        skip_seq(seq).map(|()| Message::NotObject)
    }
    fn visit_str<E>(self, _: &str) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
    fn visit_unit<E>(self) -> Result<Message<'de>, E> {
        Ok(Message::NotObject)
    }
}
deserialize_any_with!(Message<'de>, MessageVisitor);

/// Message content: a string, or the texts of `type: "text"` parts and the media keys of the
/// other parts; anything else is empty.
struct Content<'a>(Texts<'a>, Vec<u64>);

struct ContentVisitor;
impl<'de> Visitor<'de> for ContentVisitor {
    type Value = Content<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("message content")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Content<'de>, E> {
        Ok(Content(Texts::One(Cow::Borrowed(v)), Vec::new()))
    }
    fn visit_str<E>(self, v: &str) -> Result<Content<'de>, E> {
        Ok(Content(Texts::One(Cow::Owned(v.to_owned())), Vec::new()))
    }
    fn visit_string<E>(self, v: String) -> Result<Content<'de>, E> {
        Ok(Content(Texts::One(Cow::Owned(v)), Vec::new()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content<'de>, A::Error> {
        let mut parts = Vec::new();
        let mut media = Vec::new();
        while let Some(p) = seq.next_element::<Part>()? {
            parts.extend(p.0);
            media.extend(p.1);
        }
        Ok(Content(Texts::Parts(parts), media))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Content<'de>, A::Error> {
        skip_map(map).map(|()| Content(Texts::NONE, Vec::new()))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Content<'de>, E> {
        Ok(Content(Texts::NONE, Vec::new()))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Content<'de>, E> {
        Ok(Content(Texts::NONE, Vec::new()))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Content<'de>, E> {
        Ok(Content(Texts::NONE, Vec::new()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Content<'de>, E> {
        Ok(Content(Texts::NONE, Vec::new()))
    }
    fn visit_unit<E>(self) -> Result<Content<'de>, E> {
        Ok(Content(Texts::NONE, Vec::new()))
    }
}
deserialize_any_with!(Content<'de>, ContentVisitor);

/// A content part: its `text` when `type` is `"text"` (keys in any order), and the media key
/// of an `image_url` / `image` / `video_url` / `input_audio` reference.
struct Part<'a>(Option<Cow<'a, str>>, Option<u64>);

struct PartVisitor;
impl<'de> Visitor<'de> for PartVisitor {
    type Value = Part<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content part")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Part<'de>, A::Error> {
        let mut is_text = false;
        let mut text = None;
        let mut media = None;
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Type => {
                    is_text = map
                        .next_value::<Loose<Str>>()?
                        .0
                        .is_some_and(|s| s.0 == "text");
                }
                Key::Text => text = map.next_value::<Loose<Str>>()?.0.map(|s| s.0),
                Key::ImageUrl | Key::Image | Key::VideoUrl | Key::InputAudio => {
                    media = media.or(map.next_value::<Media>()?.0);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Part(text.filter(|_| is_text), media))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Part<'de>, A::Error> {
        skip_seq(seq).map(|()| Part(None, None))
    }
    fn visit_str<E>(self, _: &str) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
    fn visit_unit<E>(self) -> Result<Part<'de>, E> {
        Ok(Part(None, None))
    }
}
deserialize_any_with!(Part<'de>, PartVisitor);

/// A media reference: a string (URL or data URI), or an object's `url` or `data` string
/// (`{"url": ..}` of `image_url`, `{"data": .., "format": ..}` of `input_audio`).
struct Media(Option<u64>);

struct MediaVisitor;
impl<'de> Visitor<'de> for MediaVisitor {
    type Value = Media;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a media reference")
    }
    fn visit_str<E>(self, v: &str) -> Result<Media, E> {
        Ok(Media(Some(media_key(v))))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Media, A::Error> {
        let mut out = None;
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Url | Key::Data if out.is_none() => {
                    out = map.next_value::<Loose<Str>>()?.0.map(|s| media_key(&s.0));
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Media(out))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Media, A::Error> {
        skip_seq(seq).map(|()| Media(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Media, E> {
        Ok(Media(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Media, E> {
        Ok(Media(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Media, E> {
        Ok(Media(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Media, E> {
        Ok(Media(None))
    }
    fn visit_unit<E>(self) -> Result<Media, E> {
        Ok(Media(None))
    }
}
deserialize_any_with!(Media, MediaVisitor);

/// `/generate` `image_data`: one reference, or an array of references (nested arrays of a
/// batch: their references in order).
struct MediaList(Vec<u64>);

struct MediaListVisitor;
impl<'de> Visitor<'de> for MediaListVisitor {
    type Value = MediaList;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("media references")
    }
    fn visit_str<E>(self, v: &str) -> Result<MediaList, E> {
        Ok(MediaList(vec![media_key(v)]))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MediaList, A::Error> {
        Ok(MediaList(
            MediaVisitor.visit_map(map)?.0.into_iter().collect(),
        ))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MediaList, A::Error> {
        let mut out = Vec::new();
        while let Some(m) = seq.next_element::<MediaList>()? {
            out.extend(m.0);
        }
        Ok(MediaList(out))
    }
    fn visit_bool<E>(self, _: bool) -> Result<MediaList, E> {
        Ok(MediaList(Vec::new()))
    }
    fn visit_i64<E>(self, _: i64) -> Result<MediaList, E> {
        Ok(MediaList(Vec::new()))
    }
    fn visit_u64<E>(self, _: u64) -> Result<MediaList, E> {
        Ok(MediaList(Vec::new()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<MediaList, E> {
        Ok(MediaList(Vec::new()))
    }
    fn visit_unit<E>(self) -> Result<MediaList, E> {
        Ok(MediaList(Vec::new()))
    }
}
deserialize_any_with!(MediaList, MediaListVisitor);

/// `lora_id`: a string, or an integer written in decimal; anything else is unset.
struct LoraId(Option<String>);

struct LoraIdVisitor;
impl<'de> Visitor<'de> for LoraIdVisitor {
    type Value = LoraId;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a LoRA id")
    }
    fn visit_str<E>(self, v: &str) -> Result<LoraId, E> {
        Ok(LoraId(Some(v.to_owned())))
    }
    fn visit_u64<E>(self, v: u64) -> Result<LoraId, E> {
        Ok(LoraId(Some(v.to_string())))
    }
    fn visit_i64<E>(self, v: i64) -> Result<LoraId, E> {
        Ok(LoraId(Some(v.to_string())))
    }
    fn visit_f64<E>(self, _: f64) -> Result<LoraId, E> {
        Ok(LoraId(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<LoraId, E> {
        Ok(LoraId(None))
    }
    fn visit_unit<E>(self) -> Result<LoraId, E> {
        Ok(LoraId(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<LoraId, A::Error> {
        skip_seq(seq).map(|()| LoraId(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<LoraId, A::Error> {
        skip_map(map).map(|()| LoraId(None))
    }
}
deserialize_any_with!(LoraId, LoraIdVisitor);

/// One element of a prompt array: decides the array's shape.
enum Item<'a> {
    Text(Cow<'a, str>),
    Id(Option<u32>),
    Ids(Option<Vec<u32>>),
    Other,
}

struct ItemVisitor;
impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt element")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Item<'de>, E> {
        Ok(Item::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Item<'de>, E> {
        Ok(Item::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Item<'de>, E> {
        Ok(Item::Text(Cow::Owned(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Item<'de>, E> {
        Ok(Item::Id(u32::try_from(v).ok()))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Item<'de>, E> {
        Ok(Item::Id(u32::try_from(v).ok()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Item<'de>, E> {
        Ok(Item::Id(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item<'de>, A::Error> {
        let mut ids = Some(Vec::new());
        while let Some(item) = seq.next_element::<Item>()? {
            match (item, &mut ids) {
                (Item::Id(Some(id)), Some(v)) => v.push(id),
                _ => ids = None,
            }
        }
        Ok(Item::Ids(ids))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item<'de>, A::Error> {
        skip_map(map).map(|()| Item::Other)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Item<'de>, E> {
        Ok(Item::Other)
    }
    fn visit_unit<E>(self) -> Result<Item<'de>, E> {
        Ok(Item::Other)
    }
}
deserialize_any_with!(Item<'de>, ItemVisitor);

struct PromptVisitor;
impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Text(Cow::Owned(v)))
    }
    fn visit_unit<E>(self) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Null)
    }
    /// `[..]`: the first element decides: text (first of a batch), ids (all must be ids), or
    /// an id array (first of a batch).
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt<'de>, A::Error> {
        let out = match seq.next_element::<Item>()? {
            None => return Ok(Prompt::Empty),
            Some(Item::Text(t)) => Prompt::Text(t),
            Some(Item::Ids(Some(ids))) => Prompt::Ids(ids),
            Some(Item::Id(Some(first))) => {
                let mut ids = vec![first];
                while let Some(item) = seq.next_element::<Item>()? {
                    match item {
                        Item::Id(Some(id)) => ids.push(id),
                        _ => return skip_seq(seq).map(|()| Prompt::Invalid),
                    }
                }
                return Ok(Prompt::Ids(ids));
            }
            Some(_) => Prompt::Invalid,
        };
        skip_seq(seq).map(|()| out)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Prompt<'de>, A::Error> {
        skip_map(map).map(|()| Prompt::Invalid)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Invalid)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Invalid)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Invalid)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Prompt<'de>, E> {
        Ok(Prompt::Invalid)
    }
}
deserialize_any_with!(Prompt<'de>, PromptVisitor);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(ep: Endpoint, body: &str) -> RouteKey {
        route_key(ep, body.as_bytes()).unwrap()
    }

    fn err(ep: Endpoint, body: &str) -> CoreError {
        route_key(ep, body.as_bytes()).unwrap_err()
    }

    #[test]
    fn chat_text_has_role_markers_and_extends_across_turns() {
        let t1 = key(
            Endpoint::ChatCompletions,
            r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"}]}"#,
        );
        assert_eq!(t1.text, "<|system|>S<|user|>hi");
        assert_eq!(
            (t1.model.as_str(), t1.stream, t1.input_ids),
            ("m", true, None)
        );
        let t2 = key(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"},
               {"role":"assistant","content":"yo","tool_calls":[{"id":"1"}]},
               {"content":[{"type":"text","text":"mo"},{"type":"image_url","image_url":{"url":"x"}},
               {"text":"re","type":"text"}],"role":"user"}],"temperature":0.2}"#,
        );
        assert!(t2.text.starts_with(&t1.text));
        assert_eq!(t2.text, "<|system|>S<|user|>hi<|assistant|>yo<|user|>more");
        assert_eq!((t2.model.as_str(), t2.stream), ("", false));
    }

    /// B19 (sgl-project/sglang issue #26263): the key is every message, not `messages[0]`.
    #[test]
    fn b19_conversations_diverge_after_the_shared_system_prompt() {
        let a = key(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"rivers"}]}"#,
        );
        let b = key(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"sorting"}]}"#,
        );
        let common = a
            .text
            .chars()
            .zip(b.text.chars())
            .take_while(|(x, y)| x == y)
            .count();
        assert_eq!(common, "<|system|>Be brief.<|user|>".chars().count());
    }

    #[test]
    fn chat_escapes_nulls_and_odd_fields() {
        let k = key(
            Endpoint::ChatCompletions,
            r#"{"model":null,"stream":"yes","messages":[{"role":"user","content":"a\"b\u00e9\ud83d\ude00"},
               {"role":null,"content":null},{"role":"tool","content":{"x":1}}]}"#,
        );
        assert_eq!(k.text, "<|user|>a\"bé😀<||><|tool|>");
        assert_eq!((k.model.as_str(), k.stream), ("", false));
        // An empty message still has its role's markers: only no message at all is empty.
        assert_eq!(
            key(Endpoint::ChatCompletions, r#"{"messages":[{}]}"#).text,
            "<||>"
        );
    }

    #[test]
    fn completions_shapes() {
        let c = |b| key(Endpoint::Completions, b);
        assert_eq!(c(r#"{"prompt":"abc","model":"m"}"#).text, "abc");
        assert_eq!(c(r#"{"prompt":["a","b"]}"#).text, "a");
        assert_eq!(
            c(r#"{"prompt":[1,2,3]}"#).input_ids,
            Some(vec![1, 2, 3].into())
        );
        assert_eq!(c(r#"{"prompt":[1,2,3]}"#).text, "");
        assert_eq!(
            c(r#"{"prompt":[[4,5],[6]]}"#).input_ids,
            Some(vec![4, 5].into())
        );
        assert_eq!(
            c(r#"{"prompt":[4294967295]}"#).input_ids,
            Some(vec![u32::MAX].into())
        );
        assert_eq!(c(r#"{"prompt":[]}"#), RouteKey::default());
    }

    #[test]
    fn generate_shapes() {
        let g = |b| key(Endpoint::Generate, b);
        let k = g(r#"{"text":"t","input_ids":[7,8],"sampling_params":{"max_new_tokens":1}}"#);
        assert_eq!(
            (k.text.as_str(), k.input_ids),
            ("t", Some(vec![7, 8].into()))
        );
        assert_eq!(
            g(r#"{"input_ids":[[9],[1]]}"#).input_ids,
            Some(vec![9].into())
        );
        assert_eq!(g(r#"{"text":["x","y"]}"#).text, "x");
        assert_eq!(g(r#"{"text":"x","input_ids":null}"#).input_ids, None);
        assert_eq!(g(r#"{"text":"x","input_ids":[]}"#).input_ids, None);
        assert_eq!(
            g(r#"{"text":null,"input_ids":[3]}"#).input_ids,
            Some(vec![3].into())
        );
    }

    #[test]
    fn bad_bodies_are_named_errors() {
        use CoreError::*;
        use Endpoint::*;
        assert_eq!(
            err(ChatCompletions, "not json"), // fails at the `o` of what began as `null`
            BodyNotJson { line: 1, column: 2 }
        );
        assert_eq!(
            err(ChatCompletions, "{\"messages\":[]}\n x"),
            BodyNotJson { line: 2, column: 2 }
        );
        assert!(matches!(
            err(Completions, r#"{"prompt":"a""#),
            BodyNotJson { .. }
        ));
        // Invalid UTF-8 is refused at the position serde_json's own check names (the
        // reference: `from_slice` into a `Value`, which validates every string).
        for bad in [
            &b"{\"model\":\"m\xff\"}"[..],
            b"{\"messages\":[],\n\n  \"x\":\"ab\xc3\x28\"}",
            b"\xfe{}",
            b"{\"a\":\"\xe2\x82\"}",
            b"{\"a\" 1, \"b\":\"\xff\"}",
        ] {
            let e = serde_json::from_slice::<serde_json::Value>(bad).unwrap_err();
            assert_eq!(
                route_key(ChatCompletions, bad).unwrap_err(),
                BodyNotJson {
                    line: e.line(),
                    column: e.column()
                },
                "{bad:?}"
            );
        }
        assert_eq!(err(ChatCompletions, "[1,2]"), BodyNotObject);
        assert_eq!(err(Generate, "\"text\""), BodyNotObject);
        assert_eq!(
            err(ChatCompletions, r#"{"model":"m"}"#),
            MissingField { field: "messages" }
        );
        let not_array = WrongType {
            field: "messages",
            expected: "an array",
        };
        assert_eq!(err(ChatCompletions, r#"{"messages":"hi"}"#), not_array);
        assert_eq!(
            err(ChatCompletions, r#"{"messages":{"role":"user"}}"#),
            not_array
        );
        assert_eq!(
            err(ChatCompletions, r#"{"messages":[{"role":"user"},"hi"]}"#),
            WrongType {
                field: "messages[]",
                expected: "an object"
            }
        );
        assert_eq!(
            err(ChatCompletions, r#"{"model":"m","messages":[]}"#),
            WrongType {
                field: "messages",
                expected: "a non-empty array"
            }
        );
        // A model of the wrong type is named as such, whatever the endpoint; null is absent.
        let model = WrongType {
            field: "model",
            expected: "a string",
        };
        for bad in ["5", "true", "[\"m\"]", "{\"name\":\"m\"}"] {
            let body = format!(r#"{{"model":{bad},"messages":[{{"role":"user"}}]}}"#);
            assert_eq!(err(ChatCompletions, &body), model, "{bad}");
        }
        assert_eq!(err(Generate, r#"{"model":5,"text":"t"}"#), model);
        assert_eq!(
            key(ChatCompletions, r#"{"model":null,"messages":[{}]}"#).model,
            ""
        );
        assert_eq!(
            err(Completions, r#"{"model":"m"}"#),
            MissingField { field: "prompt" }
        );
        assert_eq!(
            err(Completions, r#"{"prompt":null}"#),
            MissingField { field: "prompt" }
        );
        for bad in [
            r#"{"prompt":5}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[[1,-2]]}"#,
            r#"{"prompt":[true]}"#,
            r#"{"prompt":{"a":1}}"#,
        ] {
            assert!(
                matches!(
                    err(Completions, bad),
                    WrongType {
                        field: "prompt",
                        ..
                    }
                ),
                "{bad}"
            );
        }
        assert_eq!(
            err(Generate, r#"{"sampling_params":{}}"#),
            MissingField {
                field: "text or input_ids"
            }
        );
        assert!(matches!(
            err(Generate, r#"{"input_ids":"x"}"#),
            WrongType {
                field: "input_ids",
                ..
            }
        ));
        assert!(matches!(
            err(Generate, r#"{"text":[1,2]}"#),
            WrongType { field: "text", .. }
        ));
    }

    /// anchors.md §2.7: `cache_salt`, `extra_key` and the LoRA adapter form the partition;
    /// empty string = unset; `lora_path` wins over `lora_id`, which wins over `model:adapter`.
    #[test]
    fn namespace_from_partition_fields() {
        use kvroute_tokenize::blocks::namespace_hash as ns;
        let c = |b: &str| key(Endpoint::ChatCompletions, b).namespace;
        let g = |b: &str| key(Endpoint::Generate, b).namespace;
        assert_eq!(c(r#"{"messages":[{}]}"#), 0);
        assert_eq!(c(r#"{"messages":[{}],"cache_salt":"","extra_key":""}"#), 0);
        assert_eq!(
            c(r#"{"messages":[{}],"cache_salt":"s1"}"#),
            ns(Some("s1"), None, None)
        );
        assert_eq!(
            key(
                Endpoint::Completions,
                r#"{"prompt":"p","extra_key":"e","cache_salt":"s"}"#
            )
            .namespace,
            ns(Some("s"), Some("e"), None)
        );
        assert_eq!(
            g(r#"{"text":"t","lora_path":"a1"}"#),
            ns(None, None, Some("a1"))
        );
        assert_eq!(g(r#"{"text":"t","lora_id":7}"#), ns(None, None, Some("7")));
        assert_eq!(
            g(r#"{"text":"t","lora_id":"x","lora_path":"a1"}"#),
            ns(None, None, Some("a1"))
        );
        let suffix = key(
            Endpoint::ChatCompletions,
            r#"{"model":"qwen3:sql","messages":[{}]}"#,
        );
        assert_eq!(
            (suffix.model.as_str(), suffix.namespace),
            ("qwen3:sql", ns(None, None, Some("sql")))
        );
        assert_eq!(c(r#"{"model":"qwen3:","messages":[{}]}"#), 0);
        assert_eq!(g(r#"{"text":"t","lora_path":null,"cache_salt":5}"#), 0);
    }

    #[test]
    fn image_keys_in_request_order() {
        use kvroute_tokenize::blocks::media_key as mk;
        let k = key(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":[
                {"type":"image_url","image_url":{"url":"http://x/a.png","detail":"high"}},
                {"type":"text","text":"compare"},
                {"image_url":"data:image/png;base64,AAAA","type":"image_url"}]},
               {"role":"user","content":[{"type":"input_audio","input_audio":{"format":"wav","data":"UklG"}},
                {"type":"image","image":"http://x/b.png"},{"type":"video_url","video_url":{"url":"v.mp4"}}]}]}"#,
        );
        assert_eq!(
            k.image_keys,
            vec![
                mk("http://x/a.png"),
                mk("data:image/png;base64,AAAA"),
                mk("UklG"),
                mk("http://x/b.png"),
                mk("v.mp4")
            ]
        );
        assert_eq!(k.text, "<|user|>compare<|user|>");
        let g = key(
            Endpoint::Generate,
            r#"{"text":"t","image_data":["http://x/a.png",["b"]]}"#,
        );
        assert_eq!(g.image_keys, vec![mk("http://x/a.png"), mk("b")]);
        assert_eq!(
            key(Endpoint::Generate, r#"{"text":"t","image_data":"one"}"#).image_keys,
            vec![mk("one")]
        );
        assert!(
            key(Endpoint::Generate, r#"{"text":"t"}"#)
                .image_keys
                .is_empty()
        );
    }

    #[test]
    fn body_ids_are_marked() {
        let g = key(Endpoint::Generate, r#"{"input_ids":[1,2]}"#);
        assert_eq!(g.token_source, TokenSource::Body);
        let t = key(Endpoint::Generate, r#"{"text":"x"}"#);
        assert_eq!(t.token_source, TokenSource::None);
    }

    proptest! {
        /// Any chat conversation round-trips: the key is the concatenation of role markers and
        /// contents, whatever the characters (escapes, emoji, quotes).
        #[test]
        fn chat_key_is_concatenation(msgs in prop::collection::vec(("[a-z]{0,8}", "\\PC{0,20}"), 1..6)) {
            let json: Vec<_> = msgs
                .iter()
                .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
                .collect();
            let body = serde_json::json!({"messages": json, "n": 1}).to_string();
            let want: String = msgs.iter().map(|(r, c)| format!("<|{r}|>{c}")).collect();
            prop_assert_eq!(route_key(Endpoint::ChatCompletions, body.as_bytes()).unwrap().text, want);
        }

        /// Arbitrary bytes never panic, and errors are only the named body errors.
        #[test]
        fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..64)) {
            for ep in [Endpoint::ChatCompletions, Endpoint::Completions, Endpoint::Generate] {
                if let Err(e) = route_key(ep, &body) {
                    prop_assert_ne!(e.kind(), "config");
                }
            }
        }
    }
}
