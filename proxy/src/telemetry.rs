//! Request telemetry (a tower layer: span, counters, latency and the proxy's own overhead)
//! and the admin listener (`/metrics`, `/healthz`, `/readyz`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::{extract::State, http::StatusCode, routing::get, Router};
use http::{Request, Response};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing::Instrument;

use crate::error::{ProxyBody, ProxyError};
use crate::forward::UpstreamLatency;

static PROMETHEUS: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide Prometheus recorder once and returns its handle (`None` when
/// another recorder was installed first, e.g. by an embedding application).
pub fn prometheus() -> Option<PrometheusHandle> {
    PROMETHEUS
        .get_or_init(|| {
            let buckets = [
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0,
            ];
            PrometheusBuilder::new()
                .set_buckets(&buckets)
                .ok()?
                .install_recorder()
                .ok()
        })
        .clone()
}

const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Metric handles registered once per route, so the request path only bumps atomics (no
/// label formatting or registry lookups per request).
struct RouteMetrics {
    requests: [metrics::Counter; 5],
    headers_seconds: [metrics::Histogram; 5],
    overhead_seconds: metrics::Histogram,
}

impl RouteMetrics {
    fn new(route: &str) -> Self {
        let route = route.to_string();
        let per_class = |name: &'static str| {
            STATUS_CLASSES.map(
                |class| metrics::counter!(name, "route" => route.clone(), "status_class" => class),
            )
        };
        let per_class_hist = |name: &'static str| {
            STATUS_CLASSES.map(|class| {
                metrics::histogram!(name, "route" => route.clone(), "status_class" => class)
            })
        };
        Self {
            requests: per_class("hindsight_proxy_requests_total"),
            headers_seconds: per_class_hist("hindsight_proxy_response_headers_seconds"),
            overhead_seconds: metrics::histogram!("hindsight_proxy_overhead_seconds", "route" => route.clone()),
        }
    }
}

/// Layer recording one span and the request metrics per call.
#[derive(Clone)]
pub struct TelemetryLayer {
    metrics: Arc<RouteMetrics>,
}

impl TelemetryLayer {
    pub fn new(route: &str) -> Self {
        Self {
            metrics: Arc::new(RouteMetrics::new(route)),
        }
    }
}

impl<S> tower::Layer<S> for TelemetryLayer {
    type Service = Telemetry<S>;
    fn layer(&self, inner: S) -> Telemetry<S> {
        Telemetry {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Telemetry<S> {
    inner: S,
    metrics: Arc<RouteMetrics>,
}

/// Index into [`STATUS_CLASSES`].
fn status_class(status: u16) -> usize {
    match status {
        100..=199 => 0,
        200..=299 => 1,
        300..=399 => 2,
        400..=499 => 3,
        _ => 4,
    }
}

impl<S, B> tower::Service<Request<B>> for Telemetry<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = ProxyError>,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let started = Instant::now();
        let span = tracing::info_span!("request", method = %req.method(), path = %req.uri().path());
        let fut = self.inner.call(req);
        let m = self.metrics.clone();
        Box::pin(
            async move {
                let result = fut.await;
                let elapsed = started.elapsed();
                let status = match &result {
                    Ok(r) => r.status().as_u16(),
                    Err(e) => e.status().as_u16(),
                };
                let class = status_class(status);
                m.requests[class].increment(1);
                m.headers_seconds[class].record(elapsed.as_secs_f64());
                if let Ok(resp) = &result {
                    if let Some(UpstreamLatency(up)) = resp.extensions().get::<UpstreamLatency>() {
                        m.overhead_seconds
                            .record(elapsed.saturating_sub(*up).as_secs_f64());
                    }
                }
                tracing::debug!(
                    status,
                    elapsed_ms = elapsed.as_secs_f64() * 1e3,
                    "Request answered."
                );
                result
            }
            .instrument(span),
        )
    }
}

/// Readiness flips to false when shutdown starts so load balancers stop sending traffic.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

#[derive(Clone)]
struct AdminState {
    prometheus: Option<PrometheusHandle>,
    ready: Readiness,
    routing: Option<hindsight_routing::TableHandle>,
}

/// The admin router. The log's own gauges and counters (`hindsight_log_*`: queue depth,
/// spill bytes, spilled/replayed/delivered/dropped records) are exported alongside the proxy's.
/// `/routing` shows the routing table this proxy holds (generation per route, stale or not).
pub fn admin_router(ready: Readiness, routing: Option<hindsight_routing::TableHandle>) -> Router {
    let state = AdminState {
        prometheus: prometheus(),
        ready,
        routing,
    };
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/routing", get(routing_handler))
        .with_state(state)
}

async fn metrics_handler(State(s): State<AdminState>) -> (StatusCode, String) {
    match &s.prometheus {
        Some(h) => (StatusCode::OK, h.render()),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics recorder not installed in this process\n".into(),
        ),
    }
}

async fn routing_handler(State(s): State<AdminState>) -> axum::Json<serde_json::Value> {
    axum::Json(match &s.routing {
        None => serde_json::json!({"enabled": false}),
        Some(h) => {
            let table = h.snapshot();
            let mut routes: Vec<_> = table.routes().map(|r| (**r).clone()).collect();
            routes.sort_by(|a, b| a.route.cmp(&b.route));
            serde_json::json!({"enabled": true, "stale": h.is_stale(), "routes": routes})
        }
    })
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    if s.ready.get() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
