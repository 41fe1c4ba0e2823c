//! Mid-stream migration (`--migration-limit N`, off by default; Dynamo's idea, operations.md
//! §2): when a worker fails after the client's SSE stream began, the router re-sends the
//! request to another worker as a *continuation* of what was already streamed, and splices
//! the new worker's events into the same stream, so the client sees one uninterrupted,
//! non-duplicated stream.
//!
//! | endpoint | continuation request | source |
//! |---|---|---|
//! | `/v1/chat/completions` | the streamed text appended as a final assistant message, `continue_final_message: true`, `add_generation_prompt: false` | vLLM's chat API |
//! | `/v1/completions` | `prompt` + the streamed text | OpenAI completions |
//! | `/generate` | not migrated (its stream repeats the whole text; ids would be needed) | — |
//!
//! `max_tokens` (and `max_completion_tokens`) shrink by the tokens already streamed, counted
//! as one per content-bearing event (vLLM and SGLang stream one token per event). The
//! continuation's first chat event (the `role` delta) is dropped and every event's `id` is
//! rewritten to the first worker's, so the client's SDK sees one completion. Its `usage`
//! (with `stream_options.include_usage`) is made the whole request's: `completion_tokens`
//! gains the `c` tokens streamed before it; `prompt_tokens` is the original prompt's when the
//! router tokenized it (token mode: the ids it routed on), else the continuation's minus `c`
//! (its prompt is the original plus the streamed text, and the chat template's few tokens
//! around a final assistant message: 4 more with Qwen3's); `total_tokens` is their sum.

use serde_json::Value;

/// What an SSE stream carried so far, and the splicing of continuation streams into it.
///
/// # Invariants
/// 1. `text` is the concatenation of every content delta forwarded to the client, in order.
/// 2. `partial` holds the bytes after the last complete event (`\n\n`) seen.
#[derive(Debug, Default)]
pub struct StreamTracker {
    chat: bool,
    text: String,
    tokens: u64,
    id: Option<String>,
    partial: Vec<u8>,
    finished: bool,
    /// 0 for the first worker's stream; k after the k-th migration.
    segment: u32,
    /// The current segment's events seen (the first chat event of a continuation is its
    /// role delta).
    segment_events: u64,
    /// Tokens streamed before the current segment began (its continuation's prompt holds
    /// them).
    carried: u64,
    /// The original request's prompt tokens, when the router tokenized it.
    prompt_tokens: Option<u64>,
}

impl StreamTracker {
    /// A tracker for a chat (`true`) or completions stream whose prompt has `prompt_tokens`
    /// tokens (`None`: not tokenized by the router).
    pub fn new(chat: bool, prompt_tokens: Option<u64>) -> Self {
        Self {
            chat,
            prompt_tokens,
            ..Self::default()
        }
    }

    /// Text streamed to the client so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Tokens streamed so far (content-bearing events).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// True once an event with a `finish_reason` or `data: [DONE]` went through: nothing is
    /// left to migrate.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// A new worker's stream begins (after a migration).
    pub fn next_segment(&mut self) {
        self.segment += 1;
        self.segment_events = 0;
        self.carried = self.tokens;
        self.partial.clear();
    }

    /// Feeds body data of the current segment; appends to `out` what goes to the client:
    /// complete events only (a cut event is kept until its end arrives, or dropped when the
    /// worker fails), with a continuation's role delta dropped and its `id` rewritten.
    pub fn filter(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.partial.extend_from_slice(data);
        let mut start = 0;
        while let Some(end) = memchr::memmem::find(&self.partial[start..], b"\n\n") {
            let event = self.partial[start..start + end + 2].to_vec();
            start += end + 2;
            self.event(&event, out);
        }
        self.partial.drain(..start);
    }

    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) {
        self.segment_events += 1;
        let Some(payload) = event.strip_prefix(b"data:") else {
            out.extend_from_slice(event);
            return;
        };
        let payload = payload.trim_ascii();
        if payload == b"[DONE]" {
            self.finished = true;
            out.extend_from_slice(event);
            return;
        }
        let Ok(mut v) = serde_json::from_slice::<Value>(payload) else {
            out.extend_from_slice(event);
            return;
        };
        let choice = &v["choices"][0];
        let piece = if self.chat {
            choice["delta"]["content"].as_str()
        } else {
            choice["text"].as_str()
        }
        .unwrap_or("")
        .to_string();
        if !choice["finish_reason"].is_null() && choice.get("finish_reason").is_some() {
            self.finished = true;
        }
        // A continuation opens with the role delta the client already had.
        let role_only = self.chat && piece.is_empty() && !choice["delta"]["role"].is_null();
        if self.segment > 0 && self.segment_events == 1 && role_only {
            return;
        }
        if !piece.is_empty() {
            self.text.push_str(&piece);
            self.tokens += 1;
        }
        let mut changed = false;
        match (&self.id, v.get("id").and_then(Value::as_str)) {
            (None, Some(id)) => self.id = Some(id.to_string()),
            (Some(first), Some(id)) if self.segment > 0 && id != first => {
                v["id"] = Value::String(first.clone());
                changed = true;
            }
            _ => {}
        }
        if self.carried > 0
            && let Some(usage) = v.get_mut("usage")
        {
            changed |= carry_usage(usage, self.carried, self.prompt_tokens);
        }
        if changed {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(v.to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        } else {
            out.extend_from_slice(event);
        }
    }

    /// The continuation of the original request whose body is `body` (JSON), for all the text
    /// streamed so far (over every segment); `None` when it cannot be continued (not a JSON object, no messages or prompt,
    /// `n` > 1, or no token budget left).
    pub fn continuation(&self, body: &[u8]) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let obj = v.as_object_mut()?;
        if obj.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
            return None;
        }
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(m) = obj.get(key).and_then(Value::as_u64) {
                let left = m.checked_sub(self.tokens).filter(|&l| l > 0)?;
                obj.insert(key.into(), left.into());
            }
        }
        if self.chat {
            let messages = obj.get_mut("messages")?.as_array_mut()?;
            messages.push(serde_json::json!({"role": "assistant", "content": self.text}));
            obj.insert("continue_final_message".into(), true.into());
            obj.insert("add_generation_prompt".into(), false.into());
        } else {
            let prompt = format!("{}{}", obj.get("prompt")?.as_str()?, self.text);
            obj.insert("prompt".into(), prompt.into());
        }
        serde_json::to_vec(&v).ok()
    }
}

/// Makes a continuation's `usage` (an object with `prompt_tokens` and `completion_tokens`;
/// anything else is left alone, false) the whole request's: `carried` tokens streamed before
/// it added to the completion, the prompt `original` tokens when known (else the
/// continuation's minus `carried`), the total their sum, and
/// `prompt_tokens_details.cached_tokens` kept within the prompt. True when it changed.
fn carry_usage(usage: &mut Value, carried: u64, original: Option<u64>) -> bool {
    let (Some(prompt), Some(completion)) = (
        usage["prompt_tokens"].as_u64(),
        usage["completion_tokens"].as_u64(),
    ) else {
        return false;
    };
    let prompt = original.unwrap_or(prompt.saturating_sub(carried));
    let completion = completion + carried;
    usage["prompt_tokens"] = prompt.into();
    usage["completion_tokens"] = completion.into();
    if usage.get("total_tokens").is_some() {
        usage["total_tokens"] = (prompt + completion).into();
    }
    if let Some(cached) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        usage["prompt_tokens_details"]["cached_tokens"] = cached.min(prompt).into();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_event(id: &str, delta: Value, finish: Option<&str>) -> String {
        let v = serde_json::json!({"id": id, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {v}\n\n")
    }

    /// A chat stream cut after two tokens, then a continuation from another worker: the
    /// client sees the first role delta once, every event with the first id, the text whole.
    #[test]
    fn splices_a_chat_continuation() {
        let mut t = StreamTracker::new(true, None);
        let mut out = Vec::new();
        let first = [
            chat_event(
                "a",
                serde_json::json!({"role": "assistant", "content": ""}),
                None,
            ),
            chat_event("a", serde_json::json!({"content": "Hel"}), None),
            chat_event("a", serde_json::json!({"content": "lo"}), None),
        ]
        .concat();
        // Delivered in two cuts, the second mid-event: complete events only go out.
        let (x, y) = first.as_bytes().split_at(first.len() - 10);
        t.filter(x, &mut out);
        assert_eq!((t.text(), t.tokens()), ("Hel", 1));
        t.filter(y, &mut out);
        assert_eq!((t.text(), t.tokens()), ("Hello", 2));
        assert_eq!(out, first.as_bytes());
        let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]});
        let cont: Value =
            serde_json::from_slice(&t.continuation(body.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(cont["max_tokens"], 8);
        assert_eq!(cont["continue_final_message"], true);
        assert_eq!(cont["add_generation_prompt"], false);
        assert_eq!(
            cont["messages"][1],
            serde_json::json!({"role": "assistant", "content": "Hello"})
        );
        t.next_segment();
        let mut out = Vec::new();
        let second = [
            chat_event(
                "b",
                serde_json::json!({"role": "assistant", "content": ""}),
                None,
            ),
            chat_event("b", serde_json::json!({"content": " world"}), Some("stop")),
            // The continuation's usage: its prompt held the 2 tokens streamed before.
            format!(
                "data: {}\n\n",
                serde_json::json!({"id": "b", "choices": [], "usage": {"prompt_tokens": 14,
                    "completion_tokens": 1, "total_tokens": 15,
                    "prompt_tokens_details": {"cached_tokens": 14}}})
            ),
            "data: [DONE]\n\n".to_string(),
        ]
        .concat();
        t.filter(second.as_bytes(), &mut out);
        let text = String::from_utf8(out).unwrap();
        let usage: Value = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|p| serde_json::from_str::<Value>(p).ok())
            .find_map(|v| v.get("usage").cloned())
            .expect("usage event forwarded");
        assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
        assert_eq!(
            usage,
            serde_json::json!({"prompt_tokens": 12, "completion_tokens": 3,
                "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 12}})
        );
        assert!(!text.contains("\"role\""), "role delta repeated: {text}");
        assert!(!text.contains("\"id\":\"b\""), "{text}");
        // The content event and the usage event, both with the first id.
        assert_eq!(text.matches("\"id\":\"a\"").count(), 2);
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(t.text(), "Hello world");
        assert!(t.finished());
    }

    #[test]
    fn completions_continuation_appends_the_text() {
        let mut t = StreamTracker::new(false, None);
        let ev = |s: &str| {
            format!(
                "data: {}\n\n",
                serde_json::json!({"id": "c", "choices": [{"index": 0, "text": s, "finish_reason": null}]})
            )
        };
        let mut out = Vec::new();
        t.filter((ev("One") + &ev(" two")).as_bytes(), &mut out);
        let body = br#"{"model":"m","prompt":"Count:","max_tokens":2,"stream":true}"#;
        // Two tokens of a 2-token budget: nothing left to continue.
        assert_eq!(t.continuation(body), None);
        let body = br#"{"model":"m","prompt":"Count:","max_tokens":5,"stream":true}"#;
        let cont: Value = serde_json::from_slice(&t.continuation(body).unwrap()).unwrap();
        assert_eq!(
            (cont["prompt"].as_str(), cont["max_tokens"].as_u64()),
            (Some("Count:One two"), Some(3))
        );
        assert_eq!(t.continuation(br#"{"prompt":"x","n":2}"#), None);
        assert_eq!(t.continuation(b"not json"), None);
    }
}
