//! OpenAI request parsing and validation, prompt rendering (chat template, tools), tool-call
//! parsing and response bodies.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::engine::FinishReason;
use crate::error::ServeError;
use crate::grammar::{self, Node, OJson};
use crate::sampler::Pick;

/// Most choices per request.
pub const MAX_N: usize = 16;
/// Most alternatives per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// The fields of `/v1/chat/completions` and `/v1/completions` this server reads; others are
/// accepted and ignored, as OpenAI-compatible servers do.
#[derive(Debug, Clone, Deserialize)]
pub struct RawRequest {
    /// Base model name, adapter name or `name@version`.
    pub model: String,
    /// Chat messages (chat endpoint).
    #[serde(default)]
    pub messages: Option<Value>,
    /// Prompt (completions endpoint).
    #[serde(default)]
    pub prompt: Option<Value>,
    /// Stream as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `{"include_usage": bool}`.
    #[serde(default)]
    pub stream_options: Option<Value>,
    /// Sampling temperature (OpenAI's default 1).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Token budget (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Token budget.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Seed for reproducible sampling.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Choices.
    #[serde(default)]
    pub n: Option<u64>,
    /// Chat: bool. Completions: an integer (alternatives per token).
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token.
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    /// Tool definitions.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `none` | `auto` | `required` | `{"type":"function","function":{"name":..}}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Completions: echo the prompt (unsupported when true).
    #[serde(default)]
    pub echo: Option<bool>,
    /// vLLM's extension: the log-prob of every prompt token after the first, with this many
    /// alternatives each (0 = the token's own only), in the response's `prompt_logprobs`.
    #[serde(default)]
    pub prompt_logprobs: Option<u64>,
    /// Chat, vLLM's extension: end the prompt with the assistant's turn opened (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Chat, vLLM's extension: the last message is an assistant message the answer continues
    /// (with `prompt_logprobs`, how a given answer is scored).
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// The whole body with object keys in document order (for schemas).
    #[serde(skip)]
    pub ordered: Option<OJson>,
}

/// Validated sampling knobs common to both endpoints.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// Temperature.
    pub temperature: f64,
    /// Nucleus.
    pub top_p: f64,
    /// Requested budget, if any.
    pub max_tokens: Option<usize>,
    /// Stops.
    pub stop: Vec<String>,
    /// Seed.
    pub seed: Option<u64>,
    /// Choices.
    pub n: usize,
    /// Whether the client asked for log-probs.
    pub logprobs: bool,
    /// Alternatives per token.
    pub top_logprobs: usize,
    /// Stream.
    pub stream: bool,
    /// Final usage chunk in streams.
    pub include_usage: bool,
    /// Alternatives per scored prompt token (`None`: the prompt is not scored).
    pub prompt_logprobs: Option<usize>,
}

/// Parses a JSON body into a request, as a 400 on failure.
pub fn parse_body(body: &[u8]) -> Result<RawRequest, ServeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ServeError::invalid("body", format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ServeError::invalid(
            "body",
            "the body must be a JSON object",
        ));
    }
    if v.get("model").is_none() {
        return Err(ServeError::invalid(
            "model",
            "missing required parameter 'model'",
        ));
    }
    let mut req = serde_path_to_error(v)?;
    req.ordered = serde_json::from_slice(body).ok();
    Ok(req)
}

fn serde_path_to_error(v: Value) -> Result<RawRequest, ServeError> {
    RawRequest::deserialize(&v).map_err(|e| {
        let msg = e.to_string();
        let param = [
            "model",
            "messages",
            "temperature",
            "top_p",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "seed",
            "n",
            "top_logprobs",
            "tools",
            "stream",
        ]
        .into_iter()
        .find(|p| {
            v.get(*p).is_some_and(|x| {
                // The field whose type is wrong is the one that fails to parse alone.
                let mut probe = Map::new();
                probe.insert("model".into(), json!("m"));
                probe.insert((*p).into(), x.clone());
                RawRequest::deserialize(&Value::Object(probe)).is_err()
            })
        })
        .unwrap_or("body");
        ServeError::invalid(param, format!("invalid request: {msg}"))
    })
}

impl RawRequest {
    /// Validates the sampling knobs. `chat` selects the meaning of `logprobs`.
    pub fn knobs(&self, chat: bool) -> Result<Knobs, ServeError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ServeError::invalid(
                "temperature",
                "temperature must be between 0 and 2",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ServeError::invalid("top_p", "top_p must be in (0, 1]"));
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if max_tokens == Some(0) {
            return Err(ServeError::invalid(
                "max_tokens",
                "max_tokens must be at least 1",
            ));
        }
        let stop = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ServeError::invalid("stop", "at most 4 stop sequences"));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 || n as usize > MAX_N {
            return Err(ServeError::invalid(
                "n",
                format!("n must be between 1 and {MAX_N}"),
            ));
        }
        let (logprobs, top_logprobs) = if chat {
            let lp = match &self.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ServeError::invalid(
                        "logprobs",
                        "logprobs must be a boolean",
                    ))
                }
            };
            let top = self.top_logprobs.unwrap_or(0) as usize;
            if top > 0 && !lp {
                return Err(ServeError::invalid(
                    "top_logprobs",
                    "top_logprobs requires logprobs to be true",
                ));
            }
            (lp, top)
        } else {
            match &self.logprobs {
                None | Some(Value::Null) => (false, 0),
                Some(Value::Number(k)) => (true, k.as_u64().unwrap_or(u64::MAX) as usize),
                Some(_) => {
                    return Err(ServeError::invalid(
                        "logprobs",
                        "logprobs must be an integer",
                    ))
                }
            }
        };
        if top_logprobs > MAX_TOP_LOGPROBS {
            return Err(ServeError::invalid(
                if chat { "top_logprobs" } else { "logprobs" },
                format!("at most {MAX_TOP_LOGPROBS} alternatives per token"),
            ));
        }
        if self.echo == Some(true) {
            return Err(ServeError::invalid("echo", "echo is not supported"));
        }
        let prompt_logprobs = match self.prompt_logprobs {
            None => None,
            Some(k) if k as usize > MAX_TOP_LOGPROBS => {
                return Err(ServeError::invalid(
                    "prompt_logprobs",
                    format!("at most {MAX_TOP_LOGPROBS} alternatives per token"),
                ))
            }
            Some(_) if self.stream == Some(true) => {
                return Err(ServeError::invalid(
                    "prompt_logprobs",
                    "prompt_logprobs is not supported with stream",
                ))
            }
            Some(k) => Some(k as usize),
        };
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Knobs {
            temperature,
            top_p,
            max_tokens: max_tokens.map(|m| m.min(u32::MAX as u64) as usize),
            stop,
            seed: self.seed.map(|s| s as u64),
            n: n as usize,
            logprobs,
            top_logprobs,
            stream: self.stream.unwrap_or(false),
            include_usage,
            prompt_logprobs,
        })
    }
}

/// How tool calls are handled for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// No tools in play.
    None,
    /// The model may call a tool; calls are parsed from `<tool_call>` blocks.
    Auto,
    /// The output is forced to be one tool call (grammar).
    Forced,
}

/// The rendered request: prompt text, grammar and tool mode.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    /// Prompt text for the tokenizer.
    pub text: String,
    /// Grammar for the output.
    pub grammar: Option<Node>,
    /// Tool handling.
    pub tools: ToolMode,
}

fn tool_name(t: &Value) -> Option<&str> {
    t.get("function")?.get("name")?.as_str()
}

/// Validates `tools` and `tool_choice` and returns the tool mode and its grammar.
fn tool_setup(req: &RawRequest) -> Result<(ToolMode, Option<Node>, Vec<Value>), ServeError> {
    let tools = req.tools.clone().unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") || tool_name(t).is_none() {
            return Err(ServeError::invalid(
                &format!("tools[{i}]"),
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    }
    let choice = req.tool_choice.clone().unwrap_or(Value::Null);
    let forced: Option<Vec<&Value>> = match &choice {
        Value::Null => None,
        Value::String(s) if s == "auto" => None,
        Value::String(s) if s == "none" => return Ok((ToolMode::None, None, vec![])),
        Value::String(s) if s == "required" => Some(tools.iter().collect()),
        Value::Object(_) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ServeError::invalid("tool_choice", "tool_choice.function.name is required")
                })?;
            let t = tools
                .iter()
                .find(|t| tool_name(t) == Some(name))
                .ok_or_else(|| {
                    ServeError::invalid("tool_choice", format!("no tool named {name:?} in tools"))
                })?;
            Some(vec![t])
        }
        _ => return Err(ServeError::invalid("tool_choice", "invalid tool_choice")),
    };
    if tools.is_empty() {
        if forced.is_some() {
            return Err(ServeError::invalid(
                "tool_choice",
                "tool_choice requires tools",
            ));
        }
        return Ok((ToolMode::None, None, vec![]));
    }
    let Some(forced) = forced else {
        return Ok((ToolMode::Auto, None, tools));
    };
    // One forced call: {"name": <enum>, "arguments": <that tool's parameters>}, with the
    // parameters' properties in the order the client wrote them.
    let names: Vec<OJson> = forced
        .iter()
        .filter_map(|t| tool_name(t))
        .map(|n| OJson::Str(n.to_string()))
        .collect();
    let any_object = OJson::Obj(vec![("type".into(), OJson::Str("object".into()))]);
    let args = if forced.len() == 1 {
        let name = tool_name(forced[0]).unwrap_or_default();
        let ordered_tool = req
            .ordered
            .as_ref()
            .and_then(|o| match o.get("tools") {
                Some(OJson::Arr(ts)) => ts
                    .iter()
                    .find(|t| {
                        t.get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(OJson::as_str)
                            == Some(name)
                    })
                    .cloned(),
                _ => None,
            })
            .unwrap_or_else(|| OJson::from(forced[0]));
        ordered_tool
            .get("function")
            .and_then(|f| f.get("parameters"))
            .cloned()
            .unwrap_or(any_object.clone())
    } else {
        any_object
    };
    let schema = OJson::Obj(vec![
        ("type".into(), OJson::Str("object".into())),
        (
            "properties".into(),
            OJson::Obj(vec![
                (
                    "name".into(),
                    OJson::Obj(vec![("enum".into(), OJson::Arr(names))]),
                ),
                ("arguments".into(), args),
            ]),
        ),
    ]);
    let node = grammar::compile_schema(&schema)
        .map_err(|e| ServeError::invalid("tools", format!("tool parameters: {e}")))?;
    Ok((
        ToolMode::Forced,
        Some(grammar::wrapped("<tool_call>\n", node, "\n</tool_call>")),
        tools,
    ))
}

/// The grammar asked for by `response_format`, if any.
pub fn response_format_grammar(req: &RawRequest) -> Result<Option<Node>, ServeError> {
    let Some(rf) = &req.response_format else {
        return Ok(None);
    };
    let ordered = req
        .ordered
        .as_ref()
        .and_then(|o| o.get("response_format"))
        .cloned()
        .unwrap_or_else(|| OJson::from(rf));
    Ok(grammar::response_format_grammar(&ordered)?)
}

/// Renders a chat request into a prompt.
pub fn chat_prompt(
    req: &RawRequest,
    template: &hindsight_model::ChatTemplate,
) -> Result<ChatPrompt, ServeError> {
    let messages = match &req.messages {
        Some(Value::Array(m)) if !m.is_empty() => m,
        _ => {
            return Err(ServeError::invalid(
                "messages",
                "messages must be a non-empty array",
            ))
        }
    };
    let (mode, tool_grammar, tools) = tool_setup(req)?;
    let continuing = req.continue_final_message == Some(true);
    match (continuing, req.add_generation_prompt) {
        (true, Some(true)) => {
            return Err(ServeError::invalid(
                "add_generation_prompt",
                "add_generation_prompt must be false with continue_final_message",
            ))
        }
        (false, Some(false)) => {
            return Err(ServeError::invalid(
                "add_generation_prompt",
                "add_generation_prompt: false is supported only with continue_final_message",
            ))
        }
        _ => {}
    }
    // The same renderer the learner uses for logged requests (hindsight_model::ChatTemplate::
    // render_chat), so what is trained on is the prompt that was served.
    let rendered = if continuing {
        template.render_chat_continuing(messages, &tools)
    } else {
        template.render_chat(messages, &tools)
    };
    let text = rendered.map_err(|e| match e {
        hindsight_model::ChatInputError::Invalid { field, reason } => {
            ServeError::invalid(&field, reason)
        }
        hindsight_model::ChatInputError::Template(e) => e.into(),
    })?;
    let grammar = match tool_grammar {
        Some(g) => Some(g),
        None => response_format_grammar(req)?,
    };
    Ok(ChatPrompt {
        text,
        grammar,
        tools: mode,
    })
}

/// A completions prompt: a string or a one-element array of strings.
pub fn completion_prompt(req: &RawRequest) -> Result<String, ServeError> {
    match &req.prompt {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            _ => Err(ServeError::invalid(
                "prompt",
                "prompt must be a non-empty string",
            )),
        },
        Some(Value::Array(_)) => Err(ServeError::invalid(
            "prompt",
            "batched prompts are not supported; send one prompt per request",
        )),
        _ => Err(ServeError::invalid(
            "prompt",
            "prompt must be a non-empty string",
        )),
    }
}

/// Tool calls found in generated text, and the text left outside them.
pub fn parse_tool_calls(text: &str) -> (Option<String>, Vec<Value>) {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut s = text;
    while let Some(start) = s.find("<tool_call>") {
        rest.push_str(&s[..start]);
        let after = &s[start + "<tool_call>".len()..];
        let (body, next) = match after.find("</tool_call>") {
            Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
            None => (after, ""),
        };
        match serde_json::from_str::<Value>(body.trim()) {
            Ok(v) if v.get("name").and_then(Value::as_str).is_some() => {
                let args = v.get("arguments").cloned().unwrap_or(json!({}));
                let args = match args {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                calls.push(json!({
                    "id": format!("call_{}", uuid::Uuid::now_v7().simple()),
                    "type": "function",
                    "function": {"name": v["name"], "arguments": args},
                }));
            }
            // Not a valid call: keep the text as content.
            _ => rest.push_str(&s[start..s.len() - next.len()]),
        }
        s = next;
    }
    rest.push_str(s);
    let rest = rest.trim().to_string();
    (if rest.is_empty() { None } else { Some(rest) }, calls)
}

/// vLLM's `prompt_logprobs`: `null` for the first token (nothing precedes it), then per token
/// an object keyed by token id with `{logprob, rank, decoded_token}` for the prompt's token
/// and its `k` best alternatives.
pub fn prompt_logprobs_body(
    scored: &[crate::engine::PromptToken],
    token_text: &dyn Fn(u32) -> String,
) -> Value {
    let mut out = Vec::with_capacity(scored.len() + 1);
    out.push(Value::Null);
    for t in scored {
        let mut entry = Map::new();
        for (rank, (id, lp)) in t.top.iter().enumerate() {
            entry.insert(
                id.to_string(),
                json!({"logprob": lp, "rank": rank + 1, "decoded_token": token_text(*id)}),
            );
        }
        entry.insert(
            t.id.to_string(),
            json!({"logprob": t.logprob, "rank": t.rank, "decoded_token": token_text(t.id)}),
        );
        out.push(Value::Object(entry));
    }
    Value::Array(out)
}

/// What one choice produced.
#[derive(Debug, Clone, Default)]
pub struct ChoiceOutput {
    /// Visible text.
    pub text: String,
    /// Sampled tokens with behaviour log-probs.
    pub picks: Vec<Pick>,
    /// Why it ended.
    pub finish: Option<FinishReason>,
}

/// One `logprobs.content[]` entry (chat), with `token_id` added.
pub fn chat_logprob_entry(p: &Pick, token_text: &dyn Fn(u32) -> String, top: bool) -> Value {
    let tok = token_text(p.id);
    let top_list: Vec<Value> = if top {
        p.top
            .iter()
            .map(|(id, lp)| {
                let t = token_text(*id);
                json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "token_id": id})
            })
            .collect()
    } else {
        vec![]
    };
    json!({"token": tok, "logprob": p.logprob, "bytes": tok.as_bytes(), "token_id": p.id, "top_logprobs": top_list})
}

/// The `finish_reason` string for a choice.
pub fn finish_str(c: &ChoiceOutput, tool_calls: bool) -> &'static str {
    if tool_calls {
        return "tool_calls";
    }
    c.finish.unwrap_or(FinishReason::Error).as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_parsed_and_invalid_ones_stay_text() {
        let (content, calls) = parse_tool_calls(
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        let (content, calls) = parse_tool_calls("<tool_call>not json</tool_call> hi");
        assert!(calls.is_empty());
        assert_eq!(
            content.as_deref(),
            Some("<tool_call>not json</tool_call> hi")
        );
    }

    #[test]
    fn knobs_reject_out_of_range_values() {
        let req = |v: Value| parse_body(v.to_string().as_bytes()).unwrap();
        let bad = [
            json!({"model": "m", "temperature": 3.0}),
            json!({"model": "m", "top_p": 0.0}),
            json!({"model": "m", "n": 0}),
            json!({"model": "m", "top_logprobs": 2}),
            json!({"model": "m", "max_tokens": 0}),
            json!({"model": "m", "stop": ["a", "b", "c", "d", "e"]}),
        ];
        for b in bad {
            let e = req(b.clone()).knobs(true).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{b}");
        }
        let e = parse_body(br#"{"model": "m", "temperature": "hot"}"#).unwrap_err();
        assert!(
            matches!(e, ServeError::InvalidRequest { param: Some(ref p), .. } if p == "temperature"),
            "{e:?}"
        );
        assert!(parse_body(b"{").is_err());
        assert!(parse_body(b"{}").is_err());
    }
}
