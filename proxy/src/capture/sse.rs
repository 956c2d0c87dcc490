//! Incremental Server-Sent Events parsing and reassembly of streamed OpenAI responses into the
//! shape a non-streamed call returns, so the interaction log holds one format whatever the client
//! asked for.
//!
//! The parser follows the WHATWG event-stream rules that matter for OpenAI-compatible servers:
//! lines end in `\n`, `\r\n` or `\r`; `data:` fields of one event are joined with `\n`; a blank line
//! dispatches the event; lines starting with `:` are comments. It works on bytes and only decodes
//! complete lines, so a chunk boundary may fall anywhere, even inside a UTF-8 character.

use serde_json::{Map, Value};

/// Parses an event stream fed in arbitrary chunks and yields the `data` payload of each event.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    /// The previous chunk ended in `\r`; a `\n` starting the next chunk belongs to it.
    pending_cr: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; calls `on_event` with the data of every event completed by them.
    pub fn feed(&mut self, mut bytes: &[u8], mut on_event: impl FnMut(&[u8])) {
        if self.pending_cr {
            self.pending_cr = false;
            if bytes.first() == Some(&b'\n') {
                bytes = &bytes[1..];
            }
        }
        while let Some(pos) = bytes.iter().position(|b| *b == b'\n' || *b == b'\r') {
            self.line.extend_from_slice(&bytes[..pos]);
            let cr = bytes[pos] == b'\r';
            bytes = &bytes[pos + 1..];
            if cr {
                if bytes.first() == Some(&b'\n') {
                    bytes = &bytes[1..];
                } else if bytes.is_empty() {
                    self.pending_cr = true;
                }
            }
            self.end_line(&mut on_event);
        }
        self.line.extend_from_slice(bytes);
    }

    /// Ends the stream: an event still open (no blank line after it) is dispatched, as servers
    /// that close right after the last `data:` line expect.
    pub fn finish(&mut self, mut on_event: impl FnMut(&[u8])) {
        if !self.line.is_empty() {
            self.end_line(&mut on_event);
        }
        if self.has_data {
            self.dispatch(&mut on_event);
        }
    }

    fn end_line(&mut self, on_event: &mut impl FnMut(&[u8])) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            self.dispatch(on_event);
        } else if line.first() != Some(&b':') {
            let (field, value) = match line.iter().position(|b| *b == b':') {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (&line[..], &[][..]),
            };
            if field == b"data" {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
        }
        // Reuse the allocation for the next line.
        self.line = line;
        self.line.clear();
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(&[u8])) {
        if self.has_data {
            on_event(&self.data);
        }
        self.data.clear();
        self.has_data = false;
    }
}

/// Which OpenAI response shape a stream carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// `chat.completion.chunk` events, reassembled into a `chat.completion`.
    Chat,
    /// `text_completion` events, reassembled into one `text_completion`.
    Completion,
}

#[derive(Debug, Default)]
struct ToolCallAcc {
    id: Option<Value>,
    kind: Option<Value>,
    name: String,
    arguments: String,
}

#[derive(Debug, Default)]
struct ChoiceAcc {
    role: Option<Value>,
    content: String,
    saw_content: bool,
    reasoning: String,
    refusal: Option<String>,
    tool_calls: Vec<(u64, ToolCallAcc)>,
    finish_reason: Value,
    logprobs_content: Vec<Value>,
    /// Legacy completions log-probs: parallel arrays joined field by field.
    legacy_logprobs: Map<String, Value>,
    saw_logprobs: bool,
}

/// Folds the events of one streamed response into the equivalent non-streamed response body.
#[derive(Debug)]
pub struct StreamReassembler {
    kind: StreamKind,
    head: Map<String, Value>,
    choices: Vec<(u64, ChoiceAcc)>,
    usage: Option<Value>,
    error: Option<Value>,
    done: bool,
    events: u64,
    bad_events: u64,
}

impl StreamReassembler {
    pub fn new(kind: StreamKind) -> Self {
        Self {
            kind,
            head: Map::new(),
            choices: Vec::new(),
            usage: None,
            error: None,
            done: false,
            events: 0,
            bad_events: 0,
        }
    }

    /// True once the `[DONE]` sentinel was seen.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Events that were not JSON objects (counted, never fatal).
    pub fn bad_events(&self) -> u64 {
        self.bad_events
    }

    /// Folds one event's data payload.
    pub fn push_event(&mut self, data: &[u8]) {
        self.events += 1;
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
            self.bad_events += 1;
            return;
        };
        if let Some(err) = chunk.remove("error") {
            self.error = Some(err);
            return;
        }
        for key in [
            "id",
            "created",
            "model",
            "system_fingerprint",
            "service_tier",
        ] {
            if let Some(v) = chunk.get(key) {
                if !v.is_null() {
                    self.head.insert(key.to_string(), v.clone());
                }
            }
        }
        if let Some(u) = chunk.get("usage") {
            if !u.is_null() {
                self.usage = Some(u.clone());
            }
        }
        let Some(Value::Array(choices)) = chunk.remove("choices") else {
            return;
        };
        for choice in choices {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let kind = self.kind;
            let acc = self.choice_mut(index);
            match kind {
                StreamKind::Chat => fold_chat_choice(acc, &choice),
                StreamKind::Completion => fold_completion_choice(acc, &choice),
            }
        }
    }

    fn choice_mut(&mut self, index: u64) -> &mut ChoiceAcc {
        let pos = match self.choices.iter().position(|(i, _)| *i == index) {
            Some(p) => p,
            None => {
                self.choices.push((index, ChoiceAcc::default()));
                self.choices.len() - 1
            }
        };
        &mut self.choices[pos].1
    }

    /// The reassembled body. An error event becomes `{"error": …}` as a non-streamed call
    /// would have answered.
    pub fn finish(mut self) -> Value {
        if let Some(err) = self.error.take() {
            let mut m = Map::new();
            m.insert("error".into(), err);
            return Value::Object(m);
        }
        let mut out = Map::new();
        if let Some(id) = self.head.remove("id") {
            out.insert("id".into(), id);
        }
        out.insert(
            "object".into(),
            Value::from(match self.kind {
                StreamKind::Chat => "chat.completion",
                StreamKind::Completion => "text_completion",
            }),
        );
        for (k, v) in std::mem::take(&mut self.head) {
            out.insert(k, v);
        }
        self.choices.sort_by_key(|(i, _)| *i);
        let kind = self.kind;
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, acc)| match kind {
                StreamKind::Chat => chat_choice(index, acc),
                StreamKind::Completion => completion_choice(index, acc),
            })
            .collect();
        out.insert("choices".into(), Value::Array(choices));
        if let Some(u) = self.usage {
            out.insert("usage".into(), u);
        }
        Value::Object(out)
    }
}

fn str_of(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str)
}

fn fold_chat_choice(acc: &mut ChoiceAcc, choice: &Value) {
    if let Some(delta) = choice.get("delta") {
        if let Some(role) = delta.get("role") {
            if !role.is_null() && acc.role.is_none() {
                acc.role = Some(role.clone());
            }
        }
        if let Some(c) = str_of(delta.get("content")) {
            acc.content.push_str(c);
            acc.saw_content = true;
        }
        for key in ["reasoning_content", "reasoning"] {
            if let Some(c) = str_of(delta.get(key)) {
                acc.reasoning.push_str(c);
            }
        }
        if let Some(r) = str_of(delta.get("refusal")) {
            acc.refusal.get_or_insert_with(String::new).push_str(r);
        }
        if let Some(Value::Array(calls)) = delta.get("tool_calls") {
            for call in calls {
                let idx = call.get("index").and_then(Value::as_u64).unwrap_or(0);
                let pos = match acc.tool_calls.iter().position(|(i, _)| *i == idx) {
                    Some(p) => p,
                    None => {
                        acc.tool_calls.push((idx, ToolCallAcc::default()));
                        acc.tool_calls.len() - 1
                    }
                };
                let tc = &mut acc.tool_calls[pos].1;
                if let Some(id) = call.get("id") {
                    if !id.is_null() {
                        tc.id = Some(id.clone());
                    }
                }
                if let Some(t) = call.get("type") {
                    if !t.is_null() {
                        tc.kind = Some(t.clone());
                    }
                }
                if let Some(f) = call.get("function") {
                    if let Some(n) = str_of(f.get("name")) {
                        tc.name.push_str(n);
                    }
                    if let Some(a) = str_of(f.get("arguments")) {
                        tc.arguments.push_str(a);
                    }
                }
            }
        }
    }
    fold_finish_and_logprobs(acc, choice);
}

fn fold_completion_choice(acc: &mut ChoiceAcc, choice: &Value) {
    if let Some(t) = str_of(choice.get("text")) {
        acc.content.push_str(t);
        acc.saw_content = true;
    }
    fold_finish_and_logprobs(acc, choice);
}

fn fold_finish_and_logprobs(acc: &mut ChoiceAcc, choice: &Value) {
    if let Some(fr) = choice.get("finish_reason") {
        if !fr.is_null() {
            acc.finish_reason = fr.clone();
        }
    }
    if let Some(Value::Object(lp)) = choice.get("logprobs") {
        acc.saw_logprobs = true;
        if let Some(Value::Array(content)) = lp.get("content") {
            acc.logprobs_content.extend(content.iter().cloned());
        }
        // Legacy completions shape: parallel arrays (tokens, token_logprobs, …).
        for (k, v) in lp {
            if k == "content" || k == "refusal" {
                continue;
            }
            if let Value::Array(items) = v {
                match acc.legacy_logprobs.get_mut(k) {
                    Some(Value::Array(existing)) => existing.extend(items.iter().cloned()),
                    _ => {
                        acc.legacy_logprobs.insert(k.clone(), v.clone());
                    }
                }
            }
        }
    }
}

fn chat_choice(index: u64, acc: ChoiceAcc) -> Value {
    let mut message = Map::new();
    message.insert(
        "role".into(),
        acc.role.unwrap_or_else(|| Value::from("assistant")),
    );
    let has_tools = !acc.tool_calls.is_empty();
    message.insert(
        "content".into(),
        if acc.saw_content || !has_tools {
            Value::from(acc.content)
        } else {
            Value::Null
        },
    );
    if !acc.reasoning.is_empty() {
        message.insert("reasoning_content".into(), Value::from(acc.reasoning));
    }
    if let Some(r) = acc.refusal {
        message.insert("refusal".into(), Value::from(r));
    }
    if has_tools {
        let mut calls = acc.tool_calls;
        calls.sort_by_key(|(i, _)| *i);
        let calls: Vec<Value> = calls
            .into_iter()
            .map(|(_, tc)| {
                serde_json::json!({
                    "id": tc.id.unwrap_or(Value::Null),
                    "type": tc.kind.unwrap_or_else(|| Value::from("function")),
                    "function": {"name": tc.name, "arguments": tc.arguments},
                })
            })
            .collect();
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    let mut choice = Map::new();
    choice.insert("index".into(), Value::from(index));
    choice.insert("message".into(), Value::Object(message));
    choice.insert(
        "logprobs".into(),
        if acc.saw_logprobs {
            serde_json::json!({"content": acc.logprobs_content})
        } else {
            Value::Null
        },
    );
    choice.insert("finish_reason".into(), acc.finish_reason);
    Value::Object(choice)
}

fn completion_choice(index: u64, acc: ChoiceAcc) -> Value {
    let logprobs = if acc.saw_logprobs {
        Value::Object(acc.legacy_logprobs)
    } else {
        Value::Null
    };
    serde_json::json!({
        "index": index,
        "text": acc.content,
        "logprobs": logprobs,
        "finish_reason": acc.finish_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn parse_all(chunks: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, |d| out.push(String::from_utf8_lossy(d).into_owned()));
        }
        p.finish(|d| out.push(String::from_utf8_lossy(d).into_owned()));
        out
    }

    #[test]
    fn parses_fields_comments_and_line_endings() {
        let s = b": keep-alive\n\ndata: a\ndata:b\r\n\r\nevent: x\nid: 3\ndata: {\"k\":1}\r\rdata: tail";
        assert_eq!(parse_all(&[s]), vec!["a\nb", "{\"k\":1}", "tail"]);
    }

    #[test]
    fn cr_lf_split_across_chunks_is_one_line_end() {
        assert_eq!(
            parse_all(&[b"data: a\r", b"\n\r", b"\ndata: b\n\n"]),
            vec!["a", "b"]
        );
    }

    fn chat_stream() -> Vec<Value> {
        vec![
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":{"content":[{"token":"Hel","logprob":-0.1}]},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"lo"},"logprobs":{"content":[{"token":"lo","logprob":-0.2}]},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"lookup_order","arguments":""}}]},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"order_id\":"}}]},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"A1\"}"}}]},"finish_reason":null}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
            json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}),
        ]
    }

    #[test]
    fn reassembles_chat_with_tool_calls_logprobs_and_usage() {
        let mut r = StreamReassembler::new(StreamKind::Chat);
        for c in chat_stream() {
            r.push_event(c.to_string().as_bytes());
        }
        r.push_event(b"[DONE]");
        assert!(r.is_done());
        let v = r.finish();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], "c1");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["role"], "assistant");
        assert_eq!(m["content"], "Hello");
        assert_eq!(m["tool_calls"][0]["id"], "call_1");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "lookup_order");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            "{\"order_id\":\"A1\"}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["choices"][0]["logprobs"]["content"][1]["token"], "lo");
        assert_eq!(v["usage"]["total_tokens"], 8);
    }

    #[test]
    fn reassembles_legacy_completions() {
        let mut r = StreamReassembler::new(StreamKind::Completion);
        r.push_event(br#"{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"Par","logprobs":{"tokens":["Par"],"token_logprobs":[-0.5]},"finish_reason":null}]}"#);
        r.push_event(br#"{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"is","logprobs":{"tokens":["is"],"token_logprobs":[-0.25]},"finish_reason":"stop"}]}"#);
        let v = r.finish();
        assert_eq!(v["choices"][0]["text"], "Paris");
        assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["Par", "is"]));
        assert_eq!(
            v["choices"][0]["logprobs"]["token_logprobs"],
            json!([-0.5, -0.25])
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn error_event_becomes_error_body_and_garbage_is_counted() {
        let mut r = StreamReassembler::new(StreamKind::Chat);
        r.push_event(b"not json");
        assert_eq!(r.bad_events(), 1);
        r.push_event(br#"{"error":{"message":"boom","type":"server_error"}}"#);
        assert_eq!(r.finish()["error"]["message"], "boom");
    }

    fn sse_bytes(events: &[String]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in events {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(e.as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    proptest! {
        // Any split of the byte stream yields the same events as parsing it whole.
        #[test]
        fn chunking_never_changes_events(
            payloads in proptest::collection::vec("[ -~é日]{0,12}", 0..12),
            cuts in proptest::collection::vec(0usize..400, 0..20),
            crlf in any::<bool>(),
        ) {
            let mut bytes = Vec::new();
            for p in &payloads {
                let nl: &[u8] = if crlf { b"\r\n" } else { b"\n" };
                bytes.extend_from_slice(b"data: ");
                bytes.extend_from_slice(p.as_bytes());
                bytes.extend_from_slice(nl);
                bytes.extend_from_slice(nl);
            }
            let whole = parse_all(&[&bytes]);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut last = 0;
            for c in cuts { chunks.push(&bytes[last..c]); last = c; }
            chunks.push(&bytes[last..]);
            prop_assert_eq!(&parse_all(&chunks), &whole);
            prop_assert_eq!(whole, payloads);
        }

        // Content and tool-call argument deltas, however they are split, join back exactly.
        #[test]
        fn reassembly_joins_deltas(
            content in proptest::collection::vec("[a-zA-Z0-9 {}\":,\\\\é]{0,8}", 1..10),
            args in proptest::collection::vec("[a-z0-9{}\":,]{0,6}", 0..8),
            cut in 1usize..50,
        ) {
            let mut events = Vec::new();
            for c in &content {
                events.push(json!({"id":"s","choices":[{"index":0,"delta":{"content":c}}]}).to_string());
            }
            if !args.is_empty() {
                events.push(json!({"id":"s","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t","type":"function","function":{"name":"f","arguments":""}}]}}]}).to_string());
                for a in &args {
                    events.push(json!({"id":"s","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":a}}]}}]}).to_string());
                }
            }
            events.push(json!({"id":"s","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}).to_string());
            let bytes = sse_bytes(&events);
            let mut p = SseParser::new();
            let mut r = StreamReassembler::new(StreamKind::Chat);
            for chunk in bytes.chunks(cut) {
                p.feed(chunk, |d| r.push_event(d));
            }
            p.finish(|d| r.push_event(d));
            prop_assert!(r.is_done());
            let v = r.finish();
            prop_assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), content.concat());
            if !args.is_empty() {
                prop_assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap(), args.concat());
            }
            prop_assert_eq!(&v["choices"][0]["finish_reason"], "stop");
        }
    }
}
