//! Slow and idle clients: a request body that stops arriving times out (408), and connections
//! beyond `proxy.max_connections` are shed with a 503 before file descriptors run out.
//!
//! Headers are bounded by hyper's `header_read_timeout` (set in `server.rs`): a client that
//! opens a connection and sends no complete request head within `header_read_timeout_ms`,
//! including an idle keep-alive connection, is disconnected.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};

use crate::error::{box_body_error, BodyError, ProxyBody, ProxyError};

/// The body error of a client that stopped sending its request body.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled: no data for {0} ms (proxy.body_read_timeout_ms)")]
pub struct BodyReadTimeout(pub u64);

/// A request body that fails with [`BodyReadTimeout`] when no frame arrives for `timeout`
/// (the clock restarts with every frame, so a long upload that keeps moving is never cut).
/// The timer is armed only when the body makes the reader wait: a body that arrived with its
/// headers, the usual case, never touches the timer wheel.
pub struct IdleTimeoutBody {
    inner: ProxyBody,
    timeout: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Whether `sleep` runs for the current wait (disarmed by every frame).
    armed: bool,
    done: bool,
}

impl IdleTimeoutBody {
    pub fn new(inner: ProxyBody, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            sleep: None,
            armed: false,
            done: false,
        }
    }
}

impl Body for IdleTimeoutBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.armed = false;
                if frame.is_none() {
                    this.done = true;
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let deadline = Instant::now() + this.timeout;
                let sleep = match (&mut this.sleep, this.armed) {
                    (Some(sleep), true) => sleep,
                    (Some(sleep), false) => {
                        sleep.as_mut().reset(deadline);
                        sleep
                    }
                    (slot @ None, _) => slot.insert(Box::pin(tokio::time::sleep_until(deadline))),
                };
                this.armed = true;
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.done = true;
                        metrics::counter!("hindsight_proxy_body_timeouts_total").increment(1);
                        let ms = this.timeout.as_millis() as u64;
                        Poll::Ready(Some(Err(box_body_error(BodyReadTimeout(ms)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The error for a failed request-body read: 408 when the client stalled, 400 otherwise.
pub fn body_read_error(e: &(dyn std::error::Error + 'static)) -> ProxyError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<BodyReadTimeout>() {
            return ProxyError::RequestTimeout(t.0);
        }
        if let Some(b) = err.downcast_ref::<BodyError>() {
            if let Some(t) = b.inner().downcast_ref::<BodyReadTimeout>() {
                return ProxyError::RequestTimeout(t.0);
            }
        }
        cur = err.source();
    }
    ProxyError::RequestBody(e.to_string())
}

/// Answers a connection over `proxy.max_connections` with a 503 and `Retry-After`, then
/// closes it. Written on the raw socket: the request is never read, which is the point.
async fn shed(mut stream: TcpStream, max: usize, retry_after_s: u64) {
    let body = hindsight_core::error_body(
        &format!(
            "the proxy holds its maximum of {max} connections (proxy.max_connections); retry later"
        ),
        "hindsight_proxy_error",
        None,
        "overloaded",
    )
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {retry_after_s}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // Bounded: a client that does not read its 503 must not hold the slot we refused it.
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// Admits client connections: at most `max` open (beyond it, [`shed`]), and each must send its
/// first bytes within `first_bytes_within`.
pub struct Admission {
    slots: Arc<Semaphore>,
    max: usize,
    first_bytes_within: Duration,
    open: metrics::Gauge,
    shed: metrics::Counter,
}

impl Admission {
    pub fn new(max: usize, first_bytes_within: Duration) -> Self {
        if let Some(fds) = open_files_limit() {
            if (max as u64) * 2 + 256 > fds {
                tracing::warn!(
                    max_connections = max,
                    open_files_limit = fds,
                    "proxy.max_connections is over half the open-files limit: descriptors may run out before connections are shed."
                );
            }
        }
        Self {
            slots: Arc::new(Semaphore::new(max)),
            max,
            first_bytes_within,
            open: metrics::gauge!("hindsight_proxy_connections_open"),
            shed: metrics::counter!("hindsight_proxy_connections_shed_total"),
        }
    }

    /// Serves `stream` with `serve` on its own task when a slot is free and the client speaks
    /// in time; sheds it with a 503 when none is free.
    pub fn admit<F, Fut>(&self, stream: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            self.shed.increment(1);
            tokio::spawn(shed(stream, self.max, 1));
            return;
        };
        let open = self.open.clone();
        open.increment(1.0);
        let first_bytes_within = self.first_bytes_within;
        tokio::spawn(async move {
            // hyper's header timeout starts once a request's first bytes arrive (protocol
            // detection waits for them before it), so a client that connects and sends nothing
            // is bounded here.
            let mut probe = [0u8; 1];
            let first = tokio::time::timeout(first_bytes_within, stream.peek(&mut probe)).await;
            if matches!(first, Ok(Ok(n)) if n > 0) {
                serve(stream).await;
            }
            open.decrement(1.0);
            drop(slot);
        });
    }
}

/// The soft limit on open file descriptors (Linux: `/proc/self/limits`), if readable.
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn body_from(rx: tokio::sync::mpsc::Receiver<Bytes>) -> ProxyBody {
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            let b = rx.recv().await?;
            Some((Ok::<_, BodyError>(Frame::data(b)), rx))
        });
        StreamBody::new(stream).boxed_unsync()
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_moving_is_never_cut() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let body = IdleTimeoutBody::new(body_from(rx), Duration::from_millis(100));
        let sender = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(60)).await;
                tx.send(Bytes::from_static(b"x")).await.unwrap();
            }
        });
        let got = body.collect().await.unwrap().to_bytes();
        sender.await.unwrap();
        assert_eq!(got.len(), 10, "600 ms in all, never 100 ms without data");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_fails_with_a_408() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(Bytes::from_static(b"{\"model\":")).await.unwrap();
        let body = IdleTimeoutBody::new(body_from(rx), Duration::from_millis(100));
        let err = body.collect().await.unwrap_err();
        let e = body_read_error(&err);
        assert!(matches!(e, ProxyError::RequestTimeout(100)), "{e:?}");
        assert_eq!(e.status(), http::StatusCode::REQUEST_TIMEOUT);
        drop(tx);
    }

    #[test]
    fn other_body_errors_stay_400() {
        let e = body_read_error(&std::io::Error::other("reset"));
        assert_eq!(e.status(), http::StatusCode::BAD_REQUEST);
    }

    #[test]
    fn the_open_files_limit_is_read() {
        if cfg!(target_os = "linux") {
            assert!(open_files_limit().is_some_and(|n| n > 0));
        }
    }
}
