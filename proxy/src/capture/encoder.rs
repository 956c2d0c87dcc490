//! The record encoder: a task that turns [`CapturedExchange`]s into `InteractionRecord`s and
//! submits them to the interaction log. Everything costly about capture happens here.

use std::sync::Arc;

use bytes::Bytes;
use hindsight_feedback::{
    AssignmentRecord, Behaviour, EpisodeSource, InteractionRecord, LogHandle, Timings, Topic,
    INTERACTION_SCHEMA,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::sse::{SseParser, StreamKind, StreamReassembler};
use super::CapturedExchange;

/// Decides the episode of a call that came without an `x-hindsight-episode` header.
pub trait EpisodeResolver: Send + Sync + 'static {
    /// The episode id for this request and how it was obtained.
    fn resolve(&self, request: &Value, interaction_id: &uuid::Uuid) -> (String, EpisodeSource);
    /// Remembers the answer so that a later call extending this conversation joins the episode.
    fn remember(&self, request: &Value, response: &Value, episode_id: &str);
}

/// Every header-less call starts its own episode (used when no inference is configured).
pub struct EpisodePerCall;

impl EpisodeResolver for EpisodePerCall {
    fn resolve(&self, _request: &Value, interaction_id: &uuid::Uuid) -> (String, EpisodeSource) {
        (interaction_id.to_string(), EpisodeSource::New)
    }
    fn remember(&self, _request: &Value, _response: &Value, _episode_id: &str) {}
}

struct Encoder {
    route: String,
    log: LogHandle,
    resolver: Arc<dyn EpisodeResolver>,
}

/// Where request handling sends finished exchanges. Never blocks.
#[derive(Clone)]
pub struct EncoderHandle {
    tx: mpsc::Sender<CapturedExchange>,
    encoder: Arc<Encoder>,
}

impl EncoderHandle {
    /// Queues an exchange for encoding. When the queue is full (the encoder fell behind) the
    /// exchange is encoded on the caller's thread instead: slower for that one request, but
    /// nothing is dropped.
    pub fn send(&self, exchange: CapturedExchange) {
        if let Err(err) = self.tx.try_send(exchange) {
            let exchange = match err {
                mpsc::error::TrySendError::Full(e) | mpsc::error::TrySendError::Closed(e) => e,
            };
            metrics::counter!("hindsight_proxy_capture_inline_total").increment(1);
            self.encoder.encode_and_submit(exchange);
        }
    }
}

/// Starts the encoder task. It ends once every [`EncoderHandle`] is dropped and its queue is
/// drained; await the returned handle during shutdown before flushing the log.
pub fn spawn_encoder(
    route: String,
    log: LogHandle,
    resolver: Arc<dyn EpisodeResolver>,
    capacity: usize,
) -> (EncoderHandle, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<CapturedExchange>(capacity);
    let encoder = Arc::new(Encoder {
        route,
        log,
        resolver,
    });
    let task_encoder = encoder.clone();
    let task = tokio::spawn(async move {
        while let Some(ex) = rx.recv().await {
            task_encoder.encode_and_submit(ex);
        }
    });
    (EncoderHandle { tx, encoder }, task)
}

impl Encoder {
    fn encode_and_submit(&self, ex: CapturedExchange) {
        let interaction_id = ex.interaction_id;
        let record = self.encode(ex);
        match serde_json::to_vec(&record) {
            Ok(bytes) => self.log.submit(
                Topic::Interactions,
                record.episode_id.clone(),
                interaction_id,
                Bytes::from(bytes),
            ),
            Err(e) => {
                metrics::counter!("hindsight_proxy_capture_encode_errors_total").increment(1);
                tracing::error!(%interaction_id, error = %e, "Interaction record could not be serialised.");
            }
        }
    }

    fn encode(&self, ex: CapturedExchange) -> InteractionRecord {
        let request = parse_json_or_string(&ex.request);
        let kind = if ex.path.starts_with("/v1/completions") {
            StreamKind::Completion
        } else {
            StreamKind::Chat
        };
        let mut error = ex.error;
        let response = if ex.response.is_empty() && ex.status == 0 {
            None
        } else if ex.streamed {
            let mut parser = SseParser::new();
            let mut re = StreamReassembler::new(kind);
            parser.feed(&ex.response, |d| re.push_event(d));
            parser.finish(|d| re.push_event(d));
            if !re.is_done() && error.is_none() && ex.status < 400 {
                error = Some("stream ended without [DONE]".into());
            }
            Some(re.finish())
        } else if ex.response.is_empty() {
            None
        } else {
            Some(parse_json_or_string(&ex.response))
        };
        if ex.response_truncated {
            error.get_or_insert_with(|| {
                "response larger than proxy.max_capture_response_bytes; record truncated".into()
            });
        }
        let (episode_id, episode_source) = match ex.episode_header {
            Some(h) if !h.is_empty() => (h, EpisodeSource::Header),
            _ => self.resolver.resolve(&request, &ex.interaction_id),
        };
        if let Some(resp) = &response {
            if ex.status < 400 {
                self.resolver.remember(&request, resp, &episode_id);
            }
        }
        let behaviour = response.as_ref().and_then(behaviour_of);
        // Keep the response as the client saw it: injected log-probs live only in `behaviour`.
        let mut response = response;
        if ex.behaviour_injected {
            if let Some(r) = response.as_mut() {
                super::strip::null_logprobs(r);
            }
        }
        let adapter = ex.adapter.or_else(|| {
            response
                .as_ref()
                .and_then(|r| r.get("model"))
                .and_then(Value::as_str)
                .map(str::to_string)
        });
        InteractionRecord {
            schema: INTERACTION_SCHEMA.to_string(),
            interaction_id: ex.interaction_id,
            episode_id,
            episode_source,
            event_time_ms: ex.received_ms,
            route: self.route.clone(),
            method: ex.method,
            path: ex.path,
            request,
            response,
            status: ex.status,
            streamed: ex.streamed,
            timings: Timings {
                upstream_headers_ms: ex.upstream_headers_ms,
                total_ms: ex.total_ms,
            },
            adapter,
            behaviour,
            error,
            assignment: ex.assignment.map(|a| AssignmentRecord {
                route: a.route,
                arm: a.arm.as_str().to_string(),
                version: a.version,
                rollout_id: a.rollout_id,
                probability: a.probability,
            }),
        }
    }
}

fn parse_json_or_string(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
}

/// Sampled-token log-probabilities of the first choice, when the upstream returned them
/// (chat `logprobs.content[]` or legacy `logprobs.tokens/token_logprobs`). Token ids come from
/// a `token_id` field or vLLM's `token_id:N` token strings.
fn behaviour_of(response: &Value) -> Option<Behaviour> {
    let lp = response.get("choices")?.get(0)?.get("logprobs")?;
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    let mut ids = Vec::new();
    if let Some(content) = lp.get("content").and_then(Value::as_array) {
        for item in content {
            let token = item.get("token").and_then(Value::as_str).unwrap_or("");
            tokens.push(token.to_string());
            logprobs.push(
                item.get("logprob")
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN) as f32,
            );
            ids.push(
                item.get("token_id")
                    .and_then(Value::as_u64)
                    .map(|v| v as u32)
                    .or_else(|| token.strip_prefix("token_id:").and_then(|s| s.parse().ok())),
            );
        }
    } else if let (Some(toks), Some(lps)) = (
        lp.get("tokens").and_then(Value::as_array),
        lp.get("token_logprobs").and_then(Value::as_array),
    ) {
        for (t, l) in toks.iter().zip(lps) {
            let token = t.as_str().unwrap_or("");
            tokens.push(token.to_string());
            logprobs.push(l.as_f64().unwrap_or(f64::NAN) as f32);
            ids.push(token.strip_prefix("token_id:").and_then(|s| s.parse().ok()));
        }
    } else {
        return None;
    }
    if tokens.is_empty() {
        return None;
    }
    let token_ids = ids.iter().copied().collect::<Option<Vec<u32>>>();
    Some(Behaviour {
        tokens,
        token_ids,
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn behaviour_from_chat_logprobs_with_ids() {
        let r = json!({"choices":[{"logprobs":{"content":[
            {"token":"Par","logprob":-0.5,"token_id":123},
            {"token":"is","logprob":-0.25,"token_id":7}]}}]});
        let b = behaviour_of(&r).unwrap();
        assert_eq!(b.tokens, vec!["Par", "is"]);
        assert_eq!(b.logprobs, vec![-0.5, -0.25]);
        assert_eq!(b.token_ids, Some(vec![123, 7]));
    }

    #[test]
    fn behaviour_from_vllm_token_id_strings_and_absent() {
        let r = json!({"choices":[{"logprobs":{"tokens":["token_id:5","token_id:9"],"token_logprobs":[-1.0,-2.0]}}]});
        assert_eq!(behaviour_of(&r).unwrap().token_ids, Some(vec![5, 9]));
        assert!(behaviour_of(&json!({"choices":[{"logprobs":null}]})).is_none());
        let partial = json!({"choices":[{"logprobs":{"content":[{"token":"a","logprob":-1.0}]}}]});
        assert_eq!(behaviour_of(&partial).unwrap().token_ids, None);
    }
}
