//! The innermost service: sends a request to the upstream unchanged (but for hop-by-hop
//! headers and the target authority) and hands back its response as it streams in.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response, Uri};
use http_body_util::BodyExt;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::config::Upstream;
use crate::error::{box_body_error, ProxyBody, ProxyError};
use crate::headers::strip_hop_by_hop;

/// How long the upstream took to send response headers; put in the response's extensions so
/// telemetry can report the proxy's own overhead.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamLatency(pub Duration);

/// Forwards requests to one upstream over a pooled HTTP/1.1 client.
#[derive(Clone)]
pub struct Forward {
    client: Client<HttpConnector, ProxyBody>,
    upstream: Upstream,
    timeout: Duration,
}

impl Forward {
    pub fn new(upstream: Upstream, connect_timeout: Duration, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(connector);
        Self {
            client,
            upstream,
            timeout,
        }
    }

    fn target(&self, uri: &Uri) -> Result<Uri, ProxyError> {
        let pq = uri.path_and_query().map(|pq| pq.as_str()).unwrap_or("/");
        let path = if self.upstream.base_path.is_empty() {
            pq.to_string()
        } else {
            format!("{}{}", self.upstream.base_path, pq)
        };
        Uri::builder()
            .scheme(self.upstream.scheme.clone())
            .authority(self.upstream.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| ProxyError::RequestBody(format!("cannot build the upstream URI: {e}")))
    }
}

impl tower::Service<Request<ProxyBody>> for Forward {
    type Response = Response<ProxyBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        // The pooled client has no readiness of its own; connection limits live in the pool.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let target = self.target(&parts.uri);
        let client = self.client.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            parts.uri = target?;
            strip_hop_by_hop(&mut parts.headers);
            // Let the client set Host from the upstream URI.
            parts.headers.remove(http::header::HOST);
            parts.version = http::Version::HTTP_11;
            let started = Instant::now();
            let resp = match tokio::time::timeout(
                timeout,
                client.request(Request::from_parts(parts, body)),
            )
            .await
            {
                Err(_) => return Err(ProxyError::UpstreamTimeout(timeout.as_millis() as u64)),
                Ok(Err(e)) if e.is_connect() => {
                    return Err(ProxyError::UpstreamConnect(error_chain(&e)))
                }
                Ok(Err(e)) => return Err(ProxyError::Upstream(error_chain(&e))),
                Ok(Ok(resp)) => resp,
            };
            let latency = UpstreamLatency(started.elapsed());
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            parts.extensions.insert(latency);
            let body = body.map_err(box_body_error).boxed_unsync();
            Ok(Response::from_parts(parts, body))
        })
    }
}

/// "connection refused" is more useful to a client than "client error (Connect)".
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Turns the stack's `Result` into a response: the one place a [`ProxyError`] becomes HTTP.
#[derive(Clone)]
pub struct ErrorToResponse<S> {
    inner: S,
}

impl<S> ErrorToResponse<S> {
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S, B> tower::Service<Request<B>> for ErrorToResponse<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = ProxyError>,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        match self.inner.poll_ready(cx) {
            Poll::Pending => Poll::Pending,
            // Readiness errors surface on the call instead.
            Poll::Ready(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let fut = self.inner.call(req);
        Box::pin(async move { Ok(fut.await.unwrap_or_else(ProxyError::into_response)) })
    }
}
