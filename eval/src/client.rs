//! A small OpenAI-compatible chat client: `POST {endpoint}/chat/completions` with retries on
//! 429/503 (and other transient failures) that honour `Retry-After`.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, RETRY_AFTER};
use reqwest::StatusCode;
use serde_json::Value;
use tracing::debug;

use crate::error::EvalError;

/// Response header naming the adapter version that served a request (set by the proxy/serve).
pub use hindsight_core::headers::ADAPTER as ADAPTER_HEADER;
/// Response header carrying the proxy's interaction id.
pub use hindsight_core::headers::INTERACTION_ID as INTERACTION_HEADER;
/// Longest `Retry-After` wait honoured; longer values are clamped.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// Retries of plain transport errors (refused connections): few, so a wrong endpoint fails fast.
const MAX_TRANSPORT_RETRIES: u32 = 2;

/// One successful chat completion.
#[derive(Debug, Clone)]
pub struct ChatResponse {
    /// The response body.
    pub body: Value,
    /// `x-hindsight-adapter` header, else the body's `model` field.
    pub adapter: Option<String>,
    /// `x-hindsight-interaction-id` header, when a Hindsight proxy answered.
    pub interaction_id: Option<String>,
    /// How many attempts it took (1 = no retry).
    pub attempts: u32,
}

impl ChatResponse {
    /// The first choice's message (`choices[0].message`), or `null`.
    pub fn message(&self) -> &Value {
        &self.body["choices"][0]["message"]
    }

    /// The first choice's text: a string `content`, or the text parts of an array `content`.
    pub fn content(&self) -> String {
        message_text(self.message())
    }

    /// The first choice's tool calls (empty when none).
    pub fn tool_calls(&self) -> Vec<Value> {
        self.message()["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// The text of an assistant message's `content` (string, or array of `{"type":"text"}` parts).
pub fn message_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Why a call failed after its retries.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    /// The server answered with a non-success status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The request did not complete (connect, timeout, reset).
    #[error("transport: {0}")]
    Transport(String),
    /// The server answered 2xx with a body that is not JSON.
    #[error("invalid response body: {0}")]
    InvalidBody(String),
}

/// An OpenAI-compatible chat client bound to one endpoint.
#[derive(Debug, Clone)]
pub struct ChatClient {
    http: reqwest::Client,
    url: String,
    endpoint: String,
    max_retries: u32,
    headers: HeaderMap,
}

impl ChatClient {
    /// `endpoint` is the API base (e.g. `http://127.0.0.1:8080/v1`); requests go to
    /// `{endpoint}/chat/completions`. `headers` are sent with every request.
    pub fn new(
        endpoint: &str,
        api_key: Option<&str>,
        timeout_ms: u64,
        max_retries: u32,
        headers: &[(String, String)],
    ) -> Result<Self, EvalError> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(EvalError::InvalidConfig {
                field: "endpoint",
                reason: format!("{endpoint:?} must start with http:// or https://"),
            });
        }
        let mut map = HeaderMap::new();
        if let Some(key) = api_key.filter(|k| !k.is_empty()) {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                EvalError::InvalidConfig {
                    field: "api_key",
                    reason: "contains characters not allowed in a header".into(),
                }
            })?;
            value.set_sensitive(true);
            map.insert(AUTHORIZATION, value);
        }
        for (name, value) in headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| EvalError::InvalidConfig {
                    field: "header",
                    reason: format!("{name:?} is not a valid header name"),
                })?;
            let value = HeaderValue::from_str(value).map_err(|_| EvalError::InvalidConfig {
                field: "header",
                reason: format!("value of {name} is not a valid header value"),
            })?;
            map.insert(name, value);
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(timeout_ms.max(1)))
            .build()
            .map_err(EvalError::Client)?;
        Ok(Self {
            http,
            url: format!("{endpoint}/chat/completions"),
            endpoint,
            max_retries,
            headers: map,
        })
    }

    /// The API base this client calls.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends one chat completion request, retrying transient failures.
    pub async fn complete(&self, body: &Value) -> Result<ChatResponse, CallError> {
        self.complete_with_headers(body, &[]).await
    }

    /// Like [`ChatClient::complete`] with extra per-request headers (e.g. `x-hindsight-episode`).
    pub async fn complete_with_headers(
        &self,
        body: &Value,
        headers: &[(&str, String)],
    ) -> Result<ChatResponse, CallError> {
        let mut attempt: u32 = 0;
        let mut transport_failures: u32 = 0;
        loop {
            attempt += 1;
            let mut request = self
                .http
                .post(&self.url)
                .headers(self.headers.clone())
                .json(body);
            for (name, value) in headers {
                request = request.header(*name, value.as_str());
            }
            let wait = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    if status.is_success() {
                        return read_success(response, attempt).await;
                    }
                    let retry_after = retry_after(response.headers());
                    let text = response.text().await.unwrap_or_default();
                    let error = CallError::Status {
                        status: status.as_u16(),
                        body: text.chars().take(500).collect(),
                    };
                    if !is_retryable(status) || attempt > self.max_retries {
                        return Err(error);
                    }
                    debug!(
                        status = status.as_u16(),
                        attempt, "Retrying chat completion."
                    );
                    retry_after.unwrap_or_else(|| backoff(attempt))
                }
                Err(e) => {
                    transport_failures += 1;
                    let error = CallError::Transport(e.to_string());
                    if transport_failures > MAX_TRANSPORT_RETRIES.min(self.max_retries) {
                        return Err(error);
                    }
                    debug!(error = %e, attempt, "Retrying chat completion after transport error.");
                    backoff(attempt)
                }
            };
            tokio::time::sleep(wait).await;
        }
    }
}

async fn read_success(
    response: reqwest::Response,
    attempts: u32,
) -> Result<ChatResponse, CallError> {
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let adapter_header = header(ADAPTER_HEADER);
    let interaction_id = header(INTERACTION_HEADER);
    let bytes = response
        .bytes()
        .await
        .map_err(|e| CallError::Transport(e.to_string()))?;
    let body: Value =
        serde_json::from_slice(&bytes).map_err(|e| CallError::InvalidBody(e.to_string()))?;
    let adapter = adapter_header.or_else(|| body["model"].as_str().map(str::to_string));
    Ok(ChatResponse {
        body,
        adapter,
        interaction_id,
        attempts,
    })
}

fn is_retryable(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::BAD_GATEWAY
            | StatusCode::GATEWAY_TIMEOUT
    )
}

/// `Retry-After` in (possibly fractional) seconds; HTTP dates fall back to backoff.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let raw = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let secs: f64 = raw.parse().ok()?;
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    Some(Duration::from_secs_f64(secs).min(MAX_RETRY_AFTER))
}

fn backoff(attempt: u32) -> Duration {
    let ms = 250u64.saturating_mul(1u64 << attempt.min(5));
    Duration::from_millis(ms.min(8_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_parses_seconds_and_clamps() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("0.5"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(500)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("3600"));
        assert_eq!(retry_after(&h), Some(MAX_RETRY_AFTER));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn rejects_endpoints_without_scheme() {
        assert!(ChatClient::new("localhost:8080/v1", None, 1000, 1, &[]).is_err());
        assert!(ChatClient::new("http://localhost:8080/v1/", None, 1000, 1, &[]).is_ok());
    }

    #[test]
    fn message_text_reads_strings_and_parts() {
        let m = serde_json::json!({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(message_text(&m), "ab");
        assert_eq!(message_text(&serde_json::json!({"content": null})), "");
    }
}
