//! The crate's error type; each variant knows its HTTP status and renders OpenAI's error shape
//! in exactly one place ([`IntoResponse`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// Everything that can go wrong in the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The request is malformed or asks for something impossible.
    #[error("{message}")]
    InvalidRequest {
        /// The offending parameter, if any.
        param: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// The model or adapter named in the request is not loaded.
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the current state (e.g. loading an existing adapter name).
    #[error("{0}")]
    Conflict(String),
    /// The request queue is full.
    #[error("the server is busy: request queue full, retry after {retry_after_s} s")]
    Overloaded {
        /// Suggested wait before retrying.
        retry_after_s: u64,
    },
    /// The server is shutting down or the worker died.
    #[error("the generation worker is unavailable")]
    Unavailable,
    /// The model core failed.
    #[error("model error: {0}")]
    Model(#[from] hindsight_model::ModelError),
    /// Binding or serving the socket failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// Invalid server configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl From<hindsight_model::grammar::SchemaError> for ServeError {
    /// A schema the grammar cannot compile is the request's fault: a 400 on `response_format`.
    fn from(e: hindsight_model::grammar::SchemaError) -> Self {
        Self::invalid("response_format", e.0)
    }
}

impl ServeError {
    /// A 400 about one parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            param: Some(param.to_string()),
            message: message.into(),
        }
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict(_) => StatusCode::BAD_REQUEST,
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Model(hindsight_model::ModelError::InvalidArgument(_))
            | Self::Model(hindsight_model::ModelError::ChatTemplate(_)) => StatusCode::BAD_REQUEST,
            Self::Model(_) | Self::Io(_) | Self::Config(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Self::InvalidRequest { .. } => ("invalid_request_error", "invalid_value"),
            Self::NotFound(_) => ("invalid_request_error", "model_not_found"),
            Self::Conflict(_) => ("invalid_request_error", "conflict"),
            Self::Overloaded { .. } => ("rate_limit_error", "queue_full"),
            Self::Unavailable => ("server_error", "unavailable"),
            _ if self.status().is_client_error() => ("invalid_request_error", "invalid_value"),
            _ => ("server_error", "internal_error"),
        }
    }

    /// OpenAI's error body.
    pub fn body(&self) -> serde_json::Value {
        let (ty, code) = self.kind();
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            _ => None,
        };
        // Internal errors never leak details to clients.
        let message = if self.status().is_server_error() && !matches!(self, Self::Unavailable) {
            "internal server error".to_string()
        } else {
            self.to_string()
        };
        hindsight_core::error_body(&message, ty, param.as_deref(), code)
    }
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "Request failed.");
        } else {
            tracing::debug!(error = %self, "Request refused.");
        }
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let Self::Overloaded { retry_after_s } = self {
            if let Ok(v) = HeaderValue::from_str(&retry_after_s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_schemas_are_client_errors_on_response_format() {
        let schema: crate::grammar::OJson = serde_json::from_str(r#"{"type": "tuple"}"#).unwrap();
        let e: ServeError = crate::grammar::compile_schema(&schema).unwrap_err().into();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(
            matches!(&e, ServeError::InvalidRequest { param: Some(p), .. } if p == "response_format"),
            "{e:?}"
        );
    }
}
