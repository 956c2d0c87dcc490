//! The record encoder: a task that turns [`CapturedExchange`]s into `InteractionRecord`s and
//! submits them to the interaction log. Everything costly about capture happens here.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use hindsight_feedback::{
    AssignmentRecord, Behaviour, ConversationKey, EpisodeInference, EpisodeSource,
    InteractionRecord, LogHandle, Timings, Topic, INTERACTION_SCHEMA,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::episodes::{Lookup, SharedEpisodes, MAX_SHARED_KEYS_PER_CALL};
use super::sse::{SseParser, StreamKind, StreamReassembler};
use super::CapturedExchange;

/// Exchanges encoded together at most: the shared episode store costs one Redis round trip
/// for their lookups and one for their writes, so a slow Redis slows batches, not records.
const MAX_BATCH: usize = 256;

struct Encoder {
    route: String,
    log: LogHandle,
    /// This proxy's memory of conversations; `None` when inference is off
    /// (`proxy.episode_inference_capacity = 0`): every header-less call starts an episode.
    episodes: Option<EpisodeInference>,
    /// Whether the encoder task has a shared episode store (a call encoded inline cannot
    /// ask it, which counts as a lookup error).
    sharing: bool,
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
    /// nothing is dropped. Such a call's episode comes from this proxy's memory only (Redis is
    /// never asked on the request path).
    pub fn send(&self, exchange: CapturedExchange) {
        if let Err(err) = self.tx.try_send(exchange) {
            let exchange = match err {
                mpsc::error::TrySendError::Full(e) | mpsc::error::TrySendError::Closed(e) => e,
            };
            metrics::counter!("hindsight_proxy_capture_inline_total").increment(1);
            self.encoder.encode_inline(exchange);
        }
    }
}

/// Starts the encoder task. It infers episodes of header-less calls from up to
/// `inference_capacity` remembered conversations (0: off) and, with `shared`, from the store
/// the other proxies write too. It ends once every [`EncoderHandle`] is dropped and its queue
/// is drained; await the returned handle during shutdown before flushing the log.
pub fn spawn_encoder(
    route: String,
    log: LogHandle,
    inference_capacity: usize,
    shared: Option<SharedEpisodes>,
    capacity: usize,
) -> (EncoderHandle, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<CapturedExchange>(capacity);
    let episodes = (inference_capacity > 0).then(|| EpisodeInference::new(inference_capacity));
    let mut shared = shared.filter(|_| episodes.is_some());
    let encoder = Arc::new(Encoder {
        route,
        log,
        sharing: shared.is_some(),
        episodes,
    });
    let task_encoder = encoder.clone();
    let task = tokio::spawn(async move {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
            task_encoder.encode_batch(&mut batch, shared.as_mut()).await;
        }
    });
    (EncoderHandle { tx, encoder }, task)
}

/// How a record gets its episode.
enum EpisodeNeed {
    /// The client named it (`x-hindsight-episode`).
    Header(String),
    /// From the conversation: the keys of its prefixes that end with an assistant message,
    /// longest first (empty for a first turn).
    Infer(Vec<ConversationKey>),
    /// Its own: a legacy completion (no conversation), or inference is off.
    PerCall,
}

/// A record waiting for its episode.
struct Pending {
    record: InteractionRecord,
    need: EpisodeNeed,
    /// The key a later turn extending this call's messages and answer will look for.
    answer_key: Option<ConversationKey>,
}

/// What the shared store said about a batch.
enum SharedAnswer<'a> {
    /// No shared store: this proxy's memory is the whole truth.
    Off,
    /// The store could not be asked (or was not: nothing to ask, or inline encoding).
    Unavailable,
    Found(&'a HashMap<ConversationKey, String>),
}

impl Encoder {
    /// The queue-full path, on the caller's thread: this proxy's memory only.
    fn encode_inline(&self, ex: CapturedExchange) {
        let pending = self.encode(ex);
        let answer = if self.sharing {
            SharedAnswer::Unavailable
        } else {
            SharedAnswer::Off
        };
        let mut no_writes = Vec::new();
        let record = self.settle_episode(pending, &answer, &mut no_writes);
        self.submit(record);
    }

    /// Encodes and submits `batch` (drained) in order. Conversations this proxy does not
    /// remember are looked up in the shared store in one call; the episodes of answered calls
    /// are written to it in one call, before the records are submitted.
    async fn encode_batch(
        &self,
        batch: &mut Vec<CapturedExchange>,
        shared: Option<&mut SharedEpisodes>,
    ) {
        let pending: Vec<Pending> = batch.drain(..).map(|ex| self.encode(ex)).collect();
        let Some(store) = shared else {
            let mut no_writes = Vec::new();
            for p in pending {
                let record = self.settle_episode(p, &SharedAnswer::Off, &mut no_writes);
                self.submit(record);
            }
            return;
        };
        let wanted: Vec<ConversationKey> = match &self.episodes {
            Some(local) => pending
                .iter()
                .filter_map(|p| match &p.need {
                    EpisodeNeed::Infer(keys)
                        if !keys.is_empty() && local.lookup(keys).is_none() =>
                    {
                        Some(keys.iter().take(MAX_SHARED_KEYS_PER_CALL).copied())
                    }
                    _ => None,
                })
                .flatten()
                .collect(),
            None => Vec::new(),
        };
        let found = if wanted.is_empty() {
            None
        } else {
            store.get_many(&wanted).await
        };
        let answer = match &found {
            Some(map) => SharedAnswer::Found(map),
            None => SharedAnswer::Unavailable,
        };
        let mut writes = Vec::new();
        let records: Vec<InteractionRecord> = pending
            .into_iter()
            .map(|p| self.settle_episode(p, &answer, &mut writes))
            .collect();
        // Written before the records are submitted, so whoever reads a record can count on
        // its episode being shared (unless Redis failed; then it is in this proxy's memory).
        store.put_many(&writes).await;
        for record in records {
            self.submit(record);
        }
    }

    /// Gives the record its episode, remembers the call's answer locally, and queues it in
    /// `writes` for the shared store.
    fn settle_episode(
        &self,
        pending: Pending,
        shared: &SharedAnswer<'_>,
        writes: &mut Vec<(ConversationKey, String)>,
    ) -> InteractionRecord {
        let Pending {
            mut record,
            need,
            answer_key,
        } = pending;
        let (episode_id, source) = match (need, &self.episodes) {
            (EpisodeNeed::Header(h), _) => (h, EpisodeSource::Header),
            (EpisodeNeed::Infer(keys), Some(local)) => {
                let (found, lookup) = if let Some(ep) = local.lookup(&keys) {
                    (Some(ep), Lookup::HitLocal)
                } else {
                    match shared {
                        SharedAnswer::Found(map) => {
                            match keys.iter().find_map(|k| Some((*k, map.get(k)?))) {
                                Some((k, ep)) => {
                                    // Later turns of this conversation then hit locally.
                                    local.insert(k, ep);
                                    (Some(ep.clone()), Lookup::HitShared)
                                }
                                None => (None, Lookup::Miss),
                            }
                        }
                        // A first turn has nothing to look up: a miss wherever it is asked.
                        _ if keys.is_empty() => (None, Lookup::Miss),
                        SharedAnswer::Unavailable => (None, Lookup::Error),
                        SharedAnswer::Off => (None, Lookup::Miss),
                    }
                };
                lookup.count();
                match found {
                    Some(ep) => (ep, EpisodeSource::Inferred),
                    None => (uuid::Uuid::now_v7().to_string(), EpisodeSource::New),
                }
            }
            (EpisodeNeed::Infer(_) | EpisodeNeed::PerCall, _) => {
                (record.interaction_id.to_string(), EpisodeSource::New)
            }
        };
        if let (Some(key), Some(local)) = (answer_key, &self.episodes) {
            local.insert(key, &episode_id);
            if self.sharing {
                writes.push((key, episode_id.clone()));
            }
        }
        record.episode_id = episode_id;
        record.episode_source = source;
        record
    }

    fn submit(&self, record: InteractionRecord) {
        let interaction_id = record.interaction_id;
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

    /// Everything but the episode: parsing, stream reassembly, behaviour.
    fn encode(&self, ex: CapturedExchange) -> Pending {
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
        let messages = request.get("messages").and_then(Value::as_array);
        let need = match ex.episode_header {
            Some(h) if !h.is_empty() => EpisodeNeed::Header(h),
            // Legacy completions carry no conversation to extend.
            _ => match (messages, &self.episodes) {
                (Some(m), Some(_)) => EpisodeNeed::Infer(EpisodeInference::continuation_keys(m)),
                _ => EpisodeNeed::PerCall,
            },
        };
        let answer_key = match (messages, &response, &self.episodes) {
            (Some(m), Some(resp), Some(_)) if ex.status < 400 => resp
                .pointer("/choices/0/message")
                .map(|answer| EpisodeInference::answer_key(m, answer)),
            _ => None,
        };
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
        let record = InteractionRecord {
            schema: INTERACTION_SCHEMA.to_string(),
            interaction_id: ex.interaction_id,
            // Set by `settle_episode`.
            episode_id: String::new(),
            episode_source: EpisodeSource::New,
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
        };
        Pending {
            record,
            need,
            answer_key,
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
