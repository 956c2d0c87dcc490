//! Webhook signatures: `x-hindsight-signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>`
//! with `x-hindsight-timestamp: <unix seconds>`. Several `v1=` values may be sent (comma
//! separated) and several secrets may be active, so senders and receivers rotate independently.

use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;

/// Header with the signature(s).
pub use hindsight_core::headers::SIGNATURE as SIGNATURE_HEADER;
/// Header with the unix-seconds timestamp.
pub use hindsight_core::headers::TIMESTAMP as TIMESTAMP_HEADER;

/// A signing secret. Never printed: `Debug` shows `Secret(***)`.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// A header is absent.
    #[error("missing")]
    Missing(&'static str),
    /// The timestamp is not an integer.
    #[error("timestamp is not unix seconds")]
    BadTimestamp,
    /// The timestamp is outside the replay window.
    #[error("timestamp outside the replay window of {window_s} s")]
    Stale {
        /// The window.
        window_s: u64,
    },
    /// No `v1=` value matches any active secret.
    #[error("no signature matches an active secret")]
    Mismatch,
}

/// Lowercase hex HMAC-SHA256 of `"<timestamp>.<body>"`, the value after `v1=`.
pub fn sign(secret: &Secret, timestamp: i64, body: &[u8]) -> String {
    // HMAC takes keys of any length, so `mac` never returns None; an empty string never verifies.
    mac(secret, timestamp, body)
        .map(|m| hex::encode(m.finalize().into_bytes()))
        .unwrap_or_default()
}

fn mac(secret: &Secret, timestamp: i64, body: &[u8]) -> Option<Hmac<Sha256>> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.bytes()).ok()?;
    m.update(timestamp.to_string().as_bytes());
    m.update(b".");
    m.update(body);
    Some(m)
}

/// Checks the headers against the active secrets and the replay window.
pub fn verify(
    secrets: &[Secret],
    window_s: u64,
    now_s: i64,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
) -> Result<(), SignatureError> {
    let ts_raw = timestamp.ok_or(SignatureError::Missing(TIMESTAMP_HEADER))?;
    let sig_raw = signature.ok_or(SignatureError::Missing(SIGNATURE_HEADER))?;
    let ts: i64 = ts_raw
        .trim()
        .parse()
        .map_err(|_| SignatureError::BadTimestamp)?;
    if now_s.abs_diff(ts) > window_s {
        return Err(SignatureError::Stale { window_s });
    }
    for part in sig_raw.split(',') {
        let Some(hexsig) = part.trim().strip_prefix("v1=") else {
            continue;
        };
        let Ok(given) = hex::decode(hexsig) else {
            continue;
        };
        for secret in secrets {
            if mac(secret, ts, body).is_some_and(|m| m.verify_slice(&given).is_ok()) {
                return Ok(());
            }
        }
    }
    Err(SignatureError::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::slice::from_ref;

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "Secret(***)");
    }

    #[test]
    fn known_vector() {
        // python3 -c 'import hmac,hashlib;print(hmac.new(b"key",b"1700000000.{}",hashlib.sha256).hexdigest())'
        assert_eq!(
            sign(&Secret::new("key"), 1_700_000_000, b"{}"),
            "9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
    }

    #[test]
    fn rotation_window_and_tamper() {
        let old = Secret::new("old");
        let new = Secret::new("new");
        let body = br#"{"a":1}"#;
        let sig = format!("v1={}", sign(&old, 100, body));
        assert_eq!(
            verify(
                &[new.clone(), old.clone()],
                300,
                100,
                Some("100"),
                Some(&sig),
                body
            ),
            Ok(())
        );
        assert_eq!(
            verify(from_ref(&new), 300, 100, Some("100"), Some(&sig), body),
            Err(SignatureError::Mismatch)
        );
        let both = format!("v1=00ff,v1={}", sign(&new, 100, body));
        assert_eq!(
            verify(from_ref(&new), 300, 100, Some("100"), Some(&both), body),
            Ok(())
        );
        assert_eq!(
            verify(from_ref(&old), 300, 401, Some("100"), Some(&sig), body),
            Err(SignatureError::Stale { window_s: 300 })
        );
        assert_eq!(
            verify(
                from_ref(&old),
                300,
                100,
                Some("100"),
                Some(&sig),
                br#"{"a":2}"#
            ),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[old], 300, 100, Some("abc"), Some(&sig), body),
            Err(SignatureError::BadTimestamp)
        );
    }
}
