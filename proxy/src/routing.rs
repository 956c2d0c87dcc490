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
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use metrics::Counter;
use uuid::Uuid;

use hindsight_routing::{Arm, Assignment, EpisodeMemory, TableHandle};

use crate::capture::read_limited;
use crate::error::{full, ProxyBody, ProxyError};
use crate::headers;

mod request_fields;

pub(crate) use request_fields::RequestFields;

/// What routing decided for a request, for capture to record.
#[derive(Debug, Clone)]
pub struct Routed {
    /// The decision.
    pub assignment: Assignment,
    /// The interaction id (used as the sticky key when nothing better existed; capture reuses
    /// it so the record and the assignment agree).
    pub interaction_id: Uuid,
    /// Whether the client asked for log-probs itself, read in routing's pass over the body so
    /// capture need not parse it again.
    pub wants_logprobs: bool,
}

/// Shared by every clone of the layer.
pub struct RoutingShared {
    pub table: TableHandle,
    pub memory: EpisodeMemory,
    pub capture_paths: Vec<String>,
    pub max_request_body_bytes: usize,
}

/// The shared state and the per-arm counters, registered once rather than looked up by
/// name and label on every request.
struct Shared {
    config: RoutingShared,
    routed_total: [Counter; 3],
}

impl Shared {
    fn routed_total(&self, arm: Arm) -> &Counter {
        match arm {
            Arm::Stable => &self.routed_total[0],
            Arm::Canary => &self.routed_total[1],
            Arm::Pinned => &self.routed_total[2],
        }
    }
}

/// `tower::Layer` adding canary assignment.
#[derive(Clone)]
pub struct RoutingLayer {
    shared: Option<Arc<Shared>>,
}

impl RoutingLayer {
    /// Routing from `shared`, or a pass-through when `None` (routing disabled).
    pub fn new(shared: Option<RoutingShared>) -> Self {
        let counter =
            |arm: Arm| metrics::counter!("hindsight_proxy_routed_total", "arm" => arm.as_str());
        Self {
            shared: shared.map(|config| {
                Arc::new(Shared {
                    config,
                    routed_total: [
                        counter(Arm::Stable),
                        counter(Arm::Canary),
                        counter(Arm::Pinned),
                    ],
                })
            }),
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
    shared: Option<Arc<Shared>>,
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
            && shared
                .config
                .capture_paths
                .iter()
                .any(|p| p == req.uri().path());
        let table = shared.config.table.snapshot();
        if !routable || table.is_empty() {
            return Box::pin(inner.call(req));
        }
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let body = read_limited(body, shared.config.max_request_body_bytes).await?;
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| !v.is_empty())
            };
            let episode_header = header(headers::EPISODE);
            // One pass over the body for everything routing and capture read from it.
            let fields = RequestFields::parse(&body, episode_header.is_none());
            let Some((model, span)) = fields.as_ref().and_then(RequestFields::model) else {
                return inner.call(Request::from_parts(parts, full(body))).await;
            };
            let Some(route) = table.get(&model) else {
                return inner.call(Request::from_parts(parts, full(body))).await;
            };
            let user = header(headers::USER);
            let episode = episode_header
                .or_else(|| fields.as_ref().and_then(RequestFields::conversation_root));
            let wants_logprobs = fields.as_ref().is_some_and(RequestFields::wants_logprobs);
            let interaction_id = Uuid::now_v7();
            // The episode a turn belongs to is the user's own: two users who open their
            // conversations the same way are two episodes, each on its user's arm.
            let user_episode = match (user, episode) {
                (Some(u), Some(e)) => Some(format!("{u}\u{0}{e}")),
                _ => None,
            };
            let assignment = {
                let mut id_key = Uuid::encode_buffer();
                // The sticky key: the user alone (a user keeps one arm), else the episode.
                let key = match user.or(episode) {
                    Some(k) => k,
                    None => interaction_id.hyphenated().encode_lower(&mut id_key),
                };
                let episode = user_episode.as_deref().or(episode);
                shared.config.memory.assign(route, user, episode, key)
            };
            shared.routed_total(assignment.arm).increment(1);
            let body = replace_span(&body, span, &assignment.version);
            let version = HeaderValue::from_str(&assignment.version).ok();
            parts.extensions.insert(Routed {
                assignment,
                interaction_id,
                wants_logprobs,
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

/// `body` with the bytes in `span` replaced by `version` as a JSON string.
fn replace_span(body: &Bytes, span: Range<usize>, version: &str) -> Bytes {
    let mut out = Vec::with_capacity(body.len() + version.len() + 2);
    out.extend_from_slice(&body[..span.start]);
    if serde_json::to_writer(&mut out, version).is_err() {
        // Unreachable (writes to a `Vec` do not fail); `Value`'s `Display` cannot fail at all.
        out.truncate(span.start);
        out.extend_from_slice(serde_json::Value::from(version).to_string().as_bytes());
    }
    out.extend_from_slice(&body[span.end..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn peek_model(body: &[u8]) -> Option<(String, Range<usize>)> {
        let fields = RequestFields::parse(body, false)?;
        fields.model().map(|(m, span)| (m.into_owned(), span))
    }

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
            br#"["support"]"#,
            br#"not json"#,
            br#"{"messages": []}"#,
            br#"{"model":"a","model":"b"}"#,
        ] {
            assert!(peek_model(b).is_none(), "{}", String::from_utf8_lossy(b));
        }
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
