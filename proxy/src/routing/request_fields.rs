//! The fields of a request body that the proxy's layers read, found in one pass.
//!
//! Routing needs `model` (and the byte span of its value, to rewrite it in place), the
//! conversation's root when no episode header is given, and capture needs whether the client
//! asked for `logprobs`. Each used to parse the body on its own, `messages` into a `Vec<Value>`
//! of the whole conversation; here one borrowed pass over the body finds the three values as
//! raw JSON, and only the messages up to the first user message are looked into, when the root
//! is asked for. Every answer is the one the separate parses gave (duplicate keys included:
//! a duplicate `model` is not routed, a duplicate `messages` has no root, a duplicate
//! `logprobs` asks for none), which the property tests below check against those parses.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The three fields: `model` and `logprobs` as raw JSON borrowed from the body, `messages` as
/// `M` (the conversation's root, or skipped when it is not wanted).
#[derive(Deserialize)]
struct Fields<'a, M> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    // No `default` (it would ask `M: Default`): a missing `Option` field is `None` anyway.
    messages: Option<M>,
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
}

/// One field alone; the slow path when the body repeats one of the keys (serde refuses a
/// struct with a duplicate field, so the other fields are read each on their own, as before).
#[derive(Deserialize)]
struct Model<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Messages {
    #[serde(default)]
    messages: Option<ConversationRoot>,
}

#[derive(Deserialize)]
struct Logprobs<'a> {
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
}

/// What the proxy reads from a JSON object request body.
#[derive(Debug)]
pub(crate) struct RequestFields<'a> {
    text: &'a str,
    model: Option<&'a RawValue>,
    logprobs: Option<&'a RawValue>,
    root: Option<String>,
}

impl<'a> RequestFields<'a> {
    /// The fields of `body`, or `None` when it is not a JSON object. The conversation's root
    /// is computed only `with_root` (routing needs it when no episode header names one).
    pub(crate) fn parse(body: &'a [u8], with_root: bool) -> Option<Self> {
        let text = std::str::from_utf8(body).ok()?;
        if !text.trim_start().starts_with('{') {
            return None;
        }
        let fast = if with_root {
            serde_json::from_str::<Fields<'_, ConversationRoot>>(text)
                .map(|f| (f.model, f.logprobs, f.messages.and_then(|r| r.0)))
        } else {
            serde_json::from_str::<Fields<'_, IgnoredAny>>(text)
                .map(|f| (f.model, f.logprobs, None))
        };
        if let Ok((model, logprobs, root)) = fast {
            return Some(Self {
                text,
                model,
                logprobs,
                root,
            });
        }
        // Not JSON, or a repeated key: read each field on its own.
        serde_json::from_str::<IgnoredAny>(text).ok()?;
        Some(Self {
            text,
            model: serde_json::from_str::<Model<'_>>(text)
                .ok()
                .and_then(|m| m.model),
            logprobs: serde_json::from_str::<Logprobs<'_>>(text)
                .ok()
                .and_then(|l| l.logprobs),
            root: if with_root {
                serde_json::from_str::<Messages>(text)
                    .ok()
                    .and_then(|m| m.messages)
                    .and_then(|r| r.0)
            } else {
                None
            },
        })
    }

    /// The top-level `model` string and the byte span of its JSON value in the body, or `None`
    /// when there is no string `model` (or it is repeated).
    pub(crate) fn model(&self) -> Option<(Cow<'a, str>, Range<usize>)> {
        let raw = self.model?;
        let model = json_str(raw)?;
        let start = (raw.get().as_ptr() as usize).checked_sub(self.text.as_ptr() as usize)?;
        Some((model, start..start + raw.get().len()))
    }

    /// Whether the client asked for log-probs itself (`logprobs` true, a positive number, or
    /// any other non-null value).
    pub(crate) fn wants_logprobs(&self) -> bool {
        let Some(raw) = self.logprobs else {
            return false;
        };
        match raw.get() {
            "true" => true,
            "false" | "null" => false,
            other => match serde_json::from_str::<Value>(other) {
                Ok(Value::Bool(b)) => b,
                Ok(Value::Null) | Err(_) => false,
                Ok(Value::Number(n)) => {
                    n.as_u64() != Some(0) || n.as_f64().is_some_and(|f| f > 0.0)
                }
                Ok(_) => true,
            },
        }
    }

    /// `conv:<hex>`: a hash of the messages up to and including the first user message, which
    /// every later turn of the same conversation repeats verbatim; `None` when there is no
    /// user message, or when `parse` was not asked for it.
    pub(crate) fn conversation_root(&self) -> Option<&str> {
        self.root.as_deref()
    }
}

/// The root of a `messages` value, hashed while it is parsed: each message up to and
/// including the first user one contributes its role and its content as compact JSON (so the
/// id does not depend on how the client spaced or escaped them, and matches the ids proxies
/// computed before); the rest is only checked to be JSON. `None` when `messages` is not an
/// array or has no user message.
struct ConversationRoot(Option<String>);

impl<'de> Deserialize<'de> for ConversationRoot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RootVisitor)
    }
}

struct RootVisitor;

impl<'de> Visitor<'de> for RootVisitor {
    type Value = ConversationRoot;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut h = Sha256::new();
        loop {
            let Some(m) = seq.next_element::<Message<'de>>()? else {
                return Ok(ConversationRoot(None));
            };
            h.update(m.role.as_deref().unwrap_or("").as_bytes());
            h.update([0u8]);
            h.update(m.content.map_or(Cow::Borrowed(""), compact).as_bytes());
            h.update([1u8]);
            if m.role.as_deref() == Some("user") {
                break;
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        let d = h.finalize();
        Ok(ConversationRoot(Some(format!(
            "conv:{}",
            hex::encode(&d[..12])
        ))))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(ConversationRoot(None))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(ConversationRoot(None))
    }
}

/// A message's two hashed fields: its role when that is a string, its content as raw JSON
/// (`content: null` is kept: it hashes as `null`, unlike a missing content). Anything but an
/// object is a message with neither; a repeated key counts with its last value, as in a
/// `Value`.
struct Message<'a> {
    role: Option<Cow<'a, str>>,
    content: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Message<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MessageVisitor)
    }
}

struct MessageVisitor;

impl MessageVisitor {
    fn neither<'a>() -> Message<'a> {
        Message {
            role: None,
            content: None,
        }
    }
}

impl<'de> Visitor<'de> for MessageVisitor {
    type Value = Message<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut m = Self::neither();
        while let Some(key) = map.next_key::<MessageKey>()? {
            match key {
                MessageKey::Role => m.role = json_str(map.next_value::<&'de RawValue>()?),
                MessageKey::Content => m.content = Some(map.next_value::<&'de RawValue>()?),
                MessageKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(m)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Self::neither())
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Self::neither())
    }
}

/// A message's key, compared after JSON unescaping, without allocating.
enum MessageKey {
    Role,
    Content,
    Other,
}

impl<'de> Deserialize<'de> for MessageKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = MessageKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, k: &str) -> Result<MessageKey, E> {
                Ok(match k {
                    "role" => MessageKey::Role,
                    "content" => MessageKey::Content,
                    _ => MessageKey::Other,
                })
            }
        }
        d.deserialize_identifier(KeyVisitor)
    }
}

/// The string a raw JSON value holds, `None` when it is not a string.
fn json_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    let s = raw.get();
    if !s.starts_with('"') {
        return None;
    }
    if !s.contains('\\') {
        return s.get(1..s.len() - 1).map(Cow::Borrowed);
    }
    serde_json::from_str::<String>(s).ok().map(Cow::Owned)
}

/// `raw` as serde_json writes it compactly. A string without escapes is already in that form
/// (raw control characters are not valid JSON, and nothing else is escaped on output).
fn compact(raw: &RawValue) -> Cow<'_, str> {
    let s = raw.get();
    if s.starts_with('"') && !s.contains('\\') {
        return Cow::Borrowed(s);
    }
    Cow::Owned(
        serde_json::from_str::<Value>(s)
            .map(|v| v.to_string())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The parses the proxy did before, one per field: the reference the one-pass parse must
    /// agree with.
    mod reference {
        use super::*;

        pub fn peek_model(body: &[u8]) -> Option<(String, Range<usize>)> {
            let text = std::str::from_utf8(body).ok()?;
            let peek: Model<'_> = serde_json::from_str(text).ok()?;
            let raw = peek.model?;
            let model: String = serde_json::from_str(raw.get()).ok()?;
            let start = (raw.get().as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
            Some((model, start..start + raw.get().len()))
        }

        pub fn conversation_root(body: &[u8]) -> Option<String> {
            #[derive(Deserialize)]
            struct Messages {
                #[serde(default)]
                messages: Option<Vec<Value>>,
            }
            let messages = serde_json::from_slice::<Messages>(body).ok()?.messages?;
            let end = messages
                .iter()
                .position(|m| m.get("role").and_then(Value::as_str) == Some("user"))?;
            let mut h = Sha256::new();
            for m in &messages[..=end] {
                h.update(
                    m.get("role")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .as_bytes(),
                );
                h.update([0u8]);
                h.update(
                    m.get("content")
                        .map(Value::to_string)
                        .unwrap_or_default()
                        .as_bytes(),
                );
                h.update([1u8]);
            }
            let d = h.finalize();
            Some(format!("conv:{}", hex::encode(&d[..12])))
        }
    }

    fn fields(body: &str) -> RequestFields<'_> {
        RequestFields::parse(body.as_bytes(), true).unwrap()
    }

    fn root(body: &str) -> Option<String> {
        fields(body).conversation_root().map(str::to_string)
    }

    #[test]
    fn finds_model_and_its_span() {
        let body = r#"{"messages":[{"role":"user","content":"model"}], "model" : "support","n":1}"#;
        let (model, span) = fields(body).model().unwrap();
        assert_eq!(model, "support");
        assert_eq!(&body[span], r#""support""#);
        let escaped = r#"{"model":"sup\u0070ort"}"#;
        assert_eq!(fields(escaped).model().unwrap().0, "support");
    }

    #[test]
    fn only_json_objects_with_one_string_model_have_a_model() {
        assert!(RequestFields::parse(b"not json", true).is_none());
        assert!(RequestFields::parse(br#"["support"]"#, true).is_none());
        assert!(RequestFields::parse(br#"{"model":"a"} x"#, true).is_none());
        for b in [
            r#"{"model": 3}"#,
            r#"{"messages": []}"#,
            r#"{"model":"a","model":"b"}"#,
            r#"{"model":null}"#,
        ] {
            assert!(fields(b).model().is_none(), "{b}");
        }
        // A repeated key elsewhere leaves `model` readable.
        let f = fields(r#"{"model":"a","messages":[],"messages":[]}"#);
        assert_eq!(f.model().unwrap().0, "a");
        assert_eq!(f.conversation_root(), None);
        assert_eq!(
            root(r#"{"messages":[{"role":"user"}],"model":"a","model":"b"}"#),
            root(r#"{"messages":[{"role":"user"}]}"#)
        );
    }

    #[test]
    fn logprobs_as_the_capture_layer_reads_them() {
        for (body, wants) in [
            (r#"{"model":"m","logprobs":true}"#, true),
            (r#"{"prompt":"x","logprobs":2}"#, true),
            (r#"{"prompt":"x","logprobs":0}"#, false),
            (r#"{"prompt":"x","logprobs":0.5}"#, true),
            (r#"{"prompt":"x","logprobs":{}}"#, true),
            (r#"{"model":"m","logprobs":false}"#, false),
            (r#"{"model":"m","logprobs":null}"#, false),
            (r#"{"model":"m","messages":[{"logprobs":true}]}"#, false),
            (r#"{"logprobs":true,"logprobs":true}"#, false),
        ] {
            assert_eq!(fields(body).wants_logprobs(), wants, "{body}");
            assert_eq!(
                crate::capture::client_wants_logprobs(body.as_bytes()),
                wants,
                "{body}"
            );
        }
    }

    #[test]
    fn every_turn_of_a_conversation_shares_its_root() {
        let t1 = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#;
        let t2 = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"},
            {"role":"assistant","content":"x"},{"role":"user","content":"more"}]}"#;
        let other =
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"bye"}]}"#;
        let spaced = r#"{"messages":[ {"content": "s", "role":"system"},
            {"role":"us\u0065r","content":"h\u0069"}]}"#;
        assert_eq!(root(t1), root(t2));
        assert_eq!(root(t1), root(spaced));
        assert_ne!(root(t1), root(other));
        assert_eq!(root(r#"{"prompt":"x"}"#), None);
        for b in [t1, t2, other, spaced] {
            assert_eq!(root(b), reference::conversation_root(b.as_bytes()));
        }
    }

    #[test]
    fn odd_messages_hash_as_before() {
        for b in [
            r#"{"messages":[1,"x",null,{"role":"user"}]}"#,
            r#"{"messages":[{"role":7,"content":[{"type":"text","text":"a\/b"}]},{"role":"user","content":null}]}"#,
            r#"{"messages":[{"role":"user","role":"system","content":"a"},{"role":"user","content":1.0e0}]}"#,
            r#"{"messages":[{"role":"system"}]}"#,
            r#"{"messages":{"role":"user"}}"#,
            r#"{"messages":null}"#,
            r#"{"messages":[{"role":"user","content":"caf\u00e9 \"q\" \n"}]}"#,
        ] {
            assert_eq!(root(b), reference::conversation_root(b.as_bytes()), "{b}");
        }
    }

    /// Any JSON value, up to a small depth, with strings that need escaping.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-z\"\\\\/\\x00-\\x1fé😀 ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,3}|role|content", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn message() -> impl Strategy<Value = Value> {
        let role = prop_oneof![
            Just(Value::from("user")),
            Just(Value::from("system")),
            Just(Value::from("assistant")),
            json_value(),
        ];
        prop_oneof![
            4 => (role, json_value()).prop_map(|(r, c)| serde_json::json!({"role": r, "content": c})),
            1 => json_value(),
        ]
    }

    /// `v` written with arbitrary spacing and with the keys and `"user"` needlessly escaped,
    /// as clients may.
    fn written(v: &Value, spaced: bool, escape: bool) -> String {
        let text = if spaced {
            serde_json::to_string_pretty(v).unwrap()
        } else {
            v.to_string()
        };
        if !escape {
            return text;
        }
        // Inside a string literal an escape is as valid as outside, so these are safe anywhere.
        text.replace(r#""user""#, r#""us\u0065r""#)
            .replace(r#""content""#, r#""cont\u0065nt""#)
            .replace(r#""model""#, r#""mod\u0065l""#)
            .replace(r#""logprobs""#, r#""logprob\u0073""#)
    }

    proptest! {
        #[test]
        fn agrees_with_the_separate_parses(
            model in prop_oneof![".{0,12}".prop_map(Value::String), json_value()],
            messages in prop_oneof![
                4 => prop::collection::vec(message(), 0..5).prop_map(Value::Array),
                1 => json_value(),
            ],
            logprobs in json_value(),
            extra in json_value(),
            spaced in any::<bool>(),
            escape in any::<bool>(),
        ) {
            let v = serde_json::json!({
                "extra": extra, "model": model, "messages": messages, "logprobs": logprobs,
            });
            let body = written(&v, spaced, escape);
            let f = RequestFields::parse(body.as_bytes(), true).unwrap();
            let without_root = RequestFields::parse(body.as_bytes(), false).unwrap();
            prop_assert_eq!(without_root.conversation_root(), None);
            prop_assert_eq!(without_root.model(), f.model());
            prop_assert_eq!(without_root.wants_logprobs(), f.wants_logprobs());
            prop_assert_eq!(
                f.model().map(|(m, s)| (m.into_owned(), s)),
                reference::peek_model(body.as_bytes())
            );
            prop_assert_eq!(f.conversation_root().map(str::to_string), reference::conversation_root(body.as_bytes()));
            prop_assert_eq!(
                f.wants_logprobs(),
                crate::capture::client_wants_logprobs(body.as_bytes())
            );
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..64)) {
            if let Some(f) = RequestFields::parse(&body, true) {
                let _ = (f.model(), f.conversation_root(), f.wants_logprobs());
            }
        }
    }
}
