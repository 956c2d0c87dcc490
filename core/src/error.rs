//! The one JSON body of every error a Hindsight HTTP service answers with (the proxy, the
//! feedback API, `hindsight serve`): OpenAI's error object, so an agent's client parses
//! Hindsight's own errors the way it parses its model server's.
//!
//! ```json
//! {"error": {"message": "…", "type": "invalid_request_error", "param": "events[1].value", "code": "invalid_value"}}
//! ```

/// `{"error": {"message", "type", "param", "code"}}`. `param` names the field, header or
/// parameter to fix (null when the error is not about one); `message` says what is wrong with
/// it; `type` is `invalid_request_error` for what the caller can fix, else a server-side kind;
/// `code` is a short stable identifier to branch on.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: &str) -> serde_json::Value {
    serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": code}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_openais_error_object() {
        let b = error_body(
            "must be a bool",
            "invalid_request_error",
            Some("value"),
            "invalid_value",
        );
        assert_eq!(b["error"]["message"], "must be a bool");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "value");
        assert_eq!(b["error"]["code"], "invalid_value");
        assert!(error_body("x", "server_error", None, "unavailable")["error"]["param"].is_null());
    }
}
