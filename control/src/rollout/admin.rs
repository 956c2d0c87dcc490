//! The controller's admin HTTP API and the operator's page. Reading is open: the page, the
//! routes with the controller's view, the audit trail, the adapter registry, the learning curves
//! and the recent feedback's kinds and values (the same numbers `/metrics` already exposes to
//! any scraper; the listener binds loopback by default). Changing anything — the operator
//! commands of `hindsight rollout` — takes the bearer token from config (compared in constant
//! time; a missing or wrong token is a 401; the token is never logged), and so does the free
//! text people wrote in their feedback. With `rollout.open_reads = false` every `/v1/` read
//! takes the token too (for listeners reachable beyond trusted hosts); the page, its script and
//! `/metrics` stay open.
//!
//! - `GET  /` — the operator's page ([`OPERATOR_PAGE`]; its script at `/operator.js`);
//! - `GET  /v1/rollouts` — every route with the controller's current view;
//! - `GET  /v1/rollouts/{route}/history?limit=N` — the audit trail, newest first;
//! - `GET  /v1/adapters` — the adapter registry with lineage (parent, eval results, offsets);
//! - `GET  /v1/learning` — the learner's learning curves, from its run log (`rollout.run_log`);
//! - `GET  /v1/feedback/recent?limit=N` — the last feedback events the controller read;
//! - `POST /v1/rollouts/{route}` — a command: `{"action": "start", "version": "support@4"}`,
//!   `{"action": "kill"}`, `{"action": "pin", "user": "u1", "version": "support@3"}`, ... with
//!   optional `by`, `reason` and `generation` (refused with 409 if the route moved on).
//!
//! Errors use the one Hindsight error body (`{"error": {message, type, param, code}}`).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hindsight_core::error_body;
use hindsight_routing::{RoutingError, RoutingStore};
use serde::Deserialize;
use serde_json::{json, Value};

use super::commands::{self, Actor, Command, CommandError, Outcome};
use super::config::RolloutConfig;
use super::learning;
use super::recent::{RecentFeedback, RECENT_FEEDBACK_KEPT};
use crate::registry::{Registry, VersionEntry};

/// The operator's page: plain HTML, its script served beside it (so the page can forbid inline
/// script), no third-party code.
pub const OPERATOR_PAGE: &str = include_str!("operator.html");
const OPERATOR_SCRIPT: &str = include_str!("operator.js");
/// What the page may do: talk to this listener and nothing else; no inline script, no frames.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; connect-src 'self'; \
     style-src 'unsafe-inline'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";
/// Versions per adapter name `GET /v1/adapters` returns (the newest).
const ADAPTER_VERSIONS_SHOWN: usize = 100;

/// What the handlers share.
pub struct AdminState {
    pub store: RoutingStore,
    pub registry: Option<Registry>,
    pub cfg: RolloutConfig,
    pub token: String,
    pub prometheus: Option<Box<dyn Fn() -> String + Send + Sync>>,
    /// The last feedback events the controller read (empty unless the controller fills it).
    pub recent_feedback: RecentFeedback,
}

/// The router.
pub fn router(state: Arc<AdminState>) -> Router {
    // The data reads: open, or behind the token with `rollout.open_reads = false`.
    let reads = Router::new()
        .route("/v1/rollouts", get(list))
        .route("/v1/rollouts/{route}/history", get(history))
        .route("/v1/adapters", get(adapters))
        .route("/v1/learning", get(learning_curves))
        .route("/v1/feedback/recent", get(recent_feedback))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            reads_allowed,
        ));
    Router::new()
        .route("/", get(page))
        .route("/operator.js", get(script))
        .route("/metrics", get(metrics))
        .route("/v1/rollouts/{route}", post(command))
        .merge(reads)
        .with_state(state)
}

/// Lets a read through when reads are open or it carries the admin token.
async fn reads_allowed(
    State(s): State<Arc<AdminState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if s.cfg.open_reads || has_token(&s, req.headers()) {
        next.run(req).await
    } else {
        error(
            StatusCode::UNAUTHORIZED,
            "reads need the admin token here (rollout.open_reads = false)",
            Some("authorization"),
            "unauthorized",
        )
    }
}

/// Constant-time equality: the time taken does not depend on where the strings differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

fn error(status: StatusCode, message: &str, param: Option<&str>, code: &str) -> Response {
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    (status, Json(error_body(message, kind, param, code))).into_response()
}

/// Whether the request carries the admin token.
fn has_token(state: &AdminState, headers: &HeaderMap) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    !state.token.is_empty() && same(given.as_bytes(), state.token.as_bytes())
}

fn authorised(state: &AdminState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    if has_token(state, headers) {
        Ok(())
    } else {
        Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required (rollout.admin_token)",
            Some("authorization"),
            "unauthorized",
        )))
    }
}

async fn metrics(State(s): State<Arc<AdminState>>) -> Response {
    match &s.prometheus {
        Some(render) => render().into_response(),
        None => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no metrics recorder in this process",
            None,
            "unavailable",
        ),
    }
}

/// A static part of the page, with headers that keep it to itself.
fn page_part(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(PAGE_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

async fn page() -> Response {
    page_part("text/html; charset=utf-8", OPERATOR_PAGE)
}

async fn script() -> Response {
    page_part("text/javascript; charset=utf-8", OPERATOR_SCRIPT)
}

async fn list(State(s): State<Arc<AdminState>>) -> Response {
    let routes = match s.store.load_all().await {
        Ok(r) => r,
        Err(e) => return routing_error(&e),
    };
    let mut out = Vec::new();
    for parsed in routes {
        match parsed {
            Ok(route) => {
                let view = s.store.get_status(&route.route).await.ok().flatten();
                out.push(json!({"route": route, "controller": view}));
            }
            Err(e) => out.push(json!({"malformed": e.to_string()})),
        }
    }
    Json(json!({"routes": out})).into_response()
}

#[derive(Deserialize)]
struct HistoryQuery {
    #[serde(default = "default_limit")]
    limit: usize,
}
fn default_limit() -> usize {
    50
}

async fn history(
    State(s): State<Arc<AdminState>>,
    Path(route): Path<String>,
    Query(q): Query<HistoryQuery>,
) -> Response {
    match s.store.audit(&route, q.limit.min(10_000)).await {
        Ok(a) => Json(json!({"route": route, "audit": a})).into_response(),
        Err(e) => routing_error(&e),
    }
}

/// One registry entry as the page shows it: lineage, data and the gate's headline numbers
/// (the full entry, with the training config and file hashes, is `hindsight adapters show`).
fn adapter_view(e: &VersionEntry) -> Value {
    let eval = e.eval.as_ref().map(|v| {
        json!({
            "verdict": v.get("verdict"),
            "delta": v.get("delta"),
            "margin": v.get("margin"),
            "candidate_exact_match": v.pointer("/candidate/exact_match"),
            "live_exact_match": v.pointer("/live/exact_match"),
            "live_version": v.pointer("/live/version"),
        })
    });
    json!({
        "name": e.name,
        "version": e.version,
        "tag": e.tag(),
        "parent": e.parent,
        "status": e.status,
        "base_model": e.base_model,
        "examples": e.examples,
        "tokens": e.tokens,
        "offsets": e.offsets,
        "eval": eval,
        "created_at_ms": e.created_at_ms,
        "updated_at_ms": e.updated_at_ms,
        "note": e.note,
    })
}

async fn adapters(State(s): State<Arc<AdminState>>) -> Response {
    let Some(reg) = &s.registry else {
        return Json(json!({"adapters": []})).into_response();
    };
    match reg.list(None).await {
        Ok(entries) => {
            // Sorted by name, then version: each name's newest versions are its last ones.
            let mut per_name = std::collections::HashMap::<&str, usize>::new();
            for e in &entries {
                *per_name.entry(e.name.as_str()).or_default() += 1;
            }
            let shown: Vec<Value> = entries
                .iter()
                .filter(|e| {
                    let left = per_name.entry(e.name.as_str()).or_default();
                    *left = left.saturating_sub(1);
                    *left < ADAPTER_VERSIONS_SHOWN
                })
                .map(adapter_view)
                .collect();
            Json(json!({"adapters": shown})).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "The operator page could not read the adapter registry.");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the adapter registry is unavailable",
                None,
                "registry_unavailable",
            )
        }
    }
}

async fn learning_curves(State(s): State<Arc<AdminState>>) -> Response {
    let path = s.cfg.run_log.clone();
    let shown = path.display().to_string();
    match tokio::task::spawn_blocking(move || learning::read(&path)).await {
        Ok(Ok(curve)) => Json(json!({
            "run_log": shown,
            "points": curve.points,
            "candidates": curve.candidates,
        }))
        .into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "The operator page could not read the learner's run log.");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the learner's run log could not be read (see the controller's log)",
                None,
                "run_log_unreadable",
            )
        }
        Err(e) => {
            tracing::warn!(error = %e, "Reading the learner's run log failed.");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the learner's run log could not be read",
                None,
                "run_log_unreadable",
            )
        }
    }
}

#[derive(Deserialize)]
struct RecentQuery {
    #[serde(default = "default_limit")]
    limit: usize,
}

async fn recent_feedback(
    State(s): State<Arc<AdminState>>,
    headers: HeaderMap,
    Query(q): Query<RecentQuery>,
) -> Response {
    let mut events = s.recent_feedback.newest(q.limit.min(RECENT_FEEDBACK_KEPT));
    let hidden = !has_token(&s, &headers);
    if hidden {
        for e in &mut events {
            e.detail = None;
        }
    }
    Json(json!({"feedback": events, "detail_hidden": hidden})).into_response()
}

/// The request body: a command plus who, why and the generation acted on.
#[derive(Deserialize)]
struct CommandBody {
    #[serde(flatten)]
    command: Value,
    #[serde(default)]
    by: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    generation: Option<u64>,
}

async fn command(
    State(s): State<Arc<AdminState>>,
    headers: HeaderMap,
    Path(route): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return *r;
    }
    let parsed: CommandBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("body: {e}"),
                None,
                "invalid_json",
            )
        }
    };
    let mut fields = parsed.command;
    if let Some(o) = fields.as_object_mut() {
        for k in ["by", "reason", "generation"] {
            o.remove(k);
        }
    }
    let cmd: Command = match serde_json::from_value(fields) {
        Ok(c) => c,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                Some("action"),
                "invalid_value",
            )
        }
    };
    let by = format!("operator:{}", parsed.by.as_deref().unwrap_or("admin-api"));
    let reason = parsed.reason.unwrap_or_default();
    let actor = Actor {
        by: &by,
        reason: &reason,
        generation: parsed.generation,
    };
    match commands::run(&s.store, s.registry.as_ref(), &s.cfg, &route, &actor, cmd).await {
        Ok(Outcome::Done { route, audit }) => {
            Json(json!({"route": route, "audit": audit})).into_response()
        }
        Ok(Outcome::Queued { version, behind }) => (
            StatusCode::ACCEPTED,
            Json(json!({"queued": version, "behind": behind})),
        )
            .into_response(),
        Err(CommandError::Routing(e)) => routing_error(&e),
        Err(CommandError::Refused { field, reason }) => {
            error(StatusCode::BAD_REQUEST, &reason, Some(&field), "refused")
        }
        Err(CommandError::Registry(e)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &e.to_string(),
            None,
            "registry_unavailable",
        ),
    }
}

/// The one place a routing error becomes an HTTP response.
fn routing_error(e: &RoutingError) -> Response {
    match e {
        RoutingError::Invalid { field, reason } => error(
            StatusCode::BAD_REQUEST,
            reason,
            Some(field),
            "invalid_value",
        ),
        RoutingError::UnknownRoute(_) => error(
            StatusCode::NOT_FOUND,
            &e.to_string(),
            Some("route"),
            "unknown_route",
        ),
        RoutingError::Conflict { .. } => error(
            StatusCode::CONFLICT,
            &e.to_string(),
            Some("generation"),
            "conflict",
        ),
        RoutingError::Malformed { .. } | RoutingError::Json(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &e.to_string(),
            None,
            "malformed_table",
        ),
        RoutingError::Redis(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &e.to_string(),
            None,
            "redis_unavailable",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_its_own_script_and_inserts_values_as_text_only() {
        assert!(OPERATOR_PAGE.contains(r#"<script src="/operator.js"></script>"#));
        assert!(
            !OPERATOR_PAGE.contains("<script>"),
            "inline script is forbidden"
        );
        for markup in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
        ] {
            assert!(!OPERATOR_SCRIPT.contains(markup), "{markup} in operator.js");
        }
    }

    /// The admin router on a local socket with reads open or closed; its base URL.
    async fn serve(open_reads: bool, token: &str) -> String {
        let store = RoutingStore::new(hindsight_routing::StoreConfig {
            redis_url: std::env::var("REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into()),
            key_prefix: format!("hindsight:test:admin:{}", uuid::Uuid::now_v7()),
            ..Default::default()
        })
        .unwrap();
        let state = Arc::new(AdminState {
            store,
            registry: None,
            cfg: RolloutConfig {
                open_reads,
                ..RolloutConfig::default()
            },
            token: token.into(),
            prometheus: None,
            recent_feedback: RecentFeedback::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router(state)).await });
        base
    }

    const READS: [&str; 5] = [
        "/v1/rollouts",
        "/v1/rollouts/support/history",
        "/v1/adapters",
        "/v1/learning",
        "/v1/feedback/recent",
    ];

    #[tokio::test]
    async fn closed_reads_take_the_token_and_the_page_stays_open() {
        let token = "closed-reads-test-token";
        let base = serve(false, token).await;
        let http = reqwest::Client::new();
        for path in READS {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} without the token");
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"]["param"], "authorization", "{path}: {body}");
            let r = http
                .get(format!("{base}{path}"))
                .bearer_auth("closed-reads-wrong-token")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 401, "{path} with a wrong token");
            // With the token the read runs (the learning curve's run log is absent here: an
            // empty curve, not an error).
            let r = http
                .get(format!("{base}{path}"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
        }
        for path in ["/", "/operator.js"] {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path} stays open");
        }
        // Commands keep their own check.
        let r = http
            .post(format!("{base}/v1/rollouts/support"))
            .json(&json!({"action": "kill"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }

    #[tokio::test]
    async fn open_reads_need_no_token() {
        let base = serve(true, "open-reads-test-token").await;
        let http = reqwest::Client::new();
        for path in READS {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
        }
    }

    #[test]
    fn closed_reads_without_a_token_are_refused_at_start() {
        let cfg = RolloutConfig {
            open_reads: false,
            ..RolloutConfig::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("rollout.open_reads"), "{e}");
    }

    #[test]
    fn token_comparison_is_exact() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
        assert!(!same(b"", b"x"));
        assert!(same(b"", b""));
    }
}
