//! Sends the simulated user's feedback through Hindsight's webhook, signed the way a real
//! integration would: `x-hindsight-timestamp` and `x-hindsight-signature: v1=<hex HMAC-SHA256
//! (secret, "<timestamp>.<raw body>")>`, with an `Idempotency-Key` so retries are accepted once.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

use super::error::EnvError;
use super::user::Reaction;

/// Path of the batch endpoint under the feedback base URL.
pub const BATCH_PATH: &str = "/hindsight/v1/feedback/batch";

/// What the feedback is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One interaction (from the proxy's `x-hindsight-interaction-id`).
    Interaction(String),
    /// A whole episode (when no interaction id was returned).
    Episode(String),
}

/// `v1=<lowercase hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub fn sign(secret: &str, timestamp: u64, body: &[u8]) -> String {
    // HMAC accepts keys of any length, so this cannot fail; fall back to an empty MAC anyway.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return String::from("v1=");
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// The feedback events (contract of `POST /hindsight/v1/feedback`) for one reaction.
pub fn feedback_events(target: &Target, reaction: &Reaction, rater: &str) -> Vec<Value> {
    let base = |kind: &str, value: Value| {
        let mut event = json!({
            "kind": kind,
            "value": value,
            "source": "hindsight-sim",
            "rater": rater,
            "tags": ["simulated"],
        });
        match target {
            Target::Interaction(id) => event["interaction_id"] = json!(id),
            Target::Episode(id) => event["episode_id"] = json!(id),
        }
        event
    };
    let mut events = vec![base("thumbs", json!(reaction.thumbs_up))];
    if let Some(comment) = &reaction.comment {
        events.push(base("comment", json!(comment)));
    }
    if let Some(correction) = &reaction.correction {
        events.push(base(
            "correction",
            json!({"content": answer_layout(correction)}),
        ));
    }
    events
}

/// JSON in the layout the agent's answers have (`{"a": 1, "b": [1, 2]}`, the `json.dumps`
/// style `hindsight serve`'s guided decoding fixes; keys in the schema's order, which for the
/// decision is also key order): a reviewer's correction is the agent's answer with its values
/// fixed, so SFT trains the very tokens the policy emits rather than a compact re-spelling of
/// them (`":"` and `","` tokenize differently from `": "` and `", "`).
pub fn answer_layout(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let members: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), answer_layout(v)))
                .collect();
            format!("{{{}}}", members.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(answer_layout).collect();
            format!("[{}]", items.join(", "))
        }
        scalar => scalar.to_string(),
    }
}

/// A client for the feedback webhook.
#[derive(Debug, Clone)]
pub struct FeedbackSender {
    http: reqwest::Client,
    batch_url: String,
    secret: Option<String>,
    max_retries: u32,
}

impl FeedbackSender {
    /// `base` is the proxy (or `hindsight feedback`) base URL, e.g. `http://127.0.0.1:8080`.
    pub fn new(base: &str, secret: Option<String>, timeout_ms: u64) -> Result<Self, EnvError> {
        let base = base.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(EnvError::Config(format!(
                "feedback endpoint {base:?} must start with http:// or https://"
            )));
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(timeout_ms.max(1)))
            .build()
            .map_err(|e| EnvError::Http(e.to_string()))?;
        Ok(Self {
            http,
            batch_url: format!("{base}{BATCH_PATH}"),
            secret: secret.filter(|s| !s.is_empty()),
            max_retries: 4,
        })
    }

    /// Sends `events` as one signed batch; returns the feedback ids.
    pub async fn send(
        &self,
        events: &[Value],
        idempotency_key: &str,
    ) -> Result<Vec<String>, EnvError> {
        let body = serde_json::to_vec(&json!({ "events": events }))
            .map_err(|e| EnvError::Http(e.to_string()))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = self
                .http
                .post(&self.batch_url)
                .header("content-type", "application/json")
                .header("idempotency-key", idempotency_key)
                .body(body.clone());
            if let Some(secret) = &self.secret {
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                request = request
                    .header("x-hindsight-timestamp", ts.to_string())
                    .header("x-hindsight-signature", sign(secret, ts, &body));
            }
            let retryable = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    if status.is_success() {
                        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                        return Ok(v["feedback_ids"]
                            .as_array()
                            .map(|ids| {
                                ids.iter()
                                    .filter_map(|i| i.as_str().map(str::to_string))
                                    .collect()
                            })
                            .unwrap_or_default());
                    }
                    let err = EnvError::Feedback {
                        status: status.as_u16(),
                        body: text.chars().take(300).collect(),
                    };
                    if !(status.as_u16() == 429 || status.is_server_error())
                        || attempt > self.max_retries
                    {
                        return Err(err);
                    }
                    err
                }
                Err(e) => {
                    let err = EnvError::Http(e.to_string());
                    if attempt > self.max_retries {
                        return Err(err);
                    }
                    err
                }
            };
            tracing::debug!(error = %retryable, attempt, "Retrying feedback webhook.");
            tokio::time::sleep(Duration::from_millis(200 << attempt.min(5))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_a_reference_hmac() {
        // Reference: python3 -c 'import hmac,hashlib;print(hmac.new(b"s3cret",b"1700000000.{}",hashlib.sha256).hexdigest())'
        assert_eq!(
            sign("s3cret", 1_700_000_000, b"{}"),
            "v1=97926816e98fbb41ccb1673225ff29a2f35369099990e1b1561651e7bd097ebf"
        );
    }

    #[test]
    fn corrections_take_the_layout_of_the_agents_answers() {
        let decision = json!({"refund": "none", "department": "retention", "priority": "normal"});
        assert_eq!(
            answer_layout(&decision),
            r#"{"department": "retention", "priority": "normal", "refund": "none"}"#
        );
        assert_eq!(
            answer_layout(&json!({"a": [1, {"b": "x\"y"}], "c": null})),
            r#"{"a": [1, {"b": "x\"y"}], "c": null}"#
        );
        let back: Value = serde_json::from_str(&answer_layout(&decision)).unwrap();
        assert_eq!(back, decision);
    }

    #[test]
    fn events_follow_the_contract() {
        let reaction = Reaction {
            correct: false,
            noisy: false,
            thumbs_up: false,
            comment: Some("Gold customers are always high priority.".into()),
            correction: Some(json!({"priority": "high"})),
            broken_rules: vec![],
        };
        let events = feedback_events(&Target::Interaction("0190-x".into()), &reaction, "C-10001");
        assert_eq!(events.len(), 3);
        assert_eq!(events[0]["kind"], "thumbs");
        assert_eq!(events[0]["value"], false);
        assert_eq!(events[0]["interaction_id"], "0190-x");
        assert_eq!(events[1]["kind"], "comment");
        assert_eq!(events[2]["kind"], "correction");
        assert_eq!(events[2]["value"]["content"], r#"{"priority": "high"}"#);
        let events = feedback_events(&Target::Episode("ep-1".into()), &reaction, "C-10001");
        assert_eq!(events[0]["episode_id"], "ep-1");
        assert!(events[0].get("interaction_id").is_none());
    }
}
