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

mod automaton;

pub use automaton::JsonState;

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
mod tests;
