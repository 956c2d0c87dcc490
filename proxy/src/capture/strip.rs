//! Behaviour log-probs the client did not ask for.
//!
//! With `proxy.request_behaviour` on, captured calls go upstream with `x-hindsight-behaviour: 1`
//! so a Hindsight-aware server (`hindsight serve`) returns the sampled tokens' log-probs even
//! when the client did not request them; the learner needs them to correct for off-policy data.
//! [`StripLogprobs`] removes them again from what the client receives (the record keeps them),
//! so the client still sees exactly the response it asked for. Upstreams that ignore the header
//! return no log-probs and the body passes through untouched.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use serde_json::Value;

use super::sse::SseParser;
use crate::error::{BodyError, ProxyBody};

pub use hindsight_core::headers::BEHAVIOUR as BEHAVIOUR_HEADER;

/// Did the client ask for log-probs itself? (`"logprobs": true` for chat, a number for legacy
/// completions.) Reads only that key; the rest of the body is skipped without building a tree.
pub fn client_wants_logprobs(request: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        logprobs: Option<Value>,
    }
    match serde_json::from_slice::<Probe>(request) {
        Ok(Probe { logprobs: Some(v) }) => match v {
            Value::Bool(b) => b,
            Value::Null => false,
            Value::Number(n) => n.as_u64() != Some(0) || n.as_f64().is_some_and(|f| f > 0.0),
            _ => true,
        },
        // Not JSON (or no key): nothing will be injected for it to miss.
        _ => false,
    }
}

/// Sets `choices[*].logprobs` to null; true if anything changed.
pub fn null_logprobs(v: &mut Value) -> bool {
    let mut changed = false;
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            if let Some(lp) = c.get_mut("logprobs") {
                if !lp.is_null() {
                    *lp = Value::Null;
                    changed = true;
                }
            }
        }
    }
    changed
}

/// The JSON text without log-probs, or `None` when there were none (then the original bytes
/// go out untouched).
fn rewrite(json: &[u8]) -> Option<Vec<u8>> {
    let mut v = serde_json::from_slice::<Value>(json).ok()?;
    if null_logprobs(&mut v) {
        serde_json::to_vec(&v).ok()
    } else {
        None
    }
}

/// Rewrites a response body so it carries no `logprobs`. Streams are rewritten event by event
/// as they arrive (nothing is held back beyond the current event); JSON bodies are rewritten
/// once complete.
pub struct StripLogprobs {
    inner: ProxyBody,
    mode: Mode,
    out: VecDeque<Bytes>,
    /// Trailers seen after the data; sent once the rewritten data is out.
    trailers: Option<Frame<Bytes>>,
    done: bool,
}

enum Mode {
    Sse(SseParser),
    Json(BytesMut),
}

impl StripLogprobs {
    pub fn new(inner: ProxyBody, streamed: bool) -> Self {
        Self {
            inner,
            mode: if streamed {
                Mode::Sse(SseParser::new())
            } else {
                Mode::Json(BytesMut::new())
            },
            out: VecDeque::new(),
            trailers: None,
            done: false,
        }
    }

    fn push_event(out: &mut VecDeque<Bytes>, data: &[u8]) {
        let rewritten = rewrite(data);
        let mut buf = BytesMut::with_capacity(data.len() + 8);
        buf.extend_from_slice(b"data: ");
        buf.extend_from_slice(rewritten.as_deref().unwrap_or(data));
        buf.extend_from_slice(b"\n\n");
        out.push_back(buf.freeze());
    }

    fn finish(&mut self) {
        match &mut self.mode {
            Mode::Sse(p) => {
                let out = &mut self.out;
                p.finish(|d| Self::push_event(out, d));
            }
            Mode::Json(buf) => {
                let body = std::mem::take(buf).freeze();
                let rewritten = rewrite(&body).map(Bytes::from);
                self.out.push_back(rewritten.unwrap_or(body));
            }
        }
    }
}

impl Body for StripLogprobs {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            if let Some(b) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.done {
                return Poll::Ready(this.trailers.take().map(Ok));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => match &mut this.mode {
                        Mode::Sse(p) => {
                            let out = &mut this.out;
                            p.feed(&data, |d| Self::push_event(out, d));
                        }
                        Mode::Json(buf) => buf.extend_from_slice(&data),
                    },
                    // Trailers end the data: flush the rewrite, then pass them on.
                    Err(frame) => {
                        this.finish();
                        this.trailers = Some(frame);
                        this.done = true;
                    }
                },
                Poll::Ready(None) => {
                    this.finish();
                    this.done = true;
                }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        // The length changes; never advertise the upstream's.
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use serde_json::json;

    fn body_of(chunks: Vec<&'static [u8]>) -> ProxyBody {
        let s = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, BodyError>(Frame::data(Bytes::from_static(c)))),
        );
        http_body_util::StreamBody::new(s).boxed_unsync()
    }

    #[test]
    fn detects_client_logprobs_requests() {
        assert!(client_wants_logprobs(br#"{"model":"m","logprobs":true}"#));
        assert!(client_wants_logprobs(br#"{"prompt":"x","logprobs":2}"#));
        assert!(!client_wants_logprobs(br#"{"model":"m","logprobs":false}"#));
        assert!(!client_wants_logprobs(
            br#"{"model":"m","messages":[{"logprobs":true}]}"#
        ));
        assert!(!client_wants_logprobs(b"not json"));
    }

    #[tokio::test]
    async fn strips_streamed_logprobs_across_chunk_boundaries() {
        let body = body_of(vec![
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"logprobs\":{\"content\":[{\"token\":\"Hi\",\"logprob\":-0.1}]}}]}\n",
            b"\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\nda",
            b"ta: [DONE]\n\n",
        ]);
        let out = StripLogprobs::new(body, true)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(!text.contains("logprob\":-0.1"), "{text}");
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3);
        let first: Value = serde_json::from_str(events[0].trim_start_matches("data: ")).unwrap();
        assert_eq!(first["choices"][0]["delta"]["content"], "Hi");
        assert!(first["choices"][0]["logprobs"].is_null());
        assert_eq!(events[2], "data: [DONE]");
    }

    #[tokio::test]
    async fn strips_json_logprobs_and_leaves_other_bodies_alone() {
        let v = json!({"choices":[{"index":0,"message":{"content":"Paris"},"logprobs":{"content":[{"token":"Paris","logprob":-0.01}]}}]});
        let raw: &'static [u8] = Box::leak(v.to_string().into_bytes().into_boxed_slice());
        let out = StripLogprobs::new(body_of(vec![&raw[..10], &raw[10..]]), false)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let got: Value = serde_json::from_slice(&out).unwrap();
        assert!(got["choices"][0]["logprobs"].is_null());
        assert_eq!(got["choices"][0]["message"]["content"], "Paris");
        let plain: &'static [u8] = b"{\"error\":{\"message\":\"no\"}}";
        let out = StripLogprobs::new(body_of(vec![plain]), false)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(&out[..], plain, "untouched byte for byte");
    }
}
