//! Canary assignment on the request path, from the routing table held in memory.
//!
//! A captured call whose `model` names a route of the table is assigned an arm
//! ([`hindsight_routing::EpisodeMemory::assign`]) and forwarded with `model` rewritten to the
//! assigned version; the response carries `x-hindsight-adapter` with that version, and the
//! assignment travels to capture in the request's extensions (so the record carries route, arm,
//! version, rollout id and probability). Requests naming a concrete version or any other model
//! pass through unchanged. Nothing here waits on Redis: the table is a snapshot in memory.
//!
//! Sticky key: `x-hindsight-user`, else the episode (`x-hindsight-episode`, else the
//! conversation's root — its messages up to the first user message, which every turn of one
//! conversation repeats, so it is known before the answer and the same in every proxy), else
//! the interaction id.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Request, Response};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use hindsight_routing::{Assignment, EpisodeMemory, TableHandle};

use crate::capture::read_limited;
use crate::error::{full, ProxyBody, ProxyError};
use crate::headers;

/// What routing decided for a request, for capture to record.
#[derive(Debug, Clone)]
pub struct Routed {
    /// The decision.
    pub assignment: Assignment,
    /// The interaction id (used as the sticky key when nothing better existed; capture reuses
    /// it so the record and the assignment agree).
    pub interaction_id: Uuid,
}

/// Shared by every clone of the layer.
pub struct RoutingShared {
    pub table: TableHandle,
    pub memory: EpisodeMemory,
    pub capture_paths: Vec<String>,
    pub max_request_body_bytes: usize,
}

/// `tower::Layer` adding canary assignment.
#[derive(Clone)]
pub struct RoutingLayer {
    shared: Option<Arc<RoutingShared>>,
}

impl RoutingLayer {
    /// Routing from `shared`, or a pass-through when `None` (routing disabled).
    pub fn new(shared: Option<RoutingShared>) -> Self {
        Self {
            shared: shared.map(Arc::new),
        }
    }
}

impl<S> tower::Layer<S> for RoutingLayer {
    type Service = Routing<S>;
    fn layer(&self, inner: S) -> Routing<S> {
        Routing {
            inner,
            shared: self.shared.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Routing<S> {
    inner: S,
    shared: Option<Arc<RoutingShared>>,
}

impl<S> tower::Service<Request<ProxyBody>> for Routing<S>
where
    S: tower::Service<Request<ProxyBody>, Response = Response<ProxyBody>, Error = ProxyError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(shared) = self.shared.clone() else {
            return Box::pin(inner.call(req));
        };
        let routable = req.method() == http::Method::POST
            && shared.capture_paths.iter().any(|p| p == req.uri().path());
        let table = shared.table.snapshot();
        if !routable || table.is_empty() {
            return Box::pin(inner.call(req));
        }
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let body = read_limited(body, shared.max_request_body_bytes).await?;
            let Some((model, span)) = peek_model(&body) else {
                return inner.call(Request::from_parts(parts, full(body))).await;
            };
            let Some(route) = table.get(&model) else {
                return inner.call(Request::from_parts(parts, full(body))).await;
            };
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| !v.is_empty())
                    .map(str::to_string)
            };
            let user = header(headers::USER);
            let episode = header(headers::EPISODE).or_else(|| conversation_root(&body));
            let interaction_id = Uuid::now_v7();
            let id_key = interaction_id.to_string();
            let key = user.clone().or_else(|| episode.clone()).unwrap_or(id_key);
            // The episode a turn belongs to is the user's own: two users who open their
            // conversations the same way are two episodes, each on its user's arm.
            let episode = match (&user, episode) {
                (Some(u), Some(e)) => Some(format!("{u}\u{0}{e}")),
                (_, e) => e,
            };
            let assignment = shared
                .memory
                .assign(route, user.as_deref(), episode.as_deref(), &key);
            metrics::counter!("hindsight_proxy_routed_total", "arm" => assignment.arm.as_str())
                .increment(1);
            let body = replace_span(&body, span, &assignment.version);
            let version = HeaderValue::from_str(&assignment.version).ok();
            parts.extensions.insert(Routed {
                assignment,
                interaction_id,
            });
            parts.headers.remove(http::header::CONTENT_LENGTH);
            let mut resp = inner.call(Request::from_parts(parts, full(body))).await?;
            if let Some(v) = version {
                resp.headers_mut().insert(headers::ADAPTER, v);
            }
            Ok(resp)
        })
    }
}

#[derive(Deserialize)]
struct Peek<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
}

/// The request's top-level `model` string and the byte span of its JSON value, or `None` when
/// the body is not a JSON object with a string `model` (such requests pass through).
fn peek_model(body: &[u8]) -> Option<(String, (usize, usize))> {
    let text = std::str::from_utf8(body).ok()?;
    let peek: Peek<'_> = serde_json::from_str(text).ok()?;
    let raw = peek.model?;
    let model: String = serde_json::from_str(raw.get()).ok()?;
    let start = (raw.get().as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    Some((model, (start, start + raw.get().len())))
}

/// `body` with the bytes in `span` replaced by `version` as a JSON string.
fn replace_span(body: &Bytes, span: (usize, usize), version: &str) -> Bytes {
    let quoted = Value::String(version.to_string()).to_string();
    let mut out = BytesMut::with_capacity(body.len() + quoted.len());
    out.extend_from_slice(&body[..span.0]);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(&body[span.1..]);
    out.freeze()
}

#[derive(Deserialize)]
struct Messages {
    #[serde(default)]
    messages: Option<Vec<Value>>,
}

/// `conv:<hex>`: a hash of the messages up to and including the first user message, which
/// every later turn of the same conversation repeats verbatim.
fn conversation_root(body: &[u8]) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_model_is_replaced_in_place_and_nothing_else_changes() {
        let body = Bytes::from_static(
            br#"{"messages":[{"role":"user","content":"model"}], "model" : "support","n":1}"#,
        );
        let (model, span) = peek_model(&body).unwrap();
        assert_eq!(model, "support");
        let out = replace_span(&body, span, "support@7");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"messages":[{"role":"user","content":"model"}], "model" : "support@7","n":1}"#
        );
    }

    #[test]
    fn bodies_without_a_string_model_are_not_routed() {
        for b in [
            &br#"{"model": 3}"#[..],
            br#"[1,2]"#,
            br#"not json"#,
            br#"{"messages": []}"#,
            br#"{"model":"a","model":"b"}"#,
        ] {
            assert!(peek_model(b).is_none(), "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn every_turn_of_a_conversation_shares_its_root() {
        let t1 =
            br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#;
        let t2 = br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"},
            {"role":"assistant","content":"x"},{"role":"user","content":"more"}]}"#;
        let other =
            br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"bye"}]}"#;
        assert_eq!(conversation_root(t1), conversation_root(t2));
        assert_ne!(conversation_root(t1), conversation_root(other));
        assert_eq!(conversation_root(br#"{"prompt":"x"}"#), None);
    }

    proptest! {
        #[test]
        fn rewriting_any_string_model_keeps_the_json_equal_but_for_model(
            model in ".{0,20}", version in ".{1,20}", extra in ".{0,20}",
        ) {
            let v = serde_json::json!({"a": extra, "model": model, "z": [1, {"model": "inner"}]});
            let body = Bytes::from(serde_json::to_vec(&v).unwrap());
            let (m, span) = peek_model(&body).unwrap();
            prop_assert_eq!(&m, &model);
            let out: Value = serde_json::from_slice(&replace_span(&body, span, &version)).unwrap();
            let mut expected = v.clone();
            expected["model"] = Value::String(version.clone());
            prop_assert_eq!(out, expected);
        }
    }
}
