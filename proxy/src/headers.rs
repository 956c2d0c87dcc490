//! Header names the proxy understands, and the hop-by-hop set it never forwards. (No request
//! header is ever recorded, so credentials cannot reach the log.)

use http::header::{HeaderMap, HeaderName};

pub use hindsight_core::headers::{ADAPTER, EPISODE, INTERACTION_ID, NO_LOG, USER};

/// Hop-by-hop headers (RFC 9110 §7.6.1) apply to one connection and are not forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers, including any named by the `Connection` header itself.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_standard_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, x-drop-me".parse().unwrap());
        h.insert("x-drop-me", "1".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("authorization", "Bearer sk".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(h.get("x-drop-me").is_none());
        assert!(h.get("transfer-encoding").is_none());
        assert!(h.get("connection").is_none());
        assert!(
            h.get("authorization").is_some(),
            "credentials are forwarded"
        );
    }
}
