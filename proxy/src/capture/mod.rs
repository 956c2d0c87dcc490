//! Capture of OpenAI-compatible calls into the interaction log.
//!
//! On a captured path the request body is read whole (it must be recorded and forwarded), an
//! interaction id is assigned and returned to the client in `x-hindsight-interaction-id`, and
//! the response body is wrapped in a [`CaptureBody`] that copies frames as they pass through
//! without holding any of them back. When the body ends (or the client goes away) the copy is
//! handed to the record encoder task over a bounded channel: JSON parsing, SSE reassembly,
//! episode inference and serialisation all happen there, off the request path.

mod encoder;
mod episodes;
pub mod sse;
mod strip;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use uuid::Uuid;

use crate::error::{full, BodyError, ProxyBody, ProxyError};
use crate::headers;
use hindsight_core::now_ms;

pub use encoder::{spawn_encoder, EncoderHandle};
pub(crate) use episodes::SharedEpisodes;
/// Routing's one-pass reading of the body is tested against it.
#[cfg(test)]
pub(crate) use strip::client_wants_logprobs;

/// One finished call, as raw as it was seen; the encoder turns it into an `InteractionRecord`.
#[derive(Debug)]
pub struct CapturedExchange {
    pub interaction_id: Uuid,
    pub received_ms: i64,
    pub method: String,
    pub path: String,
    pub episode_header: Option<String>,
    pub request: Bytes,
    pub status: u16,
    pub streamed: bool,
    pub response: Bytes,
    pub response_truncated: bool,
    pub adapter: Option<String>,
    pub upstream_headers_ms: f64,
    pub total_ms: f64,
    pub error: Option<String>,
    /// The proxy asked the upstream for behaviour log-probs the client did not request; they
    /// were removed from what the client received.
    pub behaviour_injected: bool,
    /// The canary assignment, when the request named a routed model.
    pub assignment: Option<hindsight_routing::Assignment>,
}

/// What every capture shares: settings and the channel to the encoder.
pub struct CaptureShared {
    pub capture_paths: Vec<String>,
    pub max_request_body_bytes: usize,
    pub max_capture_response_bytes: usize,
    pub encoder: EncoderHandle,
    /// Ask the upstream for behaviour log-probs on every captured call (see `strip`).
    pub request_behaviour: bool,
}

impl CaptureShared {
    fn should_capture<B>(&self, req: &Request<B>) -> bool {
        req.method() == http::Method::POST
            && self.capture_paths.iter().any(|p| p == req.uri().path())
            && !req.headers().contains_key(headers::NO_LOG)
    }
}

/// `tower::Layer` adding capture in front of a forwarding service.
#[derive(Clone)]
pub struct CaptureLayer {
    shared: Arc<CaptureShared>,
}

impl CaptureLayer {
    pub fn new(shared: CaptureShared) -> Self {
        Self {
            shared: Arc::new(shared),
        }
    }
}

impl<S> tower::Layer<S> for CaptureLayer {
    type Service = Capture<S>;
    fn layer(&self, inner: S) -> Capture<S> {
        Capture {
            inner,
            shared: self.shared.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Capture<S> {
    inner: S,
    shared: Arc<CaptureShared>,
}

impl<S> tower::Service<Request<ProxyBody>> for Capture<S>
where
    S: tower::Service<Request<ProxyBody>, Response = Response<ProxyBody>, Error = ProxyError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        // The clone is not necessarily ready; take the ready one (tower's clone-and-swap idiom).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        if !shared.should_capture(&req) {
            return Box::pin(inner.call(req));
        }
        Box::pin(async move {
            let started = Instant::now();
            let received_ms = now_ms();
            let (mut parts, body) = req.into_parts();
            let request = read_limited(body, shared.max_request_body_bytes).await?;
            let routed = parts.extensions.remove::<crate::routing::Routed>();
            let interaction_id = routed
                .as_ref()
                .map_or_else(Uuid::now_v7, |r| r.interaction_id);
            // Routing already read the body for `logprobs`; read it here only when it did not.
            let behaviour_injected = shared.request_behaviour
                && !routed.as_ref().map_or_else(
                    || strip::client_wants_logprobs(&request),
                    |r| r.wants_logprobs,
                );
            if behaviour_injected {
                parts
                    .headers
                    .insert(strip::BEHAVIOUR_HEADER, HeaderValue::from_static("1"));
            }
            let exchange = CapturedExchange {
                interaction_id,
                received_ms,
                method: parts.method.to_string(),
                path: parts
                    .uri
                    .path_and_query()
                    .map(|pq| pq.as_str().to_string())
                    .unwrap_or_default(),
                episode_header: parts
                    .headers
                    .get(headers::EPISODE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                request: request.clone(),
                status: 0,
                streamed: false,
                response: Bytes::new(),
                response_truncated: false,
                adapter: None,
                upstream_headers_ms: 0.0,
                total_ms: 0.0,
                error: None,
                behaviour_injected,
                assignment: routed.map(|r| r.assignment),
            };
            let result = inner.call(Request::from_parts(parts, full(request))).await;
            let mut exchange = exchange;
            match result {
                Ok(resp) => {
                    let (mut parts, body) = resp.into_parts();
                    exchange.status = parts.status.as_u16();
                    exchange.upstream_headers_ms = started.elapsed().as_secs_f64() * 1e3;
                    exchange.streamed = parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|ct| ct.starts_with("text/event-stream"));
                    exchange.adapter = parts
                        .headers
                        .get(headers::ADAPTER)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    if let Ok(v) = HeaderValue::from_str(&interaction_id.to_string()) {
                        parts.headers.insert(headers::INTERACTION_ID, v);
                    }
                    let streamed = exchange.streamed;
                    let body = CaptureBody {
                        inner: body,
                        copy: BytesMut::new(),
                        limit: shared.max_capture_response_bytes,
                        exchange: Some(exchange),
                        started,
                        shared: shared.clone(),
                    }
                    .boxed_unsync();
                    let body = if behaviour_injected {
                        // The rewrite changes the length.
                        parts.headers.remove(http::header::CONTENT_LENGTH);
                        strip::StripLogprobs::new(body, streamed).boxed_unsync()
                    } else {
                        body
                    };
                    Ok(Response::from_parts(parts, body))
                }
                Err(err) => {
                    exchange.status = err.status().as_u16();
                    exchange.error = Some(err.to_string());
                    exchange.total_ms = started.elapsed().as_secs_f64() * 1e3;
                    shared.encoder.send(exchange);
                    Err(err)
                }
            }
        })
    }
}

/// Reads the whole request body, refusing more than `limit` bytes. Boxed so the calling
/// future's `Send` proof does not have to see through `Limited`'s error conversions.
pub(crate) fn read_limited(
    body: ProxyBody,
    limit: usize,
) -> Pin<Box<dyn Future<Output = Result<Bytes, ProxyError>> + Send>> {
    Box::pin(async move {
        let limited = http_body_util::Limited::new(body, limit);
        match limited.collect().await {
            Ok(c) => Ok(c.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                Err(ProxyError::BodyTooLarge(limit))
            }
            Err(e) => Err(crate::limits::body_read_error(&*e)),
        }
    })
}

/// Passes the upstream's response body through frame by frame and keeps a bounded copy.
pub struct CaptureBody {
    inner: ProxyBody,
    copy: BytesMut,
    limit: usize,
    /// `Some` until the record has been handed off (at end of stream, error, or drop).
    exchange: Option<CapturedExchange>,
    started: Instant,
    shared: Arc<CaptureShared>,
}

impl CaptureBody {
    fn finish(&mut self, error: Option<String>) {
        if let Some(mut ex) = self.exchange.take() {
            ex.response = std::mem::take(&mut self.copy).freeze();
            ex.total_ms = self.started.elapsed().as_secs_f64() * 1e3;
            if error.is_some() {
                ex.error = error;
            }
            self.shared.encoder.send(ex);
        }
    }
}

impl Body for CaptureBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let room = this.limit.saturating_sub(this.copy.len());
                    if data.len() > room {
                        if let Some(ex) = this.exchange.as_mut() {
                            ex.response_truncated = true;
                        }
                    }
                    this.copy.extend_from_slice(&data[..data.len().min(room)]);
                }
                // hyper stops polling a body that reports its end, so finish here rather
                // than waiting for a `None` that may never be asked for.
                if this.inner.is_end_stream() {
                    this.finish(None);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(Some(format!("upstream body failed: {e}")));
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.finish(None);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CaptureBody {
    fn drop(&mut self) {
        // Dropped before the end: hyper gave up on the client (disconnect or reset). What was
        // seen so far is still recorded.
        if self.exchange.is_some() {
            if self.inner.is_end_stream() {
                self.finish(None);
            } else {
                self.finish(Some("client disconnected before the response ended".into()));
            }
        }
    }
}
