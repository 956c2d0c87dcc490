//! Assembles the data-plane stack and runs the listeners until shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};

use hindsight_feedback::{feedback_router, FeedbackError, FeedbackState, RecordLog};

use crate::capture::{spawn_encoder, CaptureLayer, CaptureShared, SharedEpisodes};
use crate::config::Config;
use crate::error::{box_body_error, ProxyBody, ProxyError};
use crate::forward::{ErrorToResponse, Forward};
use crate::limits::{Admission, IdleTimeoutBody};
use crate::routing::{RoutingLayer, RoutingShared};
use crate::telemetry::{admin_router, prometheus, Readiness, TelemetryLayer};

/// What an embedding process may add to the proxy.
#[derive(Default)]
pub struct Extensions {
    /// Extra endpoints served on the data port under `/hindsight/` (beside the feedback API).
    pub hindsight_routes: Router,
}

/// What shutdown achieved, for the operator and for tests.
#[derive(Debug)]
pub struct ShutdownReport {
    /// Connections still open when the grace period ended (closed forcibly).
    pub connections_cut: bool,
    pub log: hindsight_feedback::FlushReport,
}

/// Builds the request stack. Order, outermost first:
/// 1. `map_request`: hyper's body becomes the stack's boxed body type, failing with a 408 when
///    the client stops sending it (`proxy.body_read_timeout_ms`).
/// 2. `ErrorToResponse`: the single place a [`ProxyError`] becomes an HTTP response, so every
///    layer below may fail with `?`.
/// 3. `Telemetry`: span + metrics; sits outside routing and capture so it sees every request
///    and the final status, proxy errors included.
/// 4. `HindsightRoutes`: `/hindsight/…` is answered by Hindsight itself and never forwarded.
/// 5. `Routing`: a call naming a routed model gets its arm and its `model` rewritten to the
///    assigned version, before capture so the record shows the request as sent upstream.
/// 6. `Capture`: wraps forwarding so it records the request as sent and the response as the
///    client receives it.
/// 7. `Forward`: the upstream client.
fn stack(
    config: &Config,
    shared: CaptureShared,
    routing: RoutingLayer,
    hindsight_routes: Router,
) -> impl tower::Service<
    Request<hyper::body::Incoming>,
    Response = Response<ProxyBody>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<ProxyBody>, Infallible>> + Send,
> + Clone
       + Send
       + 'static {
    let p = &config.proxy;
    let body_timeout = p.body_read_timeout;
    ServiceBuilder::new()
        .map_request(move |req: Request<hyper::body::Incoming>| {
            req.map(|b| {
                let body = b.map_err(box_body_error).boxed_unsync();
                IdleTimeoutBody::new(body, body_timeout).boxed_unsync()
            })
        })
        .layer_fn(ErrorToResponse::new)
        .layer(TelemetryLayer::new(&p.route))
        .layer_fn(move |inner| HindsightRoutes {
            inner,
            router: hindsight_routes.clone().fallback(hindsight_not_found),
        })
        .layer(routing)
        .layer(CaptureLayer::new(shared))
        .service(Forward::new(
            p.upstream.clone(),
            p.connect_timeout,
            p.upstream_timeout,
        ))
}

/// Runs the proxy on the given listeners until `shutdown` resolves, then drains in-flight
/// requests (up to `proxy.shutdown_grace_ms`), finishes encoding captured calls and flushes
/// the interaction log (to Kafka, or to the spill).
pub async fn run(
    config: Config,
    listener: TcpListener,
    admin: TcpListener,
    ext: Extensions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<ShutdownReport, FeedbackError> {
    let _ = prometheus();
    let (log, handle) = RecordLog::start(config.log.clone()).await?;
    let mut routes = ext.hindsight_routes;
    if let Some(feedback) = config.feedback.clone() {
        let state = FeedbackState::new(feedback, handle.clone())?;
        routes = routes.merge(feedback_router(state));
    }
    // Connects lazily, from the encoder task: start-up never waits for Redis.
    let shared_episodes = match &config.proxy.episode_sharing {
        Some(s) => Some(SharedEpisodes::new(s).map_err(|e| FeedbackError::Config {
            key: "proxy.episode_redis_url".into(),
            reason: e.to_string(),
        })?),
        None => None,
    };
    let (encoder, encoder_task) = spawn_encoder(
        config.proxy.route.clone(),
        handle,
        config.proxy.episode_inference_capacity,
        shared_episodes,
        config.proxy.capture_queue_capacity,
    );
    let shared = CaptureShared {
        capture_paths: config.proxy.capture_paths.clone(),
        max_request_body_bytes: config.proxy.max_request_body_bytes,
        max_capture_response_bytes: config.proxy.max_capture_response_bytes,
        encoder,
        request_behaviour: config.proxy.request_behaviour,
    };
    let watcher = match &config.routing {
        Some(r) => Some(
            hindsight_routing::spawn_watcher(
                r.store(),
                r.fallback_routes(),
                Duration::from_millis(r.resync_ms),
            )
            .map_err(|e| FeedbackError::Config {
                key: "routing".into(),
                reason: e.to_string(),
            })?,
        ),
        None => None,
    };
    let routing = RoutingLayer::new(match (&config.routing, &watcher) {
        (Some(r), Some(w)) => Some(RoutingShared {
            table: w.handle.clone(),
            memory: hindsight_routing::EpisodeMemory::new(r.episode_memory),
            capture_paths: config.proxy.capture_paths.clone(),
            max_request_body_bytes: config.proxy.max_request_body_bytes,
        }),
        _ => None,
    });
    let service = stack(&config, shared, routing, routes);

    let ready = Readiness::default();
    let admin_shutdown = tokio_util::sync::CancellationToken::new();
    let admin_task = {
        let router = admin_router(ready.clone(), watcher.as_ref().map(|w| w.handle.clone()));
        let token = admin_shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(admin, router)
                .with_graceful_shutdown(token.cancelled_owned())
                .await;
        })
    };

    let addr = listener.local_addr().ok();
    tracing::info!(?addr, upstream = %config.proxy.upstream.authority, "Proxy listening.");
    ready.set(true);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let builder = http_builder(config.proxy.header_read_timeout);
    let admission = Admission::new(
        config.proxy.max_connections,
        config.proxy.header_read_timeout,
    );
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "Accept failed.");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (builder, service, watcher) = (builder.clone(), service.clone(), graceful.watcher());
                admission.admit(stream, move |stream| async move {
                    let conn = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service))
                        .into_owned();
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(error = %e, "Connection ended with an error.");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }

    tracing::info!("Shutdown: no longer accepting; draining in-flight requests.");
    ready.set(false);
    drop(listener);
    let connections_cut = tokio::time::timeout(config.proxy.shutdown_grace, graceful.shutdown())
        .await
        .is_err();
    if connections_cut {
        tracing::warn!("Shutdown grace period ended with connections still open.");
    }
    // Dropping the stack drops the encoder's sender; the task drains what is queued and ends.
    drop(service);
    drop(builder);
    if tokio::time::timeout(config.proxy.shutdown_grace, encoder_task)
        .await
        .is_err()
    {
        tracing::warn!("Shutdown: record encoder did not finish within the grace period.");
    }
    if let Some(w) = watcher {
        w.cancel.cancel();
        let _ = w.task.await;
    }
    let log = log.shutdown(config.proxy.shutdown_grace).await;
    admin_shutdown.cancel();
    let _ = admin_task.await;
    tracing::info!(?log, "Proxy stopped.");
    Ok(ShutdownReport {
        connections_cut,
        log,
    })
}

/// HTTP/1 and HTTP/2 on one port; a request head must arrive within `header_read_timeout`.
fn http_builder(header_read_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    builder
}

async fn hindsight_not_found(uri: http::Uri) -> Response<ProxyBody> {
    ProxyError::NotFound(format!("no Hindsight endpoint at {}", uri.path())).into_response()
}

/// Serves `/hindsight/…` from Hindsight's own router; everything else goes down the stack.
#[derive(Clone)]
struct HindsightRoutes<S> {
    inner: S,
    router: Router,
}

impl<S> tower::Service<Request<ProxyBody>> for HindsightRoutes<S>
where
    S: tower::Service<Request<ProxyBody>, Response = Response<ProxyBody>, Error = ProxyError>,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        if req.uri().path().starts_with("/hindsight/") {
            let fut = self.router.clone().oneshot(req);
            return Box::pin(async move {
                let resp = match fut.await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok(resp.map(|b| b.map_err(box_body_error).boxed_unsync()))
            });
        }
        Box::pin(self.inner.call(req))
    }
}
