//! The feedback API: `POST /hindsight/v1/feedback` and `/hindsight/v1/feedback/batch`.
//!
//! Order of checks: content type, body size, signature (when secrets are configured), JSON,
//! event validation (every rejection names the field), then the idempotency key in Redis, and
//! only then are records handed to the record log (never awaited). Every rejection is a 4xx
//! with `{"error": {"field": ..., "reason": ...}}`; the only 5xx is 503 when an
//! `Idempotency-Key` is sent while Redis is unreachable.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::log::{FlushReport, LogHandle, RecordLog, ValidatedLogConfig};
use crate::records::{
    now_ms, Correction, CorrectionMessage, FeedbackRecord, FeedbackTarget, FeedbackValue,
    ToolOutcome, Topic, FEEDBACK_SCHEMA,
};
use crate::redis_conn::LazyRedis;
use crate::signing::{self, Secret, SignatureError, SIGNATURE_HEADER, TIMESTAMP_HEADER};
use crate::FeedbackError;

/// Path of the single-event endpoint.
pub const FEEDBACK_PATH: &str = "/hindsight/v1/feedback";
/// Path of the batch endpoint.
pub const FEEDBACK_BATCH_PATH: &str = "/hindsight/v1/feedback/batch";
/// Header carrying the idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

/// The declared range of a score metric (inclusive).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetricRange {
    /// Smallest allowed value.
    pub min: f64,
    /// Largest allowed value.
    pub max: f64,
}

/// Webhook signing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    /// Active secrets (several during a rotation). Empty = signatures are not required.
    #[serde(default)]
    pub secrets: Vec<Secret>,
    /// How far `x-hindsight-timestamp` may be from now, either way.
    #[serde(default = "default_replay_window_s")]
    pub replay_window_s: u64,
}

impl Default for SigningConfig {
    fn default() -> Self {
        SigningConfig {
            secrets: Vec::new(),
            replay_window_s: default_replay_window_s(),
        }
    }
}

/// Feedback API settings (raw, as read from TOML).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackConfig {
    /// Largest accepted request body.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Longest comment, correction text or tool-outcome detail, in characters.
    #[serde(default = "default_max_text_chars")]
    pub max_text_chars: usize,
    /// Most events in one batch.
    #[serde(default = "default_max_batch_events")]
    pub max_batch_events: usize,
    /// Most tags on one event.
    #[serde(default = "default_max_tags")]
    pub max_tags: usize,
    /// Longest id, metric, source, rater or tag, in characters.
    #[serde(default = "default_max_name_chars")]
    pub max_name_chars: usize,
    /// Score metrics and their ranges; a score must name one of them.
    #[serde(default = "default_metrics")]
    pub metrics: BTreeMap<String, MetricRange>,
    /// Webhook signing.
    #[serde(default)]
    pub signing: SigningConfig,
    /// Redis used for idempotency keys.
    #[serde(default = "default_redis_url")]
    pub redis_url: String,
    /// Prefix of idempotency keys in Redis.
    #[serde(default = "default_redis_key_prefix")]
    pub redis_key_prefix: String,
    /// How long an idempotency key is remembered.
    #[serde(default = "default_idempotency_ttl_s")]
    pub idempotency_ttl_s: u64,
}

fn default_replay_window_s() -> u64 {
    300
}
fn default_max_body_bytes() -> usize {
    256 * 1024
}
fn default_max_text_chars() -> usize {
    16 * 1024
}
fn default_max_batch_events() -> usize {
    100
}
fn default_max_tags() -> usize {
    16
}
fn default_max_name_chars() -> usize {
    256
}
fn default_metrics() -> BTreeMap<String, MetricRange> {
    BTreeMap::from([("quality".to_string(), MetricRange { min: 0.0, max: 1.0 })])
}
fn default_redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}
fn default_redis_key_prefix() -> String {
    "hindsight:idem:".into()
}
fn default_idempotency_ttl_s() -> u64 {
    24 * 3600
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig {
            max_body_bytes: default_max_body_bytes(),
            max_text_chars: default_max_text_chars(),
            max_batch_events: default_max_batch_events(),
            max_tags: default_max_tags(),
            max_name_chars: default_max_name_chars(),
            metrics: default_metrics(),
            signing: SigningConfig::default(),
            redis_url: default_redis_url(),
            redis_key_prefix: default_redis_key_prefix(),
            idempotency_ttl_s: default_idempotency_ttl_s(),
        }
    }
}

fn bad(key: &str, reason: impl Into<String>) -> FeedbackError {
    FeedbackError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

impl FeedbackConfig {
    /// Checks every value once.
    pub fn validate(self) -> Result<ValidatedFeedbackConfig, FeedbackError> {
        if self.max_body_bytes < 256 {
            return Err(bad("max_body_bytes", "must be at least 256"));
        }
        for (key, v) in [
            ("max_text_chars", self.max_text_chars),
            ("max_batch_events", self.max_batch_events),
            ("max_name_chars", self.max_name_chars),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1"));
            }
        }
        for (name, r) in &self.metrics {
            if !(r.min.is_finite() && r.max.is_finite() && r.min <= r.max) {
                return Err(bad(
                    &format!("metrics.{name}"),
                    "min and max must be finite with min <= max",
                ));
            }
        }
        if self.signing.secrets.iter().any(Secret::is_empty) {
            return Err(bad("signing.secrets", "a secret must not be empty"));
        }
        if self.signing.replay_window_s == 0 {
            return Err(bad("signing.replay_window_s", "must be at least 1"));
        }
        if redis::Client::open(self.redis_url.as_str()).is_err() {
            return Err(bad("redis_url", "is not a valid redis:// URL"));
        }
        if self.idempotency_ttl_s == 0 {
            return Err(bad("idempotency_ttl_s", "must be at least 1"));
        }
        Ok(ValidatedFeedbackConfig { raw: self })
    }
}

/// A checked [`FeedbackConfig`].
#[derive(Debug, Clone)]
pub struct ValidatedFeedbackConfig {
    raw: FeedbackConfig,
}

impl ValidatedFeedbackConfig {
    /// The config as given.
    pub fn raw(&self) -> &FeedbackConfig {
        &self.raw
    }
}

/// Shared state of the feedback endpoints.
#[derive(Clone)]
pub struct FeedbackState {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ValidatedFeedbackConfig,
    log: LogHandle,
    redis: LazyRedis,
}

impl std::fmt::Debug for FeedbackState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedbackState")
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl FeedbackState {
    /// Builds the state; Redis is connected lazily on the first idempotent request.
    pub fn new(
        cfg: ValidatedFeedbackConfig,
        log: LogHandle,
    ) -> Result<FeedbackState, FeedbackError> {
        let redis =
            LazyRedis::new(&cfg.raw.redis_url).map_err(|e| bad("redis_url", e.to_string()))?;
        Ok(FeedbackState {
            inner: Arc::new(Inner { cfg, log, redis }),
        })
    }
}

/// The feedback routes, ready to be merged into the proxy's router.
pub fn feedback_router(state: FeedbackState) -> Router {
    Router::new()
        .route(FEEDBACK_PATH, post(post_one))
        .route(FEEDBACK_BATCH_PATH, post(post_batch))
        .with_state(state)
}

/// Runs the feedback API standalone (`hindsight feedback`): starts a record log, serves until
/// `shutdown` resolves, then flushes the log (10 s deadline).
pub async fn serve_feedback<F>(
    cfg: ValidatedFeedbackConfig,
    log_cfg: ValidatedLogConfig,
    listener: tokio::net::TcpListener,
    shutdown: F,
) -> Result<FlushReport, FeedbackError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (log, handle) = RecordLog::start(log_cfg).await?;
    let state = FeedbackState::new(cfg, handle)?;
    let app = feedback_router(state)
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "path", "no such endpoint").into_response()
        });
    info!(addr = ?listener.local_addr().ok(), "Feedback API listening.");
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    let report = log.shutdown(Duration::from_secs(10)).await;
    served.map_err(FeedbackError::Io)?;
    Ok(report)
}

/// A rejected request: status plus the field and reason shown to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    field: String,
    reason: String,
}

impl ApiError {
    fn new(status: StatusCode, field: impl Into<String>, reason: impl Into<String>) -> ApiError {
        ApiError {
            status,
            field: field.into(),
            reason: reason.into(),
        }
    }

    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, field, reason)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        metrics::counter!("hindsight_feedback_rejected_total", "status" => status_label(self.status))
            .increment(1);
        debug!(status = self.status.as_u16(), field = %self.field, reason = %self.reason, "Feedback rejected.");
        (
            self.status,
            Json(hindsight_core::error_body(
                &self.reason,
                if self.status.is_server_error() {
                    "server_error"
                } else {
                    "invalid_request_error"
                },
                Some(&self.field),
                error_code(self.status),
            )),
        )
            .into_response()
    }
}

/// The `code` of the error body: what kind of refusal, stable for clients to branch on.
fn error_code(s: StatusCode) -> &'static str {
    match s.as_u16() {
        400 => "bad_request",
        401 => "unauthorized",
        404 => "not_found",
        409 => "conflict",
        413 => "too_large",
        415 => "unsupported_media_type",
        422 => "invalid_value",
        503 => "unavailable",
        _ => "error",
    }
}

fn status_label(s: StatusCode) -> &'static str {
    match s.as_u16() {
        400 => "400",
        401 => "401",
        404 => "404",
        413 => "413",
        415 => "415",
        422 => "422",
        503 => "503",
        _ => "other",
    }
}

async fn post_one(State(st): State<FeedbackState>, req: Request) -> Response {
    handle(st, req, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn post_batch(State(st): State<FeedbackState>, req: Request) -> Response {
    handle(st, req, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, name, "must be visible ASCII")),
    }
}

async fn handle(st: FeedbackState, req: Request, batch: bool) -> Result<Response, ApiError> {
    let cfg = &st.inner.cfg.raw;
    let (parts, body) = req.into_parts();
    if let Some(ct) = header(&parts.headers, "content-type")? {
        if !ct.to_ascii_lowercase().contains("json") {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "content-type",
                "must be application/json",
            ));
        }
    }
    let too_big = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body",
            format!("larger than {} bytes", cfg.max_body_bytes),
        )
    };
    if let Some(len) = header(&parts.headers, "content-length")? {
        match len.trim().parse::<u64>() {
            Ok(n) if n > cfg.max_body_bytes as u64 => return Err(too_big()),
            Ok(_) => {}
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "content-length",
                    "must be a number of bytes",
                ))
            }
        }
    }
    let raw = read_body(body, cfg.max_body_bytes)
        .await
        .map_err(|e| match e {
            BodyFail::TooBig => too_big(),
            BodyFail::Broken => ApiError::new(StatusCode::BAD_REQUEST, "body", "could not be read"),
        })?;
    if !cfg.signing.secrets.is_empty() {
        let now_s = now_ms() / 1000;
        signing::verify(
            &cfg.signing.secrets,
            cfg.signing.replay_window_s,
            now_s,
            header(&parts.headers, TIMESTAMP_HEADER)?,
            header(&parts.headers, SIGNATURE_HEADER)?,
            &raw,
        )
        .map_err(|e| {
            let field = match e {
                SignatureError::Missing(h) => h,
                SignatureError::BadTimestamp | SignatureError::Stale { .. } => TIMESTAMP_HEADER,
                SignatureError::Mismatch => SIGNATURE_HEADER,
            };
            let reason = match e {
                SignatureError::Missing(_) => {
                    "missing; this endpoint requires signed requests".into()
                }
                other => other.to_string(),
            };
            ApiError::new(StatusCode::UNAUTHORIZED, field, reason)
        })?;
    }
    let idem_key = match header(&parts.headers, IDEMPOTENCY_HEADER)? {
        None => None,
        Some(k) if k.is_empty() || k.len() > 255 => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "Idempotency-Key",
                "must be 1 to 255 characters",
            ))
        }
        Some(k) => Some(k.to_string()),
    };
    let value: Value = serde_json::from_slice(&raw).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "body",
            format!("invalid JSON: {e}"),
        )
    })?;
    let now = now_ms();
    let records = if batch {
        let obj = value
            .as_object()
            .ok_or_else(|| ApiError::invalid("body", "must be an object {\"events\": [...]}"))?;
        if let Some(k) = obj.keys().find(|k| k.as_str() != "events") {
            return Err(ApiError::invalid(k.as_str(), "unknown field"));
        }
        let events = obj
            .get("events")
            .ok_or_else(|| ApiError::invalid("events", "missing"))?
            .as_array()
            .ok_or_else(|| ApiError::invalid("events", "must be an array"))?;
        if events.is_empty() {
            return Err(ApiError::invalid("events", "must not be empty"));
        }
        if events.len() > cfg.max_batch_events {
            return Err(ApiError::invalid(
                "events",
                format!("more than {} events", cfg.max_batch_events),
            ));
        }
        events
            .iter()
            .enumerate()
            .map(|(i, e)| parse_event(cfg, e, &format!("events[{i}]."), now))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![parse_event(cfg, &value, "", now)?]
    };
    let ids: Vec<Uuid> = records.iter().map(|r| r.feedback_id).collect();
    let answer = if batch {
        json!({ "feedback_ids": ids })
    } else {
        json!({ "feedback_id": ids[0] })
    };
    if let Some(key) = idem_key {
        let fingerprint = {
            let mut h = Sha256::new();
            h.update(if batch { b"batch" as &[u8] } else { b"one" });
            h.update(&raw);
            hex::encode(h.finalize())
        };
        let stored = json!({"fp": fingerprint, "status": 202, "body": answer});
        match remember_once(&st, &key, &stored.to_string()).await? {
            None => {}
            Some(prev) => return replay_answer(&prev, &fingerprint),
        }
    }
    for rec in &records {
        metrics::counter!("hindsight_feedback_events_total", "kind" => rec.value.kind())
            .increment(1);
        st.inner
            .log
            .submit_json(Topic::Feedback, rec.target.key(), rec.feedback_id, rec);
    }
    Ok((StatusCode::ACCEPTED, Json(answer)).into_response())
}

enum BodyFail {
    TooBig,
    Broken,
}

async fn read_body(body: Body, max: usize) -> Result<bytes::Bytes, BodyFail> {
    let limited = http_body_util::Limited::new(body, max);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(BodyFail::TooBig)
            } else {
                Err(BodyFail::Broken)
            }
        }
    }
}

/// Stores the answer under the key unless the key exists; returns the earlier answer if it did.
async fn remember_once(
    st: &FeedbackState,
    key: &str,
    answer: &str,
) -> Result<Option<String>, ApiError> {
    let unavailable = |e: redis::RedisError| {
        warn!(error = %e, "Idempotency store unavailable.");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Idempotency-Key",
            "idempotency store unavailable; retry later",
        )
    };
    let cfg = &st.inner.cfg.raw;
    let mut conn = st.inner.redis.get().await.map_err(unavailable)?;
    let rkey = format!("{}{}", cfg.redis_key_prefix, key);
    let set: Option<String> = redis::cmd("SET")
        .arg(&rkey)
        .arg(answer)
        .arg("NX")
        .arg("EX")
        .arg(cfg.idempotency_ttl_s)
        .query_async(&mut conn)
        .await
        .map_err(unavailable)?;
    if set.is_some() {
        return Ok(None);
    }
    let prev: Option<String> = redis::cmd("GET")
        .arg(&rkey)
        .query_async(&mut conn)
        .await
        .map_err(unavailable)?;
    Ok(Some(prev.unwrap_or_default()))
}

fn replay_answer(prev: &str, fingerprint: &str) -> Result<Response, ApiError> {
    let v: Value = serde_json::from_str(prev).unwrap_or(Value::Null);
    if v["fp"].as_str() != Some(fingerprint) {
        return Err(ApiError::invalid(
            "Idempotency-Key",
            "already used for a different request body",
        ));
    }
    let status = v["status"]
        .as_u64()
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
        .unwrap_or(StatusCode::ACCEPTED);
    let mut resp = (status, Json(v["body"].clone())).into_response();
    resp.headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    Ok(resp)
}

const EVENT_FIELDS: &[&str] = &[
    "interaction_id",
    "episode_id",
    "kind",
    "value",
    "metric",
    "source",
    "rater",
    "tags",
    "retracts",
];

fn opt_name(
    obj: &Map<String, Value>,
    key: &str,
    p: &str,
    max: usize,
) -> Result<Option<String>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            check_text(s, &format!("{p}{key}"), max)?;
            if s.is_empty() {
                return Err(ApiError::invalid(format!("{p}{key}"), "must not be empty"));
            }
            Ok(Some(s.clone()))
        }
        Some(_) => Err(ApiError::invalid(format!("{p}{key}"), "must be a string")),
    }
}

fn check_text(s: &str, field: &str, max: usize) -> Result<(), ApiError> {
    if s.chars().count() > max {
        return Err(ApiError::invalid(
            field,
            format!("longer than {max} characters"),
        ));
    }
    Ok(())
}

fn parse_uuid(v: &Value, field: &str) -> Result<Uuid, ApiError> {
    v.as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or_else(|| ApiError::invalid(field, "must be a UUID string"))
}

/// Validates one event into a record (with a fresh feedback id).
fn parse_event(
    cfg: &FeedbackConfig,
    v: &Value,
    p: &str,
    now: i64,
) -> Result<FeedbackRecord, ApiError> {
    let field = |k: &str| format!("{p}{k}");
    let obj = v.as_object().ok_or_else(|| {
        ApiError::invalid(
            if p.is_empty() {
                "body".to_string()
            } else {
                p.trim_end_matches('.').to_string()
            },
            "must be a JSON object",
        )
    })?;
    if let Some(k) = obj.keys().find(|k| !EVENT_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::invalid(field(k), "unknown field"));
    }
    let target = parse_target(cfg, obj, p)?;
    let kind = obj
        .get("kind")
        .ok_or_else(|| ApiError::invalid(field("kind"), "missing"))?
        .as_str()
        .ok_or_else(|| ApiError::invalid(field("kind"), "must be a string"))?;
    let metric = opt_name(obj, "metric", p, cfg.max_name_chars)?;
    if metric.is_some() && kind != "score" {
        return Err(ApiError::invalid(
            field("metric"),
            "only allowed with kind score",
        ));
    }
    let retracts = match obj.get("retracts") {
        None | Some(Value::Null) => None,
        Some(r) => Some(parse_uuid(r, &field("retracts"))?),
    };
    let fv = parse_value(
        cfg,
        kind,
        obj.get("value"),
        metric.as_deref(),
        retracts.is_some(),
        p,
    )?;
    let tags = parse_tags(cfg, obj.get("tags"), p)?;
    Ok(FeedbackRecord {
        schema: FEEDBACK_SCHEMA.to_string(),
        feedback_id: Uuid::now_v7(),
        target,
        value: fv,
        metric,
        source: opt_name(obj, "source", p, cfg.max_name_chars)?,
        rater: opt_name(obj, "rater", p, cfg.max_name_chars)?,
        tags,
        retracts,
        event_time_ms: now,
    })
}

/// What an event is about: exactly one of `interaction_id` (a UUID) and `episode_id` (a name).
fn parse_target(
    cfg: &FeedbackConfig,
    obj: &Map<String, Value>,
    p: &str,
) -> Result<FeedbackTarget, ApiError> {
    let field = |k: &str| format!("{p}{k}");
    Ok(match (obj.get("interaction_id"), obj.get("episode_id")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                field("episode_id"),
                "give either interaction_id or episode_id, not both",
            ))
        }
        (Some(i), None) => FeedbackTarget::Interaction(parse_uuid(i, &field("interaction_id"))?),
        (None, Some(_)) => match opt_name(obj, "episode_id", p, cfg.max_name_chars)? {
            Some(e) => FeedbackTarget::Episode(e),
            None => return Err(ApiError::invalid(field("episode_id"), "must be a string")),
        },
        (None, None) => {
            return Err(ApiError::invalid(
                field("interaction_id"),
                "missing: give interaction_id or episode_id",
            ))
        }
    })
}

/// An event's `value` as its `kind` requires: a boolean for thumbs, a number within the
/// declared `metric`'s range for score, text for comment, a correction, a tool outcome, or
/// nothing for a retraction (which needs `retracts`, `has_retracts`).
fn parse_value(
    cfg: &FeedbackConfig,
    kind: &str,
    value: Option<&Value>,
    metric: Option<&str>,
    has_retracts: bool,
    p: &str,
) -> Result<FeedbackValue, ApiError> {
    let field = |k: &str| format!("{p}{k}");
    let need = |what: &str| ApiError::invalid(field("value"), what.to_string());
    Ok(match kind {
        "thumbs" => FeedbackValue::Thumbs(
            value
                .and_then(Value::as_bool)
                .ok_or_else(|| need("must be true or false for kind thumbs"))?,
        ),
        "score" => {
            let x = value
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite())
                .ok_or_else(|| need("must be a number for kind score"))?;
            let m = metric.ok_or_else(|| {
                ApiError::invalid(field("metric"), "missing: kind score needs a metric")
            })?;
            let range = cfg.metrics.get(m).ok_or_else(|| {
                ApiError::invalid(field("metric"), format!("undeclared metric `{m}`"))
            })?;
            if x < range.min || x > range.max {
                return Err(need(&format!(
                    "outside the range [{}, {}] of metric `{m}`",
                    range.min, range.max
                )));
            }
            FeedbackValue::Score(x)
        }
        "comment" => {
            let s = value
                .and_then(Value::as_str)
                .ok_or_else(|| need("must be a string for kind comment"))?;
            if s.trim().is_empty() {
                return Err(need("must not be empty"));
            }
            check_text(s, &field("value"), cfg.max_text_chars)?;
            FeedbackValue::Comment(s.to_string())
        }
        "correction" => FeedbackValue::Correction(parse_correction(cfg, value, &field("value"))?),
        "tool_outcome" => {
            FeedbackValue::ToolOutcome(parse_tool_outcome(cfg, value, &field("value"))?)
        }
        "retraction" => {
            if value.is_some_and(|v| !v.is_null()) {
                return Err(need("must be absent for kind retraction"));
            }
            if !has_retracts {
                return Err(ApiError::invalid(
                    field("retracts"),
                    "missing: kind retraction needs retracts",
                ));
            }
            FeedbackValue::Retraction
        }
        _ => {
            return Err(ApiError::invalid(
                field("kind"),
                "must be one of thumbs, score, comment, correction, tool_outcome, retraction",
            ))
        }
    })
}

/// An event's `tags`: at most `max_tags` strings of at most `max_name_chars` (none when
/// absent or null).
fn parse_tags(
    cfg: &FeedbackConfig,
    tags: Option<&Value>,
    p: &str,
) -> Result<Vec<String>, ApiError> {
    let field = |k: &str| format!("{p}{k}");
    Ok(match tags {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            if a.len() > cfg.max_tags {
                return Err(ApiError::invalid(
                    field("tags"),
                    format!("more than {} tags", cfg.max_tags),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, t)| {
                    let f = format!("{p}tags[{i}]");
                    let s = t
                        .as_str()
                        .ok_or_else(|| ApiError::invalid(&f, "must be a string"))?;
                    check_text(s, &f, cfg.max_name_chars)?;
                    Ok(s.to_string())
                })
                .collect::<Result<Vec<_>, ApiError>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                field("tags"),
                "must be an array of strings",
            ))
        }
    })
}

fn parse_correction(
    cfg: &FeedbackConfig,
    v: Option<&Value>,
    f: &str,
) -> Result<Correction, ApiError> {
    match v {
        Some(Value::String(s)) => {
            if s.trim().is_empty() {
                return Err(ApiError::invalid(f, "must not be empty"));
            }
            check_text(s, f, cfg.max_text_chars)?;
            Ok(Correction::Text(s.clone()))
        }
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "content" | "tool_calls" | "role")) {
                return Err(ApiError::invalid(format!("{f}.{k}"), "unknown field"));
            }
            if let Some(r) = o.get("role") {
                if r.as_str() != Some("assistant") {
                    return Err(ApiError::invalid(format!("{f}.role"), "must be \"assistant\""));
                }
            }
            let content = match o.get("content") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => {
                    check_text(s, &format!("{f}.content"), cfg.max_text_chars)?;
                    Some(s.clone())
                }
                Some(_) => return Err(ApiError::invalid(format!("{f}.content"), "must be a string or null")),
            };
            let tool_calls = match o.get("tool_calls") {
                None | Some(Value::Null) => None,
                Some(Value::Array(a)) => {
                    for (i, c) in a.iter().enumerate() {
                        let cf = format!("{f}.tool_calls[{i}]");
                        let co = c.as_object().ok_or_else(|| ApiError::invalid(&cf, "must be an object"))?;
                        let func = co
                            .get("function")
                            .and_then(Value::as_object)
                            .ok_or_else(|| ApiError::invalid(format!("{cf}.function"), "must be an object with name and arguments"))?;
                        if !func.get("name").is_some_and(Value::is_string) {
                            return Err(ApiError::invalid(format!("{cf}.function.name"), "must be a string"));
                        }
                    }
                    let size = serde_json::to_string(a).map(|s| s.len()).unwrap_or(usize::MAX);
                    if size > cfg.max_text_chars {
                        return Err(ApiError::invalid(format!("{f}.tool_calls"), format!("longer than {} characters", cfg.max_text_chars)));
                    }
                    Some(a.clone())
                }
                Some(_) => return Err(ApiError::invalid(format!("{f}.tool_calls"), "must be an array")),
            };
            if content.as_deref().is_none_or(|c| c.trim().is_empty()) && tool_calls.as_ref().is_none_or(Vec::is_empty) {
                return Err(ApiError::invalid(f, "needs content or tool_calls"));
            }
            Ok(Correction::Message(CorrectionMessage { content, tool_calls }))
        }
        _ => Err(ApiError::invalid(
            f,
            "must be a string or an assistant message {\"content\", \"tool_calls\"} for kind correction",
        )),
    }
}

fn parse_tool_outcome(
    cfg: &FeedbackConfig,
    v: Option<&Value>,
    f: &str,
) -> Result<ToolOutcome, ApiError> {
    let o = v.and_then(Value::as_object).ok_or_else(|| {
        ApiError::invalid(f, "must be {\"success\": bool, \"detail\": str, \"tool_call_id\"?: str} for kind tool_outcome")
    })?;
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "success" | "detail" | "tool_call_id"))
    {
        return Err(ApiError::invalid(format!("{f}.{k}"), "unknown field"));
    }
    let success = o
        .get("success")
        .and_then(Value::as_bool)
        .ok_or_else(|| ApiError::invalid(format!("{f}.success"), "must be true or false"))?;
    let detail = match o.get("detail") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => {
            check_text(s, &format!("{f}.detail"), cfg.max_text_chars)?;
            s.clone()
        }
        Some(_) => return Err(ApiError::invalid(format!("{f}.detail"), "must be a string")),
    };
    let tool_call_id = opt_name(o, "tool_call_id", &format!("{f}."), cfg.max_name_chars)?;
    Ok(ToolOutcome {
        success,
        detail,
        tool_call_id,
    })
}

#[cfg(test)]
mod tests;
