//! The records Hindsight writes to Kafka: captured interactions, feedback events and joined
//! episodes, plus the topic names they live in. Every record is JSON with a `schema` field.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Schema tag of [`InteractionRecord`].
pub const INTERACTION_SCHEMA: &str = "hindsight.interaction.v1";
/// Schema tag of [`FeedbackRecord`].
pub const FEEDBACK_SCHEMA: &str = "hindsight.feedback.v1";
/// Schema tag of [`EpisodeRecord`].
pub const EPISODE_SCHEMA: &str = "hindsight.episode.v1";
/// Schema tag of [`DeadLetterRecord`].
pub const DEAD_LETTER_SCHEMA: &str = "hindsight.deadletter.v1";

/// How the proxy obtained an interaction's episode id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EpisodeSource {
    /// The client sent `x-hindsight-episode`.
    Header,
    /// The request's messages extend an earlier call's messages plus its answer.
    Inferred,
    /// Nothing matched: this call starts a new episode.
    New,
}

/// Timings of one proxied call, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Timings {
    /// From receiving the request to receiving the upstream's response headers.
    pub upstream_headers_ms: f64,
    /// From receiving the request to sending the last response byte.
    pub total_ms: f64,
}

/// The behaviour policy's sampled tokens and their log-probabilities, when the upstream returned them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Behaviour {
    /// Sampled tokens as text, in order.
    pub tokens: Vec<String>,
    /// Sampled token ids, when the upstream reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Log-probability of each sampled token under the serving policy.
    pub logprobs: Vec<f32>,
}

/// One captured call through the proxy (topic `hindsight.interactions`, key = episode id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InteractionRecord {
    /// Always [`INTERACTION_SCHEMA`].
    pub schema: String,
    /// UUIDv7; the client gets it as `x-hindsight-interaction-id`.
    pub interaction_id: Uuid,
    /// The episode this call belongs to.
    pub episode_id: String,
    /// How `episode_id` was obtained.
    pub episode_source: EpisodeSource,
    /// When the proxy received the request (ms since the Unix epoch).
    pub event_time_ms: i64,
    /// Route (deployment) that served the call.
    pub route: String,
    /// HTTP method.
    pub method: String,
    /// Path and query as sent upstream.
    pub path: String,
    /// Request body as sent upstream (non-JSON bodies as a JSON string).
    pub request: serde_json::Value,
    /// Response as the client saw it; streams reassembled into the non-stream shape.
    pub response: Option<serde_json::Value>,
    /// HTTP status the client saw.
    pub status: u16,
    /// Whether the response was streamed (SSE).
    pub streamed: bool,
    /// Timings of the call.
    pub timings: Timings,
    /// Adapter/version that served it.
    pub adapter: Option<String>,
    /// Sampled-token log-probs when present.
    pub behaviour: Option<Behaviour>,
    /// What went wrong, if anything (e.g. "client disconnected mid-stream").
    pub error: Option<String>,
    /// The canary assignment, when the request named a routed logical model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment: Option<AssignmentRecord>,
}

impl InteractionRecord {
    /// A completed, non-streamed `POST /v1/chat/completions` on route `default` with status 200,
    /// a fresh UUIDv7 id and the episode id from a header; no timings, adapter, behaviour, error
    /// or assignment (set those fields after, where they apply).
    pub fn chat(
        episode_id: impl Into<String>,
        request: serde_json::Value,
        response: serde_json::Value,
        event_time_ms: i64,
    ) -> Self {
        Self {
            schema: INTERACTION_SCHEMA.into(),
            interaction_id: Uuid::now_v7(),
            episode_id: episode_id.into(),
            episode_source: EpisodeSource::Header,
            event_time_ms,
            route: "default".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request,
            response: Some(response),
            status: 200,
            streamed: false,
            timings: Timings::default(),
            adapter: None,
            behaviour: None,
            error: None,
            assignment: None,
        }
    }
}

/// How the proxy's routing table assigned a call (see the routing crate): enough to compare
/// versions online and to evaluate a version off-policy from logged traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssignmentRecord {
    /// The logical model the client named (the route).
    pub route: String,
    /// `stable`, `canary` or `pinned`.
    pub arm: String,
    /// The version sent upstream.
    pub version: String,
    /// The rollout running at the time, if any.
    #[serde(default)]
    pub rollout_id: Option<String>,
    /// Probability of this arm for this request's key under the table at the time.
    pub probability: f64,
}

/// What a feedback event says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum FeedbackValue {
    /// Thumbs up (`true`) or down (`false`).
    Thumbs(bool),
    /// A number within the range declared for the event's metric.
    Score(f64),
    /// Free text.
    Comment(String),
    /// A better answer: plain text or a full assistant message (content and tool calls).
    Correction(Correction),
    /// The outcome of a tool step.
    ToolOutcome(ToolOutcome),
    /// Only withdraws the feedback named in `retracts`; carries no judgement itself.
    Retraction,
}

impl FeedbackValue {
    /// The kind's wire name.
    pub fn kind(&self) -> &'static str {
        match self {
            FeedbackValue::Thumbs(_) => "thumbs",
            FeedbackValue::Score(_) => "score",
            FeedbackValue::Comment(_) => "comment",
            FeedbackValue::Correction(_) => "correction",
            FeedbackValue::ToolOutcome(_) => "tool_outcome",
            FeedbackValue::Retraction => "retraction",
        }
    }
}

/// A corrected answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Correction {
    /// The better answer as text.
    Text(String),
    /// The better answer as an assistant message.
    Message(CorrectionMessage),
}

/// A corrected assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorrectionMessage {
    /// Text content, if any.
    #[serde(default)]
    pub content: Option<String>,
    /// OpenAI-style tool calls, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// The outcome of one tool step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolOutcome {
    /// Whether the step succeeded.
    pub success: bool,
    /// What happened.
    #[serde(default)]
    pub detail: String,
    /// The tool call this outcome belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// What a feedback event is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeedbackTarget {
    /// One call through the proxy.
    Interaction(Uuid),
    /// Every turn of an episode.
    Episode(String),
}

impl FeedbackTarget {
    /// The Kafka key for this target (the id as text).
    pub fn key(&self) -> String {
        match self {
            FeedbackTarget::Interaction(id) => id.to_string(),
            FeedbackTarget::Episode(id) => id.clone(),
        }
    }
}

/// One accepted feedback event (topic `hindsight.feedback`, key = target id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeedbackRecord {
    /// Always [`FEEDBACK_SCHEMA`].
    pub schema: String,
    /// UUIDv7 assigned on acceptance.
    pub feedback_id: Uuid,
    /// The interaction or episode it is about.
    pub target: FeedbackTarget,
    /// Kind and value.
    #[serde(flatten)]
    pub value: FeedbackValue,
    /// Metric name (scores only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    /// Who or what sent it (system name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Who judged (person or model id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rater: Option<String>,
    /// Free-form tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// The feedback id this event withdraws.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retracts: Option<Uuid>,
    /// When it was accepted (ms since the Unix epoch).
    pub event_time_ms: i64,
}

impl FeedbackRecord {
    /// A feedback event on `target` accepted at `event_time_ms` with a fresh UUIDv7 id and no
    /// metric, source, rater, tags or retraction (set those fields after, where they apply).
    pub fn new(target: FeedbackTarget, value: FeedbackValue, event_time_ms: i64) -> Self {
        Self {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target,
            value,
            metric: None,
            source: None,
            rater: None,
            tags: vec![],
            retracts: None,
            event_time_ms,
        }
    }
}

/// One feedback event as attached to an episode turn.
pub type FeedbackEvent = FeedbackRecord;

/// One joined training example (topic `hindsight.episodes`, key = episode id): an episode turn
/// with all the feedback that applies to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeRecord {
    /// Always [`EPISODE_SCHEMA`].
    pub schema: String,
    /// Deterministic id: UUIDv5 of the interaction id and the sorted feedback ids, so a
    /// re-emitted record has the same id.
    pub record_id: Uuid,
    /// The episode.
    pub episode_id: String,
    /// How the episode id was obtained.
    pub episode_source: EpisodeSource,
    /// The turn: the interaction id.
    pub turn: Uuid,
    /// Route that served the turn.
    pub route: String,
    /// The context as sent: request messages and tools (plus any other request fields).
    pub context: EpisodeContext,
    /// The answer as produced (assistant message), when the response had one.
    pub answer: Option<serde_json::Value>,
    /// Behaviour-policy tokens and log-probs when logged.
    pub behaviour: Option<Behaviour>,
    /// Adapter/version that produced the answer.
    pub adapter: Option<String>,
    /// All non-retracted feedback for this turn (interaction- and episode-level), by event time.
    pub feedback: Vec<FeedbackEvent>,
    /// Event time of the interaction.
    pub interaction_time_ms: i64,
    /// Event time of the latest feedback included.
    pub feedback_time_ms: i64,
    /// When the joiner emitted this record.
    pub emitted_at_ms: i64,
}

impl EpisodeRecord {
    /// A joined turn of episode `episode_id` on route `default` (episode id from a header) with
    /// fresh UUIDv7 record and turn ids, event times 0 and no behaviour or adapter: what tests,
    /// probes and benches build by hand (set the other fields after, where they apply).
    pub fn turn(
        episode_id: impl Into<String>,
        context: EpisodeContext,
        answer: Option<serde_json::Value>,
        feedback: Vec<FeedbackEvent>,
    ) -> Self {
        Self {
            schema: EPISODE_SCHEMA.into(),
            record_id: Uuid::now_v7(),
            episode_id: episode_id.into(),
            episode_source: EpisodeSource::Header,
            turn: Uuid::now_v7(),
            route: "default".into(),
            context,
            answer,
            behaviour: None,
            adapter: None,
            feedback,
            interaction_time_ms: 0,
            feedback_time_ms: 0,
            emitted_at_ms: 0,
        }
    }
}

/// The context half of an episode turn.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EpisodeContext {
    /// Request messages as sent upstream.
    pub messages: serde_json::Value,
    /// Request tools, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    /// Request `tool_choice`, when present (`"none"` keeps the tools out of the prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    /// The request's model field, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The request's `response_format`, when present (the learner decodes the hindsight
    /// teacher's own answer under the same grammar the serve used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<serde_json::Value>,
    /// The request's sampling `temperature`, when present (the behaviour log-probs `hindsight
    /// serve` logs are those of the tempered distribution; the learner compares like with like).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// The request's `top_p`, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
}

/// A feedback event the joiner could not place (topic `hindsight.deadletter`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetterRecord {
    /// Always [`DEAD_LETTER_SCHEMA`].
    pub schema: String,
    /// Why it was dead-lettered: `unknown_target`, `expired_target`, `malformed`.
    pub reason: String,
    /// The feedback id when it could be read.
    pub feedback_id: Option<Uuid>,
    /// The original record (JSON, or the raw payload as a string when it was not JSON).
    pub record: serde_json::Value,
    /// When it was dead-lettered.
    pub event_time_ms: i64,
}

/// The Kafka topics Hindsight writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topic {
    /// `hindsight.interactions`, key = episode id.
    Interactions,
    /// `hindsight.feedback`, key = target id.
    Feedback,
    /// `hindsight.episodes`, key = episode id.
    Episodes,
    /// `hindsight.deadletter`, key = the record's id.
    DeadLetter,
    /// `hindsight.rollouts`, key = the route: every rollout decision (audit records).
    Rollouts,
}

impl Topic {
    /// All topics, in a fixed order.
    pub const ALL: [Topic; 5] = [
        Topic::Interactions,
        Topic::Feedback,
        Topic::Episodes,
        Topic::DeadLetter,
        Topic::Rollouts,
    ];

    /// The default topic name (prefix `hindsight`).
    pub fn name(&self) -> &'static str {
        match self {
            Topic::Interactions => "hindsight.interactions",
            Topic::Feedback => "hindsight.feedback",
            Topic::Episodes => "hindsight.episodes",
            Topic::DeadLetter => "hindsight.deadletter",
            Topic::Rollouts => "hindsight.rollouts",
        }
    }

    /// The name's suffix after the prefix.
    pub fn suffix(&self) -> &'static str {
        match self {
            Topic::Interactions => "interactions",
            Topic::Feedback => "feedback",
            Topic::Episodes => "episodes",
            Topic::DeadLetter => "deadletter",
            Topic::Rollouts => "rollouts",
        }
    }

    /// The topic name under a given prefix (`<prefix>.<suffix>`).
    pub fn name_with_prefix(&self, prefix: &str) -> String {
        format!("{prefix}.{}", self.suffix())
    }

    pub(crate) fn as_u8(self) -> u8 {
        match self {
            Topic::Interactions => 0,
            Topic::Feedback => 1,
            Topic::Episodes => 2,
            Topic::DeadLetter => 3,
            Topic::Rollouts => 4,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<Topic> {
        match v {
            0 => Some(Topic::Interactions),
            1 => Some(Topic::Feedback),
            2 => Some(Topic::Episodes),
            3 => Some(Topic::DeadLetter),
            4 => Some(Topic::Rollouts),
            _ => None,
        }
    }
}

pub use hindsight_core::now_ms;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feedback_record_round_trips_with_flat_kind_and_value() {
        let rec = FeedbackRecord {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target: FeedbackTarget::Interaction(Uuid::now_v7()),
            value: FeedbackValue::Score(0.5),
            metric: Some("quality".into()),
            source: None,
            rater: None,
            tags: vec![],
            retracts: None,
            event_time_ms: 1,
        };
        let json = serde_json::to_value(&rec).unwrap();
        assert_eq!(json["kind"], "score");
        assert_eq!(json["value"], 0.5);
        let back: FeedbackRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, rec);
    }

    #[test]
    fn retraction_round_trips() {
        let rec = FeedbackRecord {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target: FeedbackTarget::Episode("e".into()),
            value: FeedbackValue::Retraction,
            metric: None,
            source: None,
            rater: None,
            tags: vec!["x".into()],
            retracts: Some(Uuid::now_v7()),
            event_time_ms: 1,
        };
        let json = serde_json::to_value(&rec).unwrap();
        assert_eq!(json["kind"], "retraction");
        let back: FeedbackRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, rec);
        let t = FeedbackRecord {
            value: FeedbackValue::ToolOutcome(ToolOutcome {
                success: false,
                detail: "boom".into(),
                tool_call_id: Some("c1".into()),
            }),
            ..rec.clone()
        };
        let back: FeedbackRecord =
            serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        let c = FeedbackRecord {
            value: FeedbackValue::Correction(Correction::Message(CorrectionMessage {
                content: None,
                tool_calls: Some(vec![serde_json::json!({"id": "c"})]),
            })),
            ..rec
        };
        let back: FeedbackRecord =
            serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn episode_source_is_lowercase() {
        assert_eq!(
            serde_json::to_string(&EpisodeSource::Inferred).unwrap(),
            "\"inferred\""
        );
    }

    #[test]
    fn topic_codes_round_trip() {
        for t in Topic::ALL {
            assert_eq!(Topic::from_u8(t.as_u8()), Some(t));
            assert_eq!(t.name(), t.name_with_prefix("hindsight"));
        }
    }
}
