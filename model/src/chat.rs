//! Chat templates: the model's own Jinja template (from `tokenizer_config.json` or GGUF
//! `tokenizer.chat_template`) rendered with minijinja configured like HF `transformers`
//! (trim_blocks, lstrip_blocks, Python string/dict methods, `raise_exception`).

use minijinja::{context, Environment, Error, ErrorKind, Value};

use crate::error::{ModelError, Result};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` as HF provides it (Llama 3 templates print today's date). Supports the
/// `%d %m %Y %y %b %B %%` directives, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
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
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders OpenAI-style `messages` (a JSON array; `tool_calls`, `tool_call_id`, `name` are
    /// passed through untouched) with optional `tools` (a JSON array of tool definitions).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(ModelError::InvalidArgument(
                "messages must be a JSON array".into(),
            ));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        let tools = match tools {
            Some(t) if !t.is_null() => Value::from_serialize(t),
            _ => Value::from(()),
        };
        tmpl.render(context! {
            messages => Value::from_serialize(messages),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            ModelError::ChatTemplate(msg)
        })
    }
}

/// A chat request's messages or tools that cannot be made into a prompt.
#[derive(Debug, thiserror::Error)]
pub enum ChatInputError {
    /// A field of the request is invalid (`field` is its JSON path, e.g. `messages[2].role`).
    #[error("{field}: {reason}")]
    Invalid {
        /// JSON path of the offending field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The template refused the conversation.
    #[error(transparent)]
    Template(#[from] ModelError),
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ChatInputError {
    ChatInputError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The tools a request puts in the prompt: every tool unless `tool_choice` is `"none"`.
pub fn prompt_tools(
    tools: Option<&serde_json::Value>,
    tool_choice: Option<&serde_json::Value>,
) -> Vec<serde_json::Value> {
    if tool_choice.and_then(serde_json::Value::as_str) == Some("none") {
        return Vec::new();
    }
    match tools {
        Some(serde_json::Value::Array(t)) => t.clone(),
        _ => Vec::new(),
    }
}

/// The system-prompt block describing tools, for templates that know nothing of tools
/// (the Hermes-style `<tool_call>` convention, which `hindsight serve` parses back).
pub fn tool_instructions(tools: &[serde_json::Value]) -> String {
    let mut s = String::from(
        "You may call one or more functions to assist with the user query. You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&t.get("function").unwrap_or(t).to_string());
        s.push('\n');
    }
    s.push_str("</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// A message's `content` as text: a string, null, or an array of text parts.
pub fn content_text(
    content: &serde_json::Value,
    idx: usize,
) -> std::result::Result<String, ChatInputError> {
    use serde_json::Value as J;
    match content {
        J::Null => Ok(String::new()),
        J::String(s) => Ok(s.clone()),
        J::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(J::as_str), p.get("text")) {
                    (Some("text"), Some(J::String(t))) => out.push_str(t),
                    _ => {
                        return Err(invalid(
                            format!("messages[{idx}].content"),
                            "only text content parts are supported",
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(invalid(
            format!("messages[{idx}].content"),
            "content must be a string or an array of text parts",
        )),
    }
}

impl ChatTemplate {
    /// Whether the template renders `tools` itself (otherwise tools are described in the system
    /// message and calls/results are written as `<tool_call>` / `<tool_response>` text).
    pub fn native_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// The prompt for an OpenAI-style chat request, exactly as `hindsight serve` builds it:
    /// `developer` becomes `system`, content parts are joined, and for templates without native
    /// tool support, assistant `tool_calls` become `<tool_call>` blocks, `tool` messages become
    /// `<tool_response>` blocks and the tools are described in the system message. The learner
    /// renders logged requests through this same function, so it trains on the very prompt the
    /// served model saw (and its behaviour log-probs describe).
    pub fn render_chat(
        &self,
        messages: &[serde_json::Value],
        tools: &[serde_json::Value],
    ) -> std::result::Result<String, ChatInputError> {
        self.render_chat_with(messages, tools, true)
    }

    /// Like [`ChatTemplate::render_chat`], but the last message is an assistant message the
    /// prompt *continues* (vLLM's `continue_final_message`): rendered without a generation
    /// prompt and cut right after that message's text, so its tokens are the start of the
    /// answer (what a scorer of a given answer's log-probs needs).
    pub fn render_chat_continuing(
        &self,
        messages: &[serde_json::Value],
        tools: &[serde_json::Value],
    ) -> std::result::Result<String, ChatInputError> {
        let last = messages.len().saturating_sub(1);
        let final_text = match messages.last() {
            Some(m) if m.get("role").and_then(serde_json::Value::as_str) == Some("assistant") => {
                content_text(m.get("content").unwrap_or(&serde_json::Value::Null), last)?
            }
            _ => {
                return Err(invalid(
                    format!("messages[{last}].role"),
                    "continuing the final message needs an assistant message last",
                ))
            }
        };
        // The template may trim the text; cut after its last occurrence, as vLLM does.
        let final_text = final_text.trim();
        if final_text.is_empty() {
            return Err(invalid(
                format!("messages[{last}].content"),
                "the message to continue has no text",
            ));
        }
        let text = self.render_chat_with(messages, tools, false)?;
        let end = text
            .rfind(final_text)
            .map(|i| i + final_text.len())
            .ok_or_else(|| {
                invalid(
                    format!("messages[{last}].content"),
                    "the chat template does not render the final message's text verbatim",
                )
            })?;
        Ok(text[..end].to_string())
    }

    fn render_chat_with(
        &self,
        messages: &[serde_json::Value],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, ChatInputError> {
        use serde_json::{json, Value as J};
        let native_tools = self.native_tools();
        let mut out = Vec::with_capacity(messages.len() + 1);
        for (i, m) in messages.iter().enumerate() {
            let role = m.get("role").and_then(J::as_str).ok_or_else(|| {
                invalid(format!("messages[{i}].role"), "each message needs a role")
            })?;
            if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
                return Err(invalid(
                    format!("messages[{i}].role"),
                    format!("unknown role {role:?}"),
                ));
            }
            let mut text = content_text(m.get("content").unwrap_or(&J::Null), i)?;
            let mut msg = m.as_object().cloned().unwrap_or_default();
            let role = if role == "developer" { "system" } else { role };
            msg.insert("role".into(), json!(role));
            if !native_tools {
                if let Some(J::Array(calls)) = m.get("tool_calls") {
                    for c in calls {
                        let f = c.get("function").cloned().unwrap_or(J::Null);
                        let args = match f.get("arguments") {
                            Some(J::String(s)) => serde_json::from_str(s).unwrap_or(json!(s)),
                            Some(v) => v.clone(),
                            None => json!({}),
                        };
                        let call = json!({"name": f.get("name").cloned().unwrap_or(J::Null), "arguments": args});
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                    }
                    msg.remove("tool_calls");
                }
                if role == "tool" {
                    text = format!("<tool_response>\n{text}\n</tool_response>");
                }
            }
            msg.insert("content".into(), json!(text));
            out.push(J::Object(msg));
        }
        let tools_value = (!tools.is_empty()).then(|| J::Array(tools.to_vec()));
        if !native_tools && !tools.is_empty() {
            let block = tool_instructions(tools);
            match out.first_mut() {
                Some(J::Object(first)) if first.get("role") == Some(&json!("system")) => {
                    let old = first
                        .get("content")
                        .and_then(J::as_str)
                        .unwrap_or("")
                        .to_string();
                    first.insert("content".into(), json!(format!("{old}\n\n{block}")));
                }
                _ => out.insert(0, json!({"role": "system", "content": block})),
            }
        }
        Ok(self.render(
            &J::Array(out),
            if native_tools {
                tools_value.as_ref()
            } else {
                None
            },
            add_generation_prompt,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
            "<s>",
            "</s>",
        )
        .unwrap();
        let err = t
            .render(&json!([{"role": "assistant", "content": "x"}]), None, false)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), None, false)
                .unwrap(),
            "ok"
        );
    }

    #[test]
    fn render_chat_writes_tools_calls_and_results_for_templates_without_tools() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert!(!t.native_tools());
        let tools = vec![
            json!({"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}),
        ];
        let messages = vec![
            json!({"role": "developer", "content": "Be brief."}),
            json!({"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "ORD-1?"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": "{\"order_id\":\"ORD-1\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "{\"status\":\"shipped\"}"}),
        ];
        let text = t.render_chat(&messages, &tools).unwrap();
        assert!(
            text.starts_with("<system>Be brief.\n\nYou may call one or more functions"),
            "{text}"
        );
        assert!(
            text.contains("<tools>\n{\"name\":\"lookup_order\""),
            "{text}"
        );
        assert!(text.contains("<user>Where is ORD-1?</user>"), "{text}");
        assert!(
            text.contains("<assistant><tool_call>\n{\"arguments\":{\"order_id\":\"ORD-1\"},\"name\":\"lookup_order\"}\n</tool_call></assistant>"),
            "{text}"
        );
        assert!(
            text.contains(
                "<tool><tool_response>\n{\"status\":\"shipped\"}\n</tool_response></tool>"
            ),
            "{text}"
        );
        assert!(text.ends_with("<assistant>"));
        // No tools in play: no block; tool_choice "none" removes them from the prompt.
        assert!(prompt_tools(Some(&json!(tools)), Some(&json!("none"))).is_empty());
        assert_eq!(
            prompt_tools(Some(&json!(tools)), Some(&json!("auto"))).len(),
            1
        );
        let plain = t.render_chat(&messages[..2], &[]).unwrap();
        assert_eq!(
            plain,
            "<system>Be brief.</system><user>Where is ORD-1?</user><assistant>"
        );
        // Bad input names the field.
        let err = t
            .render_chat(&[json!({"role": "robot", "content": "x"})], &[])
            .unwrap_err();
        assert_eq!(err.to_string(), "messages[0].role: unknown role \"robot\"");
        let err = t
            .render_chat(
                &[json!({"role": "user", "content": [{"type": "image_url"}]})],
                &[],
            )
            .unwrap_err();
        assert!(err.to_string().starts_with("messages[0].content:"), "{err}");
    }

    #[test]
    fn continuing_the_final_message_extends_the_generation_prompt_with_its_text() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let asked = vec![json!({"role": "user", "content": "Capital of France?"})];
        let mut answered = asked.clone();
        answered.push(json!({"role": "assistant", "content": "Paris. "}));
        let prompt = t.render_chat(&asked, &[]).unwrap();
        let continued = t.render_chat_continuing(&answered, &[]).unwrap();
        assert_eq!(continued, format!("{prompt}Paris."));
        for (messages, field) in [
            (asked.clone(), "messages[0].role"),
            (
                vec![
                    asked[0].clone(),
                    json!({"role": "assistant", "content": " "}),
                ],
                "messages[1].content",
            ),
        ] {
            let err = t.render_chat_continuing(&messages, &[]).unwrap_err();
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }
}
