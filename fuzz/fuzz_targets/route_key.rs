//! Fuzzes `kvroute_core::route_key::route_key` for each `Endpoint`, differentially: the
//! single-pass typed scan against a reference that first builds the whole JSON tree (all
//! object entries, in order, duplicates kept) and then reads the routing fields from it by
//! the rules of `route_key`'s doc.
//!
//! Whenever the tree parses, both must give the same key or the same error. The tree is the
//! stricter parse (it checks numbers, strings and depth of the fields `route_key` skips), so
//! when it fails only "no panic" is checked.

#![no_main]

use kvroute_core::CoreError;
use kvroute_core::route_key::{Endpoint, RouteKey, TokenSource, route_key};
use kvroute_tokenize::blocks::{media_key, namespace_hash};
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

fuzz_target!(|data: &[u8]| {
    let tree = parse_tree(data);
    for ep in [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Generate,
    ] {
        let got = route_key(ep, data);
        if let Some(tree) = &tree {
            assert_eq!(
                got,
                reference(ep, tree),
                "{ep:?}: {:?}",
                String::from_utf8_lossy(data)
            );
        }
        if let Ok(key) = &got {
            assert_eq!(
                key.input_ids.is_some(),
                key.token_source == TokenSource::Body
            );
        }
    }
});

/// A JSON value with every object entry kept in document order.
#[derive(Debug)]
enum J {
    Null,
    Bool(bool),
    U(u64),
    I(i64),
    F,
    S(String),
    A(Vec<J>),
    O(Vec<(String, J)>),
}

struct JVisitor;
impl<'de> Visitor<'de> for JVisitor {
    type Value = J;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<J, E> {
        Ok(J::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<J, E> {
        Ok(J::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<J, E> {
        Ok(J::U(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<J, E> {
        Ok(J::I(v))
    }
    fn visit_f64<E>(self, _: f64) -> Result<J, E> {
        Ok(J::F)
    }
    fn visit_str<E>(self, v: &str) -> Result<J, E> {
        Ok(J::S(v.to_owned()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<J, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(J::A(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<J, A::Error> {
        let mut out = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, J>()? {
            out.push((k, v));
        }
        Ok(J::O(out))
    }
}
impl<'de> Deserialize<'de> for J {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JVisitor)
    }
}

/// The whole body as one tree, or `None` when it is not exactly one JSON value.
fn parse_tree(body: &[u8]) -> Option<J> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let tree = J::deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(tree)
}

/// The last entry named `key` (a repeated key: the last one counts).
fn last<'a>(o: &'a [(String, J)], key: &str) -> Option<&'a J> {
    o.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// The last entry named `key` when it is a string.
fn last_str<'a>(o: &'a [(String, J)], key: &str) -> Option<&'a str> {
    match last(o, key) {
        Some(J::S(s)) => Some(s),
        _ => None,
    }
}

/// A media object: the first `url` / `data` entry that is a string.
fn media_obj(o: &[(String, J)]) -> Option<u64> {
    o.iter().find_map(|(k, v)| match v {
        J::S(s) if k == "url" || k == "data" => Some(media_key(s)),
        _ => None,
    })
}

/// A media reference: a string, or a media object.
fn media(j: &J) -> Option<u64> {
    match j {
        J::S(s) => Some(media_key(s)),
        J::O(o) => media_obj(o),
        _ => None,
    }
}

/// `image_data`: a reference, or arrays (at any depth) of references.
fn media_list(j: &J, out: &mut Vec<u64>) {
    match j {
        J::S(s) => out.push(media_key(s)),
        J::O(o) => out.extend(media_obj(o)),
        J::A(items) => items.iter().for_each(|i| media_list(i, out)),
        _ => {}
    }
}

/// A content part: its text (when `type` is `"text"`) and the first media reference among
/// its `image_url` / `image` / `video_url` / `input_audio` entries.
fn part(j: &J) -> (Option<&str>, Option<u64>) {
    let J::O(o) = j else {
        return (None, None);
    };
    let is_text = last_str(o, "type") == Some("text");
    let text = last_str(o, "text").filter(|_| is_text);
    let m = o
        .iter()
        .filter(|(k, _)| ["image_url", "image", "video_url", "input_audio"].contains(&k.as_str()))
        .find_map(|(_, v)| media(v));
    (text, m)
}

/// One element of a prompt array, as its shape.
enum Item<'a> {
    Text(&'a str),
    Id(Option<u32>),
    Ids(Option<Vec<u32>>),
    Other,
}

fn item(j: &J) -> Item<'_> {
    match j {
        J::S(s) => Item::Text(s),
        J::U(v) => Item::Id(u32::try_from(*v).ok()),
        J::I(v) => Item::Id(u32::try_from(*v).ok()),
        J::F => Item::Id(None),
        J::A(xs) => Item::Ids(xs.iter().map(id).collect()),
        _ => Item::Other,
    }
}

fn id(j: &J) -> Option<u32> {
    match item(j) {
        Item::Id(id) => id,
        _ => None,
    }
}

/// A prompt-like field's shape.
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Empty,
    Null,
    Invalid,
}

fn prompt(j: &J) -> Prompt {
    match j {
        J::Null => Prompt::Null,
        J::S(s) => Prompt::Text(s.clone()),
        J::A(xs) => match xs.first().map(item) {
            None => Prompt::Empty,
            Some(Item::Text(t)) => Prompt::Text(t.to_owned()),
            Some(Item::Ids(Some(ids))) => Prompt::Ids(ids),
            Some(Item::Id(Some(_))) => xs
                .iter()
                .map(id)
                .collect::<Option<Vec<u32>>>()
                .map_or(Prompt::Invalid, Prompt::Ids),
            Some(_) => Prompt::Invalid,
        },
        _ => Prompt::Invalid,
    }
}

/// What `route_key` must return for `tree`, by the rules of its doc.
fn reference(ep: Endpoint, tree: &J) -> Result<RouteKey, CoreError> {
    let J::O(o) = tree else {
        return Err(CoreError::BodyNotObject);
    };
    let model = last_str(o, "model").unwrap_or("").to_owned();
    let lora_id = match last(o, "lora_id") {
        Some(J::S(s)) => Some(s.clone()),
        Some(J::U(v)) => Some(v.to_string()),
        Some(J::I(v)) => Some(v.to_string()),
        _ => None,
    };
    let suffix = model.split_once(':').map(|(_, a)| a);
    let lora = [last_str(o, "lora_path"), lora_id.as_deref(), suffix]
        .into_iter()
        .flatten()
        .find(|s| !s.is_empty());
    let mut image_data = Vec::new();
    if let Some(j) = last(o, "image_data") {
        media_list(j, &mut image_data);
    }
    let mut key = RouteKey {
        model: model.clone(),
        stream: matches!(last(o, "stream"), Some(J::Bool(true))),
        namespace: namespace_hash(last_str(o, "cache_salt"), last_str(o, "extra_key"), lora),
        image_keys: image_data,
        ..RouteKey::default()
    };
    match ep {
        Endpoint::ChatCompletions => {
            let msgs = match last(o, "messages") {
                None => return Err(CoreError::MissingField { field: "messages" }),
                Some(J::A(msgs)) => msgs,
                Some(_) => {
                    return Err(CoreError::WrongType {
                        field: "messages",
                        expected: "an array",
                    });
                }
            };
            let mut media = Vec::new();
            for m in msgs {
                let J::O(m) = m else {
                    return Err(CoreError::WrongType {
                        field: "messages[]",
                        expected: "an object",
                    });
                };
                key.text.push_str("<|");
                key.text.push_str(last_str(m, "role").unwrap_or(""));
                key.text.push_str("|>");
                match last(m, "content") {
                    Some(J::S(s)) => key.text.push_str(s),
                    Some(J::A(parts)) => {
                        for p in parts {
                            let (t, k) = part(p);
                            key.text.push_str(t.unwrap_or(""));
                            media.extend(k);
                        }
                    }
                    _ => {}
                }
            }
            key.image_keys.splice(0..0, media);
        }
        Endpoint::Completions => match last(o, "prompt").map(prompt) {
            None | Some(Prompt::Null) => return Err(CoreError::MissingField { field: "prompt" }),
            Some(Prompt::Text(t)) => key.text = t,
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
            match last(o, "input_ids").map(prompt) {
                None | Some(Prompt::Null | Prompt::Empty) => {}
                Some(Prompt::Ids(ids)) => key.input_ids = Some(ids).filter(|v| !v.is_empty()).map(Into::into),
                Some(Prompt::Text(_) | Prompt::Invalid) => {
                    return Err(CoreError::WrongType {
                        field: "input_ids",
                        expected: "token ids or an array of token-id arrays",
                    });
                }
            }
            match last(o, "text").map(prompt) {
                Some(Prompt::Text(t)) => key.text = t,
                Some(Prompt::Empty) => {}
                Some(Prompt::Ids(_) | Prompt::Invalid) => {
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
