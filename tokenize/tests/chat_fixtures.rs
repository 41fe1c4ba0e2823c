//! Chat template fidelity: kvroute's rendering and ids against the HF `transformers` reference
//! (`tokenize/fixtures/qwen3_chat.json`, made by `tokenize/fixtures/make_chat_fixtures.py`).

use kvroute_tokenize::{IncrementalTokenizer, Tokenizer};
use minijinja::Value;

/// The fixture cases, parsed keeping object key order (minijinja `preserve_order`), as the
/// gateway sees a request body.
fn fixtures() -> Vec<Value> {
    let doc: Value = serde_json::from_str(include_str!("../fixtures/qwen3_chat.json")).unwrap();
    doc.get_attr("cases").unwrap().try_iter().unwrap().collect()
}

fn field(case: &Value, name: &str) -> Value {
    case.get_attr(name).unwrap()
}

#[test]
fn qwen3_chat_matches_transformers() {
    let tok = Tokenizer::qwen3().unwrap();
    let cases = fixtures();
    assert_eq!(cases.len(), 14);
    let mut failures = Vec::new();
    for case in &cases {
        let name = field(case, "name").to_string();
        let body = serde_json::to_vec(&field(case, "body")).unwrap();
        let want_text = field(case, "text").to_string();
        let want_ids: Vec<u32> = field(case, "ids")
            .try_iter()
            .unwrap()
            .map(|v| u32::try_from(v).unwrap())
            .collect();
        match tok.render_chat_body(&body) {
            Ok(text) if text == want_text => {}
            Ok(text) => failures.push(format!("{name}: text\n got {text:?}\nwant {want_text:?}")),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
        assert_eq!(tok.encode(&want_text), want_ids, "{name}: ids");
        let mut inc = IncrementalTokenizer::new(tok.clone(), 1 << 20);
        assert_eq!(inc.encode(&want_text, 0).unwrap().ids, want_ids, "{name}");
        let again = inc.encode(&want_text, 0).unwrap();
        assert_eq!(again.ids, want_ids, "{name}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `tools` go through `tojson` in the request's key order (Python dict order): a body whose
/// keys were sorted renders differently, so the order really is kept.
#[test]
fn tools_keep_request_key_order() {
    let tok = Tokenizer::qwen3().unwrap();
    let case = fixtures()
        .into_iter()
        .find(|c| field(c, "name").as_str() == Some("tools_with_system"))
        .unwrap();
    let body = serde_json::to_vec(&field(&case, "body")).unwrap();
    let text = tok.render_chat_body(&body).unwrap();
    assert_eq!(text, field(&case, "text").to_string());
    assert!(text.contains(r#"{"type": "function", "function": {"name": "get_weather""#));
    // The same body with sorted keys (serde_json::Value) gives other text.
    let sorted: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let sorted_text = tok
        .render_chat_body(&serde_json::to_vec(&sorted).unwrap())
        .unwrap();
    assert_ne!(sorted_text, text);
}
