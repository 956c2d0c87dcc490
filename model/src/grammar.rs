//! Guided JSON decoding: a JSON-schema subset compiled into a character-level pushdown automaton
//! that says, for the text generated so far, which continuations can still become a valid
//! document.
//!
//! The layout is fixed (`{"a": 1, "b": [1, 2]}`, the `json.dumps` style the model has seen most),
//! so the model chooses values, never whitespace. Object properties come in schema order and are
//! all emitted; enums and constants are literal alternatives; strings and numbers are small
//! automata with length caps, so a document always closes within a bounded number of characters.
//!
//! `hindsight serve` decodes guided answers with it; the learner decodes the hindsight teacher's
//! own answer with it, in the very layout the serve produces (see
//! `DistillTarget::Teacher` in the learner).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use tokenizers::Tokenizer;

/// JSON that keeps the order of object keys as written (schemas list properties in the order
/// the output should have them; `serde_json::Value` sorts keys).
#[derive(Debug, Clone, PartialEq)]
pub enum OJson {
    /// `null`.
    Null,
    /// A boolean.
    Bool(bool),
    /// A number.
    Num(serde_json::Number),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<OJson>),
    /// An object, keys in document order.
    Obj(Vec<(String, OJson)>),
}

impl OJson {
    /// A member of an object.
    pub fn get(&self, key: &str) -> Option<&OJson> {
        match self {
            OJson::Obj(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            OJson::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The number as u64, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            OJson::Num(n) => n.as_u64(),
            _ => None,
        }
    }
    /// Converts to a `serde_json::Value` (key order is lost).
    pub fn to_value(&self) -> Value {
        match self {
            OJson::Null => Value::Null,
            OJson::Bool(b) => Value::Bool(*b),
            OJson::Num(n) => Value::Number(n.clone()),
            OJson::Str(s) => Value::String(s.clone()),
            OJson::Arr(a) => Value::Array(a.iter().map(OJson::to_value).collect()),
            OJson::Obj(m) => {
                Value::Object(m.iter().map(|(k, v)| (k.clone(), v.to_value())).collect())
            }
        }
    }
    /// Compact JSON text, keys in document order.
    pub fn to_json(&self) -> String {
        match self {
            OJson::Arr(a) => format!(
                "[{}]",
                a.iter().map(OJson::to_json).collect::<Vec<_>>().join(", ")
            ),
            OJson::Obj(m) => format!(
                "{{{}}}",
                m.iter()
                    .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), v.to_json()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            other => other.to_value().to_string(),
        }
    }
}

impl From<&Value> for OJson {
    fn from(v: &Value) -> Self {
        match v {
            Value::Null => OJson::Null,
            Value::Bool(b) => OJson::Bool(*b),
            Value::Number(n) => OJson::Num(n.clone()),
            Value::String(s) => OJson::Str(s.clone()),
            Value::Array(a) => OJson::Arr(a.iter().map(OJson::from).collect()),
            Value::Object(m) => {
                OJson::Obj(m.iter().map(|(k, v)| (k.clone(), OJson::from(v))).collect())
            }
        }
    }
}

impl<'de> Deserialize<'de> for OJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OJson;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<OJson, E> {
                Ok(OJson::Null)
            }
            fn visit_none<E>(self) -> Result<OJson, E> {
                Ok(OJson::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<OJson, E> {
                Ok(OJson::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<OJson, E> {
                Ok(OJson::Num(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<OJson, E> {
                Ok(OJson::Num(n.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<OJson, E> {
                serde_json::Number::from_f64(n)
                    .map(OJson::Num)
                    .ok_or_else(|| E::custom("non-finite number"))
            }
            fn visit_str<E>(self, s: &str) -> Result<OJson, E> {
                Ok(OJson::Str(s.to_string()))
            }
            fn visit_string<E>(self, s: String) -> Result<OJson, E> {
                Ok(OJson::Str(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OJson, A::Error> {
                let mut v = Vec::new();
                while let Some(x) = seq.next_element()? {
                    v.push(x);
                }
                Ok(OJson::Arr(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OJson, A::Error> {
                let mut v = Vec::new();
                while let Some((k, x)) = map.next_entry::<String, OJson>()? {
                    v.push((k, x));
                }
                Ok(OJson::Obj(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// Longest string value (characters) unless the schema's `maxLength` says otherwise.
const DEFAULT_MAX_STRING_CHARS: usize = 200;
/// Longest number literal (characters).
const MAX_NUMBER_CHARS: usize = 20;
/// Longest integer literal (characters): 15 digits and a sign stay exact in i64 and f64.
const MAX_INTEGER_CHARS: usize = 16;
/// Nesting allowed for free-form JSON (`json_object`, `{}` schemas).
const ANY_DEPTH: usize = 4;
/// Longest free-form object/array (members).
const ANY_MAX_MEMBERS: usize = 16;

/// A compiled schema node.
#[derive(Debug, Clone)]
pub enum Node {
    /// A fixed sequence of literal text and values (objects compile to this).
    Seq(Arc<Vec<SeqItem>>),
    /// One of several literal JSON texts (enums, const, booleans, null).
    Choice(Arc<Vec<Vec<char>>>),
    /// A JSON string of at most this many characters.
    Str(usize),
    /// A JSON number; `true` = integer only.
    Num(bool),
    /// A JSON array of `item`, with `min..=max` elements.
    Arr(Arc<Node>, usize, usize),
    /// Any JSON value, at most this deep.
    Any(usize),
    /// Any JSON object, at most this deep.
    AnyObject(usize),
}

/// An element of a [`Node::Seq`].
#[derive(Debug, Clone)]
pub enum SeqItem {
    /// Text that must appear verbatim.
    Lit(Arc<[char]>),
    /// A value.
    Value(Node),
}

fn lit(s: &str) -> SeqItem {
    SeqItem::Lit(s.chars().collect::<Vec<_>>().into())
}

/// Compiles a JSON schema (the supported subset; see the crate README) into a [`Node`].
pub fn compile_schema(schema: &OJson) -> Result<Node, SchemaError> {
    compile(schema, 0)
}

/// A schema outside the supported subset, or malformed (the serve turns it into a 400 naming
/// `response_format`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SchemaError(pub String);

fn bad(msg: impl Into<String>) -> SchemaError {
    SchemaError(msg.into())
}

fn compile(schema: &OJson, depth: usize) -> Result<Node, SchemaError> {
    if depth > 16 {
        return Err(bad("schema nests deeper than 16 levels"));
    }
    let obj = match schema {
        OJson::Bool(true) => return Ok(Node::Any(ANY_DEPTH)),
        OJson::Obj(_) => schema,
        _ => return Err(bad("a schema must be a JSON object")),
    };
    if let Some(values) = obj.get("enum") {
        let values = match values {
            OJson::Arr(a) if !a.is_empty() => a,
            _ => return Err(bad("enum must be a non-empty array")),
        };
        return Ok(Node::Choice(Arc::new(
            values
                .iter()
                .map(|v| v.to_json().chars().collect())
                .collect(),
        )));
    }
    if let Some(c) = obj.get("const") {
        return Ok(Node::Choice(Arc::new(vec![c.to_json().chars().collect()])));
    }
    if let Some(alts) = obj.get("anyOf").or_else(|| obj.get("oneOf")) {
        // Only the common `T | null` shape and unions of literals are supported.
        let OJson::Arr(alts) = alts else {
            return Err(bad("anyOf must be an array"));
        };
        let nodes = alts
            .iter()
            .map(|a| compile(a, depth + 1))
            .collect::<Result<Vec<_>, _>>()?;
        if nodes.len() == 1 {
            return nodes.into_iter().next().ok_or_else(|| bad("empty anyOf"));
        }
        let mut lits = Vec::new();
        for n in &nodes {
            match n {
                Node::Choice(c) => lits.extend(c.iter().cloned()),
                _ => return Err(bad("anyOf is supported only over enums/consts/null")),
            }
        }
        return Ok(Node::Choice(Arc::new(lits)));
    }
    let ty = match obj.get("type") {
        None => {
            if obj.get("properties").is_some() {
                "object"
            } else {
                return Ok(Node::Any(ANY_DEPTH));
            }
        }
        Some(OJson::Str(s)) => s.as_str(),
        Some(OJson::Arr(a)) => {
            // ["string", "null"] and the like: take the first non-null type.
            a.iter()
                .filter_map(OJson::as_str)
                .find(|t| *t != "null")
                .unwrap_or("null")
        }
        Some(_) => return Err(bad("type must be a string or an array of strings")),
    };
    let usize_field = |k: &str| obj.get(k).and_then(OJson::as_u64).map(|v| v as usize);
    Ok(match ty {
        "object" => match obj.get("properties") {
            Some(OJson::Obj(props)) if !props.is_empty() => {
                let mut items = Vec::with_capacity(props.len() * 2 + 1);
                for (i, (name, sub)) in props.iter().enumerate() {
                    let key = Value::String(name.clone()).to_string();
                    let sep = if i == 0 { "{" } else { ", " };
                    items.push(lit(&format!("{sep}{key}: ")));
                    items.push(SeqItem::Value(compile(sub, depth + 1)?));
                }
                items.push(lit("}"));
                Node::Seq(Arc::new(items))
            }
            _ => Node::AnyObject(ANY_DEPTH),
        },
        "array" => {
            let item = match obj.get("items") {
                Some(s) => compile(s, depth + 1)?,
                None => Node::Any(ANY_DEPTH),
            };
            let min = usize_field("minItems").unwrap_or(0);
            let max = usize_field("maxItems").unwrap_or(usize::MAX).max(min);
            Node::Arr(Arc::new(item), min, max)
        }
        "string" => Node::Str(usize_field("maxLength").unwrap_or(DEFAULT_MAX_STRING_CHARS)),
        "integer" => Node::Num(true),
        "number" => Node::Num(false),
        "boolean" => Node::Choice(Arc::new(vec![
            "true".chars().collect(),
            "false".chars().collect(),
        ])),
        "null" => Node::Choice(Arc::new(vec!["null".chars().collect()])),
        other => return Err(bad(format!("unsupported type {other:?}"))),
    })
}

/// A node followed by literal text (used for `<tool_call>` wrappers).
pub fn wrapped(prefix: &str, node: Node, suffix: &str) -> Node {
    Node::Seq(Arc::new(vec![
        lit(prefix),
        SeqItem::Value(node),
        lit(suffix),
    ]))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum StrPhase {
    Open,
    In,
    Esc,
    Uni(u8),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ContPhase {
    /// Expect the opening bracket.
    Open,
    /// After the opening bracket: a member or the close.
    First,
    /// A member value is being parsed (child frame on top).
    Member,
    /// After a member: `,` or the close.
    After,
    /// After `,`: expect the space.
    Space,
    /// After the space: a member.
    Next,
    /// Free-form object: key parsed, expect `: ` then the value.
    Colon,
    /// Free-form object: `: ` consumed, value next.
    Value,
}

#[derive(Debug, Clone)]
enum Frame {
    Lit(Arc<[char]>, usize),
    Choice(Arc<Vec<Vec<char>>>, String),
    Str {
        phase: StrPhase,
        len: usize,
        max: usize,
    },
    Num(String, bool),
    Seq(Arc<Vec<SeqItem>>, usize),
    Arr {
        item: Arc<Node>,
        count: usize,
        min: usize,
        max: usize,
        phase: ContPhase,
    },
    AnyVal(usize),
    AnyObj {
        depth: usize,
        count: usize,
        phase: ContPhase,
    },
}

enum Step {
    /// Consumed; the frame needs more.
    More,
    /// Consumed and the frame is finished.
    Done,
    /// Not consumed: the frame was already complete; pop it and offer the char to the parent.
    NotMine,
    /// Push this child and offer it the char.
    Push(Frame),
    /// Replace this frame by another and offer it the char.
    Become(Frame),
    Reject,
}

fn frame_for(node: &Node) -> Frame {
    match node {
        Node::Seq(items) => Frame::Seq(items.clone(), 0),
        Node::Choice(c) => Frame::Choice(c.clone(), String::new()),
        Node::Str(max) => Frame::Str {
            phase: StrPhase::Open,
            len: 0,
            max: *max,
        },
        Node::Num(int) => Frame::Num(String::new(), *int),
        Node::Arr(item, min, max) => Frame::Arr {
            item: item.clone(),
            count: 0,
            min: *min,
            max: *max,
            phase: ContPhase::Open,
        },
        Node::Any(d) => Frame::AnyVal(*d),
        Node::AnyObject(d) => Frame::AnyObj {
            depth: *d,
            count: 0,
            phase: ContPhase::Open,
        },
    }
}

/// Whether `s` is a prefix of a JSON number (`int` = integers only) and whether it is complete.
fn number_state(s: &str, int: bool) -> Option<bool> {
    let b = s.as_bytes();
    let mut i = 0;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    if i == b.len() {
        return Some(false);
    }
    if b[i] == b'0' {
        i += 1;
    } else if b[i].is_ascii_digit() {
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
    } else {
        return None;
    }
    if i == b.len() {
        return Some(true);
    }
    if int {
        return None;
    }
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == b.len() {
            return Some(i > start);
        }
        if i == start {
            return None;
        }
    }
    if b[i] == b'e' || b[i] == b'E' {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        // Two exponent digits at most: every accepted number fits an f64.
        if i == b.len() && i - start <= 2 {
            return Some(i > start);
        }
    }
    None
}

impl Frame {
    fn step(&mut self, c: char) -> Step {
        match self {
            Frame::Lit(chars, pos) => {
                if chars.get(*pos) == Some(&c) {
                    *pos += 1;
                    if *pos == chars.len() {
                        Step::Done
                    } else {
                        Step::More
                    }
                } else {
                    Step::Reject
                }
            }
            Frame::Choice(options, typed) => {
                let complete = options.iter().any(|o| o.iter().copied().eq(typed.chars()));
                typed.push(c);
                let n = typed.chars().count();
                let alive: Vec<&Vec<char>> = options
                    .iter()
                    .filter(|o| o.len() >= n && o[..n].iter().copied().eq(typed.chars()))
                    .collect();
                if alive.is_empty() {
                    typed.pop();
                    return if complete {
                        Step::NotMine
                    } else {
                        Step::Reject
                    };
                }
                if alive.len() == 1 && alive[0].len() == n {
                    Step::Done
                } else {
                    Step::More
                }
            }
            Frame::Str { phase, len, max } => match *phase {
                StrPhase::Open => {
                    if c == '"' {
                        *phase = StrPhase::In;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                StrPhase::In => match c {
                    '"' => Step::Done,
                    _ if *len >= *max => Step::Reject,
                    '\\' => {
                        *phase = StrPhase::Esc;
                        Step::More
                    }
                    c if (c as u32) < 0x20 => Step::Reject,
                    _ => {
                        *len += 1;
                        Step::More
                    }
                },
                StrPhase::Esc => match c {
                    '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't' => {
                        *len += 1;
                        *phase = StrPhase::In;
                        Step::More
                    }
                    'u' => {
                        *phase = StrPhase::Uni(0);
                        Step::More
                    }
                    _ => Step::Reject,
                },
                StrPhase::Uni(k) => {
                    if !c.is_ascii_hexdigit() {
                        return Step::Reject;
                    }
                    if k == 3 {
                        *len += 1;
                        *phase = StrPhase::In;
                    } else {
                        *phase = StrPhase::Uni(k + 1);
                    }
                    Step::More
                }
            },
            Frame::Num(text, int) => {
                let complete = number_state(text, *int) == Some(true);
                let cap = if *int {
                    MAX_INTEGER_CHARS
                } else {
                    MAX_NUMBER_CHARS
                };
                if text.len() < cap {
                    text.push(c);
                    if number_state(text, *int).is_some() {
                        return Step::More;
                    }
                    text.pop();
                }
                if complete {
                    Step::NotMine
                } else {
                    Step::Reject
                }
            }
            Frame::Seq(items, idx) => match items.get(*idx) {
                Some(SeqItem::Lit(l)) => Step::Push(Frame::Lit(l.clone(), 0)),
                Some(SeqItem::Value(n)) => Step::Push(frame_for(n)),
                None => Step::Reject,
            },
            Frame::Arr {
                item,
                count,
                min,
                max,
                phase,
            } => match *phase {
                ContPhase::Open => {
                    if c == '[' {
                        *phase = ContPhase::First;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::First | ContPhase::After if c == ']' => {
                    if *count >= *min {
                        Step::Done
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::First | ContPhase::Next => {
                    if *count >= *max {
                        return Step::Reject;
                    }
                    *phase = ContPhase::Member;
                    Step::Push(frame_for(item))
                }
                ContPhase::After => {
                    if c == ',' && *count < *max {
                        *phase = ContPhase::Space;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::Space => {
                    if c == ' ' {
                        *phase = ContPhase::Next;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                _ => Step::Reject,
            },
            Frame::AnyVal(depth) => match c {
                '{' if *depth > 0 => Step::Become(Frame::AnyObj {
                    depth: *depth,
                    count: 0,
                    phase: ContPhase::Open,
                }),
                '[' if *depth > 0 => Step::Become(Frame::Arr {
                    item: Arc::new(Node::Any(*depth - 1)),
                    count: 0,
                    min: 0,
                    max: ANY_MAX_MEMBERS,
                    phase: ContPhase::Open,
                }),
                '"' => Step::Become(frame_for(&Node::Str(DEFAULT_MAX_STRING_CHARS))),
                '-' | '0'..='9' => Step::Become(Frame::Num(String::new(), false)),
                't' | 'f' | 'n' => Step::Become(Frame::Choice(
                    Arc::new(vec![
                        "true".chars().collect(),
                        "false".chars().collect(),
                        "null".chars().collect(),
                    ]),
                    String::new(),
                )),
                _ => Step::Reject,
            },
            Frame::AnyObj {
                depth,
                count,
                phase,
            } => match *phase {
                ContPhase::Open => {
                    if c == '{' {
                        *phase = ContPhase::First;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::First | ContPhase::After if c == '}' => Step::Done,
                ContPhase::First | ContPhase::Next => {
                    if *count >= ANY_MAX_MEMBERS {
                        return Step::Reject;
                    }
                    *phase = ContPhase::Colon;
                    Step::Push(frame_for(&Node::Str(64)))
                }
                ContPhase::Colon => {
                    *phase = ContPhase::Value;
                    Step::Push(Frame::Lit(": ".chars().collect::<Vec<_>>().into(), 0))
                }
                ContPhase::Value => {
                    *phase = ContPhase::Member;
                    Step::Push(Frame::AnyVal(depth.saturating_sub(1)))
                }
                ContPhase::After => {
                    if c == ',' {
                        *phase = ContPhase::Space;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::Space => {
                    if c == ' ' {
                        *phase = ContPhase::Next;
                        Step::More
                    } else {
                        Step::Reject
                    }
                }
                ContPhase::Member => Step::Reject,
            },
        }
    }

    /// A child finished; returns whether this frame is finished too.
    fn child_done(&mut self) -> bool {
        match self {
            Frame::Seq(items, idx) => {
                *idx += 1;
                *idx >= items.len()
            }
            Frame::Arr { count, phase, .. } => {
                *count += 1;
                *phase = ContPhase::After;
                false
            }
            Frame::AnyObj { count, phase, .. } => {
                // After the key (phase already Colon) or the `: ` literal (already Value)
                // nothing changes; after a member value the object may close or continue.
                if *phase == ContPhase::Member {
                    *count += 1;
                    *phase = ContPhase::After;
                }
                false
            }
            _ => false,
        }
    }

    /// Whether the frame could end here (lazy frames: numbers, prefix-ambiguous choices).
    fn complete(&self) -> bool {
        match self {
            Frame::Num(t, int) => number_state(t, *int) == Some(true),
            Frame::Choice(options, typed) => {
                options.iter().any(|o| o.iter().copied().eq(typed.chars()))
            }
            _ => false,
        }
    }
}

/// The parse state of a partially generated document.
#[derive(Debug, Clone)]
pub struct JsonState {
    stack: Vec<Frame>,
}

impl JsonState {
    /// The start state for a compiled schema.
    pub fn new(node: &Node) -> Self {
        Self {
            stack: vec![frame_for(node)],
        }
    }

    /// Feeds one character; false when it cannot continue a valid document (state then undefined:
    /// feed clones).
    pub fn feed(&mut self, c: char) -> bool {
        loop {
            let Some(top) = self.stack.last_mut() else {
                return false;
            };
            match top.step(c) {
                Step::More => return true,
                Step::Done => {
                    self.pop_done();
                    return true;
                }
                Step::NotMine => {
                    self.pop_done();
                }
                Step::Push(f) => self.stack.push(f),
                Step::Become(f) => *top = f,
                Step::Reject => return false,
            }
        }
    }

    /// Pops the finished top frame and cascades completion to its parents.
    fn pop_done(&mut self) {
        self.stack.pop();
        while let Some(parent) = self.stack.last_mut() {
            if parent.child_done() {
                self.stack.pop();
            } else {
                break;
            }
        }
    }

    /// Feeds a whole string.
    pub fn feed_str(&mut self, s: &str) -> bool {
        s.chars().all(|c| self.feed(c))
    }

    /// Whether the document is complete (nothing more may follow).
    pub fn finished(&self) -> bool {
        self.stack.is_empty() || (self.stack.len() == 1 && self.stack[0].complete())
    }
}

/// The grammar asked for by an OpenAI `response_format` (key order as written), if any.
pub fn response_format_grammar(rf: &OJson) -> Result<Option<Node>, SchemaError> {
    match rf.get("type").and_then(OJson::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(compile_schema(&OJson::Obj(vec![(
            "type".into(),
            OJson::Str("object".into()),
        )]))?)),
        Some("json_schema") => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| bad("json_schema.schema is required"))?;
            Ok(Some(compile_schema(schema)?))
        }
        _ => Err(bad("type must be text, json_object or json_schema")),
    }
}

/// `response_format` with its schema's top-level `properties` put in the order their keys
/// appear in `answer` (a document the serve produced under that schema). Logged requests pass
/// through `serde_json::Value`, which sorts object keys; the served answer still carries the
/// order the schema was written in, and the grammar emits properties in schema order.
pub fn with_answer_key_order(rf: &OJson, answer: &OJson) -> OJson {
    let OJson::Obj(order) = answer else {
        return rf.clone();
    };
    let rank = |k: &str| order.iter().position(|(a, _)| a == k).unwrap_or(usize::MAX);
    let mut rf = rf.clone();
    if let OJson::Obj(top) = &mut rf {
        for (k, js) in top.iter_mut() {
            let OJson::Obj(js) = js else { continue };
            if k != "json_schema" {
                continue;
            }
            for (k, schema) in js.iter_mut() {
                let OJson::Obj(schema) = schema else { continue };
                if k != "schema" {
                    continue;
                }
                for (k, props) in schema.iter_mut() {
                    if let (true, OJson::Obj(props)) = (k == "properties", props) {
                        props.sort_by_key(|(name, _)| rank(name));
                    }
                }
            }
        }
    }
    rf
}

/// Decoded text of every token that can appear inside a guided document (special tokens and
/// tokens that decode to partial UTF-8 are `None`).
pub fn grammar_vocab(tokenizer: &Tokenizer, vocab_size: usize) -> Vec<Option<String>> {
    let special: std::collections::HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| *id)
        .collect();
    (0..vocab_size as u32)
        .map(|id| {
            if special.contains(&id) {
                return None;
            }
            match tokenizer.decode(&[id], false) {
                Ok(s) if !s.is_empty() && !s.contains('\u{FFFD}') => Some(s),
                _ => None,
            }
        })
        .collect()
}

/// The highest-scoring token that `allowed` admits (greedy guided decoding): the best 256 are
/// checked in order first, the rest of the row only when none of them is allowed. `None` when
/// no token is allowed at all.
pub fn best_allowed(logits: &[f32], allowed: &dyn Fn(u32) -> bool) -> Option<u32> {
    const FIRST_CUT: usize = 256;
    let by_score = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = idx.len().min(FIRST_CUT);
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_score);
    }
    idx[..k].sort_unstable_by(by_score);
    idx[..k].iter().copied().find(|&i| allowed(i)).or_else(|| {
        idx[k..]
            .iter()
            .copied()
            .filter(|&i| allowed(i))
            .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]))
    })
}

/// The log-probability of `chosen` renormalised over the tokens `allowed` admits: the
/// probability of the decision among the choices the grammar leaves (0 where it leaves only
/// one), where a full-vocabulary log-probability also counts the mass on tokens the grammar
/// forbids. Tokens more than 30 nats below `chosen` are not checked: each weighs less than
/// e^-30 against it, all 49k of the default vocabulary together < 5e-9 relative.
pub fn choice_logprob(logits: &[f32], chosen: u32, allowed: &dyn Fn(u32) -> bool) -> f64 {
    const WINDOW_NATS: f64 = 30.0;
    let Some(&own) = logits.get(chosen as usize) else {
        return f64::NEG_INFINITY;
    };
    let own = f64::from(own);
    let sum: f64 = logits
        .iter()
        .enumerate()
        .filter(|(i, &l)| {
            *i as u32 == chosen || (f64::from(l) >= own - WINDOW_NATS && allowed(*i as u32))
        })
        .map(|(_, &l)| (f64::from(l) - own).exp())
        .sum();
    -sum.ln()
}

/// Whether token `id` may follow in `state`: every character of its text must continue a valid
/// document. The first character's successor state is memoised (most candidates share a few
/// first characters).
pub fn allowed_by_grammar<'a>(
    state: &JsonState,
    vocab: &'a [Option<String>],
) -> impl Fn(u32) -> bool + 'a {
    let state = state.clone();
    let first: std::cell::RefCell<std::collections::HashMap<char, Option<JsonState>>> =
        Default::default();
    move |id| {
        let Some(Some(text)) = vocab.get(id as usize) else {
            return false;
        };
        let mut chars = text.chars();
        let Some(c) = chars.next() else {
            return false;
        };
        let after_first = first
            .borrow_mut()
            .entry(c)
            .or_insert_with(|| {
                let mut s = state.clone();
                s.feed(c).then_some(s)
            })
            .clone();
        match after_first {
            Some(mut s) => chars.all(|c| s.feed(c)),
            None => false,
        }
    }
}

/// The members of a JSON object document, in document order: each key and the byte range of
/// its value in `doc` (quotes included for strings). `None` when `doc` is not one JSON object
/// (surrounding whitespace allowed). Lets the trainer tell which tokens of an answer belong to
/// which decision and splice new values into an answer keeping its layout.
pub fn object_value_spans(doc: &str) -> Option<Vec<(String, std::ops::Range<usize>)>> {
    // Validated first, so the scan below only has to find boundaries in well-formed JSON.
    if !serde_json::from_str::<Value>(doc).ok()?.is_object() {
        return None;
    }
    let b = doc.as_bytes();
    let ws = |mut i: usize| {
        while b.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    // `b[i]` is an opening quote; the index after the closing one.
    let string_end = |i: usize| {
        let mut j = i + 1;
        while j < b.len() {
            match b[j] {
                b'\\' => j += 2,
                b'"' => return Some(j + 1),
                _ => j += 1,
            }
        }
        None
    };
    let value_end = |i: usize| match b.get(i)? {
        b'"' => string_end(i),
        b'{' | b'[' => {
            let (mut j, mut depth) = (i, 0usize);
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while b
                .get(j)
                .is_some_and(|c| !matches!(c, b',' | b'}' | b']') && !c.is_ascii_whitespace())
            {
                j += 1;
            }
            Some(j)
        }
    };
    let mut i = ws(0) + 1; // past '{'
    let mut out = Vec::new();
    loop {
        i = ws(i);
        if b.get(i)? == &b'}' {
            break;
        }
        let key_end = string_end(i)?;
        let key: String = serde_json::from_str(&doc[i..key_end]).ok()?;
        i = ws(ws(key_end) + 1); // past ':'
        let end = value_end(i)?;
        out.push((key, i..end));
        i = ws(end);
        match b.get(i)? {
            b',' => i += 1,
            _ => break, // '}'
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Re-parses the text of `v` keeping key order (json! sorts keys).
    fn ordered(v: &Value) -> OJson {
        serde_json::from_str(&v.to_string()).unwrap()
    }

    #[test]
    fn properties_follow_the_order_written_in_the_schema() {
        let schema: OJson = serde_json::from_str(
            r#"{"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}}}"#,
        )
        .unwrap();
        let mut s = JsonState::new(&compile_schema(&schema).unwrap());
        assert!(s.feed_str(r#"{"zeta": 3, "alpha": true}"#) && s.finished());
        let mut s = JsonState::new(&compile_schema(&schema).unwrap());
        assert!(!s.feed_str(r#"{"alpha""#));
    }

    fn accepts(schema: &Value, text: &str) -> (bool, bool) {
        let node = compile_schema(&ordered(schema)).unwrap();
        let mut s = JsonState::new(&node);
        let ok = s.feed_str(text);
        (ok, ok && s.finished())
    }

    #[test]
    fn object_with_enum_string_number_array() {
        let schema: OJson = serde_json::from_str(
            r#"{"type": "object", "properties": {
            "color": {"enum": ["red", "green"]},
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "score": {"type": "number"},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}
        }}"#,
        )
        .unwrap();
        let run = |text: &str| {
            let mut s = JsonState::new(&compile_schema(&schema).unwrap());
            let ok = s.feed_str(text);
            (ok, ok && s.finished())
        };
        let good = r#"{"color": "green", "name": "a\"b", "age": -12, "score": 1.5e3, "ok": false, "tags": ["x", "y"]}"#;
        assert_eq!(run(good), (true, true));
        serde_json::from_str::<Value>(good).unwrap();
        assert!(!run(r#"{"color": "blue""#).0);
        assert!(!run(r#"{"color": "red", "name": "x", "age": 1.5"#).0);
        assert!(!run(r#"{"name""#).0, "properties come in schema order");
        let three =
            r#"{"color": "red", "name": "", "age": 0, "score": 0, "ok": true, "tags": ["a", "b", "#;
        assert!(!run(three).0, "maxItems");
        // A prefix is accepted but not finished.
        assert_eq!(run(r#"{"color": "re"#), (true, false));
    }

    #[test]
    fn free_form_object_and_numbers_end_lazily() {
        let schema = json!({"type": "object"});
        let text = r#"{"a": [1, {"b": null}], "c": "d", "e": 10}"#;
        assert_eq!(accepts(&schema, text), (true, true));
        assert!(!accepts(&schema, "[").0);
        assert!(!accepts(&schema, r#"{"a": 01"#).0);
        assert!(
            !accepts(&schema, r#"{"a": 1e999"#).0,
            "exponents stay within f64"
        );
        assert_eq!(accepts(&json!({"type": "integer"}), "12"), (true, true));
    }

    #[test]
    fn strings_reject_raw_control_characters_and_respect_max_length() {
        let s = json!({"type": "string", "maxLength": 3});
        assert!(!accepts(&s, "\"a\nb").0);
        assert_eq!(accepts(&s, "\"abc\""), (true, true));
        assert!(!accepts(&s, "\"abcd").0);
    }

    #[test]
    fn unsupported_schemas_are_errors_that_name_the_problem() {
        let e = compile_schema(&ordered(&json!({"type": "tuple"}))).unwrap_err();
        assert!(e.0.contains("tuple"), "{e}");
    }

    #[test]
    fn response_formats_compile_and_take_the_answers_key_order() {
        let rf = ordered(
            &json!({"type": "json_schema", "json_schema": {"name": "d", "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}}}),
        );
        // serde_json sorted the keys; the served answer had them as the schema was written.
        let answer: OJson = serde_json::from_str(r#"{"b": true, "a": 1}"#).unwrap();
        let node = response_format_grammar(&with_answer_key_order(&rf, &answer))
            .unwrap()
            .unwrap();
        let mut st = JsonState::new(&node);
        assert!(st.feed_str(r#"{"b": true, "a": 1}"#) && st.finished());
        let node = response_format_grammar(&rf).unwrap().unwrap();
        assert!(!JsonState::new(&node).feed_str(r#"{"b""#));
        assert!(response_format_grammar(&ordered(&json!({"type": "text"})))
            .unwrap()
            .is_none());
        let e = response_format_grammar(&ordered(&json!({"type": "xml"}))).unwrap_err();
        assert!(e.0.contains("json_schema"), "{e}");
    }

    #[test]
    fn choice_logprob_renormalises_over_the_allowed_tokens() {
        let logits = [2.0f32, 1.0, 0.0, 5.0, -100.0];
        let allowed = |i: u32| i != 3;
        let want = 2.0 - (2f64.exp() + 1f64.exp() + 1.0).ln();
        assert!((choice_logprob(&logits, 0, &allowed) - want).abs() < 1e-9);
        // The full-vocabulary log-probability is far lower: token 3 dominates it.
        let full = 2.0 - logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        assert!(full < want - 2.5, "{full} vs {want}");
        // A forced token (the only one allowed) is a certain decision.
        assert_eq!(choice_logprob(&logits, 1, &|i| i == 1), 0.0);
        // A non-greedy choice counts the allowed tokens above it too.
        let want = 1.0 - (2f64.exp() + 1f64.exp()).ln();
        assert!((choice_logprob(&logits, 1, &|i| i <= 1) - want).abs() < 1e-9);
        assert_eq!(choice_logprob(&logits, 9, &allowed), f64::NEG_INFINITY);
    }

    #[test]
    fn object_value_spans_find_each_members_value() {
        let doc = " {\"a\": \"x,}\\\"y\" , \"b\":{\"c\":[1,\"]\"]},\"d\":-1.5e3,\"e\":null}\n";
        let spans = object_value_spans(doc).unwrap();
        let got: Vec<(&str, &str)> = spans
            .iter()
            .map(|(k, r)| (k.as_str(), &doc[r.clone()]))
            .collect();
        assert_eq!(
            got,
            [
                ("a", "\"x,}\\\"y\""),
                ("b", "{\"c\":[1,\"]\"]}"),
                ("d", "-1.5e3"),
                ("e", "null")
            ]
        );
        assert_eq!(object_value_spans("{}"), Some(vec![]));
        for not_an_object in ["[1]", "\"a\"", "{\"a\": 1", "{\"a\": 1} x", ""] {
            assert_eq!(object_value_spans(not_an_object), None, "{not_an_object}");
        }
    }

    mod spans_prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any object, compact or pretty: every span parses back to its member's value.
            #[test]
            fn object_value_spans_round_trip(
                members in proptest::collection::btree_map(
                    "[a-z\"\\\\ ,:{}]{0,6}",
                    prop_oneof![
                        any::<i64>().prop_map(Value::from),
                        "[a-z\"\\\\ ,:{}\\[\\]]{0,8}".prop_map(Value::from),
                        any::<bool>().prop_map(Value::from),
                        proptest::collection::vec(proptest::prelude::any::<i32>(), 0..3)
                            .prop_map(|v| json!({"n": v})),
                    ],
                    0..5,
                ),
                pretty in any::<bool>(),
            ) {
                let obj = Value::Object(members.clone().into_iter().collect());
                let doc = if pretty {
                    serde_json::to_string_pretty(&obj).unwrap()
                } else {
                    obj.to_string()
                };
                let spans = object_value_spans(&doc).unwrap();
                prop_assert_eq!(spans.len(), members.len());
                for (key, range) in spans {
                    let v: Value = serde_json::from_str(&doc[range]).unwrap();
                    prop_assert_eq!(Some(&v), members.get(&key));
                }
            }
        }
    }
}
