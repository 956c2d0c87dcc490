//! The controller's admin HTTP API: the operator commands of `hindsight rollout` over HTTP,
//! behind a bearer token from config (compared in constant time; a missing or wrong token is
//! a 401; the token is never logged). `/metrics` (Prometheus) needs no token: it holds no
//! secrets and scrapers rarely carry one.
//!
//! - `GET  /v1/rollouts` — every route with the controller's current view;
//! - `GET  /v1/rollouts/{route}/history?limit=N` — the audit trail, newest first;
//! - `POST /v1/rollouts/{route}` — a command: `{"action": "start", "version": "support@4"}`,
//!   `{"action": "kill"}`, `{"action": "pin", "user": "u1", "version": "support@3"}`, ... with
//!   optional `by`, `reason` and `generation` (refused with 409 if the route moved on).
//!
//! Errors use the one Hindsight error body (`{"error": {message, type, param, code}}`).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hindsight_core::error_body;
use hindsight_routing::{RoutingError, RoutingStore};
use serde::Deserialize;
use serde_json::{json, Value};

use super::commands::{self, Actor, Command, CommandError, Outcome};
use super::config::RolloutConfig;
use crate::registry::Registry;

/// What the handlers share.
pub struct AdminState {
    pub store: RoutingStore,
    pub registry: Option<Registry>,
    pub cfg: RolloutConfig,
    pub token: String,
    pub prometheus: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

/// The router.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/rollouts", get(list))
        .route("/v1/rollouts/{route}", post(command))
        .route("/v1/rollouts/{route}/history", get(history))
        .with_state(state)
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

fn authorised(state: &AdminState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !state.token.is_empty() && same(given.as_bytes(), state.token.as_bytes()) {
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

async fn list(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return *r;
    }
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
    headers: HeaderMap,
    Path(route): Path<String>,
    Query(q): Query<HistoryQuery>,
) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return *r;
    }
    match s.store.audit(&route, q.limit.min(10_000)).await {
        Ok(a) => Json(json!({"route": route, "audit": a})).into_response(),
        Err(e) => routing_error(&e),
    }
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
    fn token_comparison_is_exact() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
        assert!(!same(b"", b"x"));
        assert!(same(b"", b""));
    }
}
