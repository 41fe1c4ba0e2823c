//! [`route_key`]: the part of a request body routing needs, parsed once; the body itself is
//! forwarded unchanged.

use crate::CoreError;
use serde::Deserialize;
use serde_json::Value;

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
    /// `model` field; empty when absent. The index is kept per model.
    pub model: String,
    /// `stream` field.
    pub stream: bool,
    /// Routing text. Chat: each message as `<|role|>` + its text, in order, so turn N+1's
    /// text extends turn N's and two conversations that share only a system prompt diverge
    /// right after it. Completions: the prompt. Generate: `text`.
    pub text: String,
    /// Token ids when the request carries them (`input_ids` of `/generate`, or a token-id
    /// `prompt` of `/v1/completions`); first sequence of a batch.
    pub input_ids: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    input_ids: Option<Value>,
}

/// Parses the routing fields of `body` for `endpoint`; other fields are skipped unparsed.
///
/// # Errors
/// [`CoreError::BadBody`] when the body is not a JSON object, `messages` is missing or not an
/// array of objects (chat), the prompt is missing or of the wrong type (completions), or
/// neither `text` nor `input_ids` is usable (generate).
pub fn route_key(endpoint: Endpoint, body: &[u8]) -> Result<RouteKey, CoreError> {
    let b: Body = serde_json::from_slice(body).map_err(|e| CoreError::BadBody(e.to_string()))?;
    let mut key = RouteKey {
        model: b.model.unwrap_or_default(),
        stream: b.stream.unwrap_or(false),
        ..RouteKey::default()
    };
    match endpoint {
        Endpoint::ChatCompletions => {
            let messages = b
                .messages
                .ok_or_else(|| CoreError::BadBody("`messages` is required".into()))?;
            let Value::Array(messages) = messages else {
                return Err(CoreError::BadBody("`messages` must be an array".into()));
            };
            for m in &messages {
                let Value::Object(m) = m else {
                    return Err(CoreError::BadBody("each message must be an object".into()));
                };
                key.text.push_str("<|");
                key.text
                    .push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
                key.text.push_str("|>");
                push_content(&mut key.text, m.get("content"));
            }
        }
        Endpoint::Completions => match b.prompt {
            Some(p) => set_prompt(&mut key, p, "prompt")?,
            None => return Err(CoreError::BadBody("`prompt` is required".into())),
        },
        Endpoint::Generate => {
            if let Some(ids) = b.input_ids.filter(|v| !v.is_null()) {
                key.input_ids = Some(token_ids(&ids, "input_ids")?);
            }
            match b.text {
                Some(t) if !t.is_null() => set_prompt(&mut key, t, "text")?,
                _ if key.input_ids.is_some() => {}
                _ => {
                    return Err(CoreError::BadBody(
                        "`text` or `input_ids` is required".into(),
                    ));
                }
            }
        }
    }
    Ok(key)
}

/// Appends a message's text: a string, or the `text` of `type: "text"` parts of an array.
fn push_content(out: &mut String, content: Option<&Value>) {
    match content {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                if p.get("type").and_then(Value::as_str) == Some("text")
                    && let Some(t) = p.get("text").and_then(Value::as_str)
                {
                    out.push_str(t);
                }
            }
        }
        _ => {}
    }
}

/// A prompt: a string, an array of strings (first), an array of ids, or an array of id
/// arrays (first).
fn set_prompt(key: &mut RouteKey, value: Value, field: &str) -> Result<(), CoreError> {
    match value {
        Value::String(s) => key.text = s,
        Value::Array(items) => match items.first() {
            None => key.text.clear(),
            Some(Value::String(s)) => key.text = s.clone(),
            Some(Value::Number(_)) | Some(Value::Array(_)) => {
                key.input_ids = Some(token_ids(&Value::Array(items), field)?);
            }
            Some(_) => {
                return Err(CoreError::BadBody(format!(
                    "`{field}` has an invalid element"
                )));
            }
        },
        _ => {
            return Err(CoreError::BadBody(format!(
                "`{field}` must be a string or an array"
            )));
        }
    }
    Ok(())
}

/// Token ids from `[1, 2]` or `[[1, 2], [3]]` (first sequence).
fn token_ids(v: &Value, field: &str) -> Result<Vec<u32>, CoreError> {
    let bad = || {
        CoreError::BadBody(format!(
            "`{field}` must be token ids (non-negative integers)"
        ))
    };
    let seq = match v {
        Value::Array(items) if matches!(items.first(), Some(Value::Array(_))) => &items[0],
        other => other,
    };
    let Value::Array(items) = seq else {
        return Err(bad());
    };
    items
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(bad)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ep: Endpoint, body: &str) -> RouteKey {
        route_key(ep, body.as_bytes()).unwrap()
    }

    #[test]
    fn chat_text_has_role_markers_and_extends_across_turns() {
        let t1 = key(
            Endpoint::ChatCompletions,
            r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"}]}"#,
        );
        assert_eq!(t1.text, "<|system|>S<|user|>hi");
        assert_eq!((t1.model.as_str(), t1.stream), ("m", true));
        let t2 = key(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"},
               {"role":"assistant","content":"yo"},{"role":"user","content":[{"type":"text","text":"more"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        );
        assert!(t2.text.starts_with(&t1.text));
        assert_eq!(t2.text, "<|system|>S<|user|>hi<|assistant|>yo<|user|>more");
    }

    #[test]
    fn completions_and_generate_shapes() {
        assert_eq!(
            key(Endpoint::Completions, r#"{"prompt":"abc"}"#).text,
            "abc"
        );
        assert_eq!(
            key(Endpoint::Completions, r#"{"prompt":["a","b"]}"#).text,
            "a"
        );
        assert_eq!(
            key(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#).input_ids,
            Some(vec![1, 2, 3])
        );
        assert_eq!(
            key(Endpoint::Completions, r#"{"prompt":[[4,5],[6]]}"#).input_ids,
            Some(vec![4, 5])
        );
        let g = key(Endpoint::Generate, r#"{"text":"t","input_ids":[7,8]}"#);
        assert_eq!((g.text.as_str(), g.input_ids), ("t", Some(vec![7, 8])));
        assert_eq!(
            key(Endpoint::Generate, r#"{"input_ids":[[9],[1]]}"#).input_ids,
            Some(vec![9])
        );
        assert_eq!(key(Endpoint::Generate, r#"{"text":["x","y"]}"#).text, "x");
    }

    #[test]
    fn bad_bodies_are_named_errors() {
        for (ep, body) in [
            (Endpoint::ChatCompletions, "not json"),
            (Endpoint::ChatCompletions, "[1,2]"),
            (Endpoint::ChatCompletions, r#"{"model":"m"}"#),
            (Endpoint::ChatCompletions, r#"{"messages":"hi"}"#),
            (Endpoint::ChatCompletions, r#"{"messages":["hi"]}"#),
            (Endpoint::Completions, r#"{"model":"m"}"#),
            (Endpoint::Completions, r#"{"prompt":5}"#),
            (Endpoint::Completions, r#"{"prompt":[-1]}"#),
            (Endpoint::Generate, r#"{"sampling_params":{}}"#),
            (Endpoint::Generate, r#"{"input_ids":"x"}"#),
        ] {
            assert!(
                matches!(route_key(ep, body.as_bytes()), Err(CoreError::BadBody(_))),
                "{body}"
            );
        }
    }
}
