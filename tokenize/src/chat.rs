//! Chat templates: `tokenizer_config.json`'s Jinja `chat_template`, rendered with minijinja.
//!
//! Python-isms the HF templates rely on (`str.startswith`, `split`, `rstrip`, ...) come from
//! `minijinja_contrib::pycompat`; `raise_exception`, `strftime_now` and a `tojson` filter that
//! writes what Python's `json.dumps(x, ensure_ascii=False)` writes are provided as HF's
//! `apply_chat_template` does, and blocks are trimmed as in HF's Jinja environment
//! (`trim_blocks=True, lstrip_blocks=True`). Objects keep their key order from the request
//! (minijinja `preserve_order`), as Python dicts do.

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
    /// The template is Qwen3's: plain bodies take [`crate::native::render_qwen3`].
    native_qwen3: bool,
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
        let mut t = Self::interpreted(source, bos_token, eos_token)?;
        t.native_qwen3 = source == crate::native::QWEN3_TEMPLATE.as_str();
        Ok(t)
    }

    /// True when this is the Qwen3 template that [`crate::native`] renders (plain bodies skip
    /// the interpreter).
    pub fn is_native_qwen3(&self) -> bool {
        self.native_qwen3
    }

    /// [`ChatTemplate::new`] always through minijinja (the reference the native renderer is
    /// tested against).
    pub(crate) fn interpreted(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("strftime_now", strftime_now);
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
            native_qwen3: false,
        })
    }

    /// Renders `messages` (a JSON array of `{role, content, ...}` objects) to prompt text.
    /// `tools` (a JSON array or null) is passed through for templates that use it.
    ///
    /// `serde_json::Value` objects iterate in key order unless serde_json's `preserve_order`
    /// is on; for exact `tojson` output of tools use [`ChatTemplate::render_body`].
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
        self.render_values(
            Value::from_serialize(messages),
            tools.map(Value::from_serialize),
            Value::UNDEFINED,
            add_generation_prompt,
        )
    }

    /// Renders an OpenAI Chat Completions body (JSON bytes) as the engine does: `messages`,
    /// `tools` and `chat_template_kwargs` (e.g. `enable_thinking`) are read in their original
    /// key order; `add_generation_prompt` is the body's field when it is a boolean (vLLM),
    /// otherwise true. Other fields are skipped.
    ///
    /// # Errors
    /// [`TokenizeError::ChatBody`] when the bytes are not a JSON object with a `messages`
    /// array; [`TokenizeError::Template`] when rendering fails.
    pub fn render_body(&self, body: &[u8]) -> Result<String, TokenizeError> {
        if self.native_qwen3
            && let Some(text) = crate::native::render_qwen3(body)
        {
            return Ok(text);
        }
        let req: ChatBody =
            serde_json::from_slice(body).map_err(|e| TokenizeError::ChatBody(e.to_string()))?;
        if req.messages.kind() != minijinja::value::ValueKind::Seq {
            return Err(TokenizeError::ChatBody(
                "'messages' must be an array".into(),
            ));
        }
        let kwargs = req.chat_template_kwargs.unwrap_or(Value::UNDEFINED);
        self.render_values(
            req.messages,
            req.tools,
            kwargs,
            req.add_generation_prompt.unwrap_or(true),
        )
    }

    /// Renders with minijinja values. `kwargs` (a map, or undefined) adds template variables
    /// (HF `apply_chat_template(**kwargs)`); the fixed names win over it.
    fn render_values(
        &self,
        messages: Value,
        tools: Option<Value>,
        kwargs: Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        let fixed = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        let ctx = if kwargs.kind() == minijinja::value::ValueKind::Map {
            minijinja::context! { ..fixed, ..kwargs }
        } else {
            fixed
        };
        Ok(tmpl.render(ctx)?)
    }
}

/// The fields of a chat body the template needs; the rest is skipped.
#[derive(serde::Deserialize)]
struct ChatBody {
    messages: Value,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default, deserialize_with = "loose_bool")]
    add_generation_prompt: Option<bool>,
}

/// A boolean, or `None` for any other JSON value.
fn loose_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    Ok(serde::Deserialize::deserialize(d)
        .ok()
        .and_then(|v: serde_json::Value| v.as_bool()))
}

/// HF's `tojson` filter: Python `json.dumps(x, ensure_ascii=False, indent=indent)` — `", "` and
/// `": "` separators, keys in order, non-ASCII kept, no HTML escaping.
fn tojson(value: Value, indent: Option<usize>) -> Result<Value, minijinja::Error> {
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(Value::from(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&python_float(f64::try_from(v.clone()).unwrap_or(f64::NAN)));
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).unwrap_or_default())
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&key).unwrap_or_default());
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
    }
    Ok(())
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16,
/// otherwise `d.ddde±XX`; `NaN` / `Infinity` as `json.dumps` writes them.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{x:e}"); // e.g. "-1.25e-7", "1e20"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// HF's `strftime_now(format)`: the current UTC time formatted with a strftime subset
/// (`%Y %m %d %H %M %S %b %B %a %A %y %j %%`). Only date-stamping templates use it.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs)
}

/// `format` applied to the UTC instant `secs` (seconds since the Unix epoch).
fn strftime(format: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_is_python_json_dumps() {
        let v: Value = serde_json::from_str(
            r#"{"z":1,"a":[1.5,"é\n\"<>",null,true,{}],"m":{"k":1e-7,"big":1e20,"f":2.0}}"#,
        )
        .unwrap();
        let got = tojson(v.clone(), None).unwrap();
        assert_eq!(
            got.as_str().unwrap(),
            r#"{"z": 1, "a": [1.5, "é\n\"<>", null, true, {}], "m": {"k": 1e-07, "big": 1e+20, "f": 2.0}}"#
        );
        let got = tojson(
            Value::from_serialize(serde_json::json!([1, {"a": 2}])),
            Some(2),
        )
        .unwrap();
        assert_eq!(got.as_str().unwrap(), "[\n  1,\n  {\n    \"a\": 2\n  }\n]");
    }

    #[test]
    fn strftime_known_instant() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %%", 1_709_211_909),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 %"
        );
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    }
}
