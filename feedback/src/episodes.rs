//! Episode inference for clients that send no `x-hindsight-episode`: a call whose messages
//! extend an earlier call's messages plus that call's answer continues the earlier episode.
//!
//! The proxy calls [`EpisodeInference::infer`] with the request's messages and, once the answer
//! is known, [`EpisodeInference::remember`] with the messages, the assistant message and the
//! episode id. State is a bounded in-memory map from a hash of the conversation (messages +
//! answer, normalised so that a client re-sending the assistant message with `content: ""`
//! instead of `null`, or re-serialised tool-call arguments, still matches) to the episode id.
//! The map is per process; the keys ([`EpisodeInference::continuation_keys`],
//! [`EpisodeInference::answer_key`]) depend only on the messages, so proxies can share them
//! (the proxy keeps a copy in Redis, see proxy/README.md).

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::records::EpisodeSource;

/// A conversation's identity: 16 bytes of SHA-256 chained over its normalised messages. The
/// same messages give the same key in every process.
pub type ConversationKey = [u8; 16];
type Key = ConversationKey;

/// Bounded conversation-prefix → episode map (approximate LRU with two generations).
#[derive(Debug)]
pub struct EpisodeInference {
    capacity: usize,
    maps: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<Key, String>,
    previous: HashMap<Key, String>,
}

impl Generations {
    fn get(&mut self, k: &Key, half: usize) -> Option<String> {
        if let Some(v) = self.current.get(k) {
            return Some(v.clone());
        }
        let v = self.previous.remove(k)?;
        self.insert(*k, v.clone(), half);
        Some(v)
    }

    fn insert(&mut self, k: Key, v: String, half: usize) {
        if self.current.len() >= half {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(k, v);
    }
}

impl EpisodeInference {
    /// Remembers up to about `capacity` conversations (least recently used ones are forgotten).
    pub fn new(capacity: usize) -> EpisodeInference {
        EpisodeInference {
            capacity: capacity.max(2),
            maps: Mutex::new(Generations::default()),
        }
    }

    fn half(&self) -> usize {
        self.capacity / 2
    }

    /// The episode a request with these messages belongs to: the episode of the longest
    /// remembered prefix that ends with an assistant message, else a new UUIDv7 episode.
    pub fn infer(&self, messages: &[Value]) -> (String, EpisodeSource) {
        match self.lookup(&Self::continuation_keys(messages)) {
            Some(ep) => (ep, EpisodeSource::Inferred),
            None => (Uuid::now_v7().to_string(), EpisodeSource::New),
        }
    }

    /// Records that `messages` answered by `answer` (an assistant message) is in `episode_id`.
    pub fn remember(&self, messages: &[Value], answer: &Value, episode_id: &str) {
        self.insert(Self::answer_key(messages, answer), episode_id);
    }

    /// The keys an earlier turn of this conversation was remembered under, if it was: one per
    /// prefix that ends with an assistant message, longest first.
    pub fn continuation_keys(messages: &[Value]) -> Vec<ConversationKey> {
        let chain = prefix_hashes(messages);
        messages
            .iter()
            .zip(chain)
            .filter(|(m, _)| m.get("role").and_then(Value::as_str) == Some("assistant"))
            .map(|(_, k)| k)
            .rev()
            .collect()
    }

    /// The key [`EpisodeInference::remember`] files `messages` answered by `answer` under.
    pub fn answer_key(messages: &[Value], answer: &Value) -> ConversationKey {
        let mut h = chain_start();
        for m in messages {
            h = chain_next(&h, m);
        }
        chain_next(&h, answer)
    }

    /// The episode of the first of `keys` remembered here.
    pub fn lookup(&self, keys: &[ConversationKey]) -> Option<String> {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter().find_map(|k| maps.get(k, self.half()))
    }

    /// Remembers that the conversation `key` is in `episode_id`.
    pub fn insert(&self, key: ConversationKey, episode_id: &str) {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.insert(key, episode_id.to_string(), self.half());
    }

    /// Conversations currently remembered.
    pub fn len(&self) -> usize {
        let maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.current.len() + maps.previous.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn chain_start() -> Key {
    [0u8; 16]
}

/// Hash of all messages up to and including each index.
fn prefix_hashes(messages: &[Value]) -> Vec<Key> {
    let mut out = Vec::with_capacity(messages.len());
    let mut h = chain_start();
    for m in messages {
        h = chain_next(&h, m);
        out.push(h);
    }
    out
}

fn chain_next(prev: &Key, msg: &Value) -> Key {
    let mut hasher = Sha256::new();
    hasher.update(prev);
    normalise_into(msg, &mut hasher);
    let full = hasher.finalize();
    let mut k = [0u8; 16];
    k.copy_from_slice(&full[..16]);
    k
}

/// Feeds the parts of a message that identify it: role, text content, tool calls (id, name,
/// canonical arguments), tool_call_id and name. Fields like `refusal`, `annotations` or `audio`
/// that clients drop when re-sending are ignored.
fn normalise_into(msg: &Value, h: &mut Sha256) {
    let field = |h: &mut Sha256, tag: &[u8], s: &str| {
        h.update(tag);
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    };
    let role = msg.get("role").and_then(Value::as_str).unwrap_or("");
    field(h, b"r", role);
    match msg.get("content") {
        Some(Value::String(s)) if !s.is_empty() => field(h, b"c", s),
        Some(Value::Array(parts)) => {
            // Text parts are concatenated (clients flip between the string and parts forms);
            // other parts count by their canonical JSON.
            let mut text = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    _ => text.push_str(&p.to_string()),
                }
            }
            if !text.is_empty() {
                field(h, b"c", &text);
            }
        }
        _ => {}
    }
    if let Some(Value::Array(calls)) = msg.get("tool_calls") {
        for c in calls {
            field(h, b"i", c.get("id").and_then(Value::as_str).unwrap_or(""));
            let f = c.get("function");
            field(
                h,
                b"n",
                f.and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            );
            let args = f.and_then(|f| f.get("arguments"));
            let canon = match args {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .map(|v| v.to_string())
                    .unwrap_or_else(|_| s.clone()),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            field(h, b"a", &canon);
        }
    }
    if let Some(id) = msg.get("tool_call_id").and_then(Value::as_str) {
        field(h, b"t", id);
    }
    if let Some(n) = msg.get("name").and_then(Value::as_str) {
        field(h, b"m", n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn three_turns_with_tool_calls_share_an_episode() {
        let inf = EpisodeInference::new(100);
        let sys = json!({"role": "system", "content": "be brief"});
        let user = json!({"role": "user", "content": "weather in Paris?"});
        let t1 = vec![sys.clone(), user.clone()];
        let (ep, src) = inf.infer(&t1);
        assert_eq!(src, EpisodeSource::New);
        // Upstream answer carries fields clients drop when re-sending.
        let a1 = json!({"role": "assistant", "content": null, "refusal": null,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]});
        inf.remember(&t1, &a1, &ep);
        let a1_resent = json!({"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]});
        let t2 = vec![
            sys.clone(),
            user.clone(),
            a1_resent.clone(),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        ];
        assert_eq!(inf.infer(&t2), (ep.clone(), EpisodeSource::Inferred));
        let a2 = json!({"role": "assistant", "content": "Sunny."});
        inf.remember(&t2, &a2, &ep);
        let mut t3 = t2.clone();
        t3.push(a2.clone());
        t3.push(json!({"role": "user", "content": "and tomorrow?"}));
        assert_eq!(inf.infer(&t3), (ep.clone(), EpisodeSource::Inferred));
        // A different conversation does not join.
        let other = vec![sys, json!({"role": "user", "content": "weather in Rome?"})];
        assert_eq!(inf.infer(&other).1, EpisodeSource::New);
        // An edited assistant message breaks the chain.
        let mut forged = t3.clone();
        forged[2] = json!({"role": "assistant", "content": "Rainy."});
        assert_eq!(inf.infer(&forged).1, EpisodeSource::New);
    }

    #[test]
    fn a_next_turn_looks_for_the_key_its_previous_turn_was_filed_under() {
        // What lets proxies share conversations: keys depend on the messages only.
        let t1 = vec![json!({"role": "user", "content": "hi"})];
        let a1 = json!({"role": "assistant", "content": "hello", "refusal": null});
        let key = EpisodeInference::answer_key(&t1, &a1);
        let t2 = vec![
            t1[0].clone(),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "more"}),
        ];
        assert_eq!(EpisodeInference::continuation_keys(&t2), vec![key]);
        assert!(EpisodeInference::continuation_keys(&t1).is_empty());
        let elsewhere = EpisodeInference::new(10);
        elsewhere.insert(key, "ep-7");
        assert_eq!(
            elsewhere.infer(&t2),
            ("ep-7".to_string(), EpisodeSource::Inferred)
        );
    }

    #[test]
    fn stays_bounded() {
        let inf = EpisodeInference::new(10);
        for i in 0..1000 {
            let m = vec![json!({"role": "user", "content": format!("q{i}")})];
            inf.remember(&m, &json!({"role": "assistant", "content": "a"}), "e");
        }
        assert!(inf.len() <= 10);
    }
}
