//! The proxy's errors. [`ProxyError`] knows its HTTP status; [`ProxyError::into_response`] is the
//! one place an error becomes a response, with an OpenAI-shaped JSON body that says what
//! happened without leaking internals.

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

/// Boxed body the proxy hands to hyper.
pub type ProxyBody = UnsyncBoxBody<Bytes, BodyError>;

/// An error while streaming a body (upstream reset, client gone). A concrete type rather than
/// `Box<dyn Error>` so async blocks holding bodies stay provably `Send` (rustc cannot prove it
/// through the higher-ranked lifetimes a boxed trait object introduces there).
#[derive(Debug)]
pub struct BodyError(Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl BodyError {
    /// The error it carries.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Config errors come from the shared loader.
pub use hindsight_core::ConfigError;

/// What can go wrong while serving one request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("could not connect to the upstream: {0}")]
    UpstreamConnect(String),
    #[error("the upstream did not answer within {0} ms")]
    UpstreamTimeout(u64),
    #[error("the upstream connection failed: {0}")]
    Upstream(String),
    #[error("request body exceeds proxy.max_request_body_bytes ({0} bytes)")]
    BodyTooLarge(usize),
    #[error("could not read the request body: {0}")]
    RequestBody(String),
    #[error("the request body stalled: no data for {0} ms (proxy.body_read_timeout_ms)")]
    RequestTimeout(u64),
    #[error("not found: {0}")]
    NotFound(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::UpstreamConnect(_) | Self::Upstream(_) => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestBody(_) => StatusCode::BAD_REQUEST,
            Self::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            Self::UpstreamConnect(_) => "upstream_unreachable",
            Self::UpstreamTimeout(_) => "upstream_timeout",
            Self::Upstream(_) => "upstream_error",
            Self::BodyTooLarge(_) => "request_too_large",
            Self::RequestBody(_) => "bad_request_body",
            Self::RequestTimeout(_) => "request_timeout",
            Self::NotFound(_) => "not_found",
        }
    }

    /// The response a client gets: `{"error": {"message", "type", "code"}}`, marked as coming
    /// from the proxy so it is never mistaken for the upstream's own error.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), error = %self, "Request failed in the proxy.");
        }
        let body = hindsight_core::error_body(
            &self.to_string(),
            "hindsight_proxy_error",
            None,
            self.code(),
        );
        let mut resp = Response::new(full(Bytes::from(body.to_string())));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// Boxes any body error into [`BodyError`].
pub fn box_body_error<E: std::error::Error + Send + Sync + 'static>(e: E) -> BodyError {
    BodyError(Box::new(e))
}

/// A complete body as a [`ProxyBody`].
pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}
