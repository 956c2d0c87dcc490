//! A fixed-latency mock OpenAI-compatible upstream for proxy benchmarks (the same shape as
//! ../shared/peers/mock, so figures compare with the peer baselines).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

const CHAT_BODY: &str = r#"{"id":"chatcmpl-mock","object":"chat.completion","created":1700000000,"model":"mock-model","choices":[{"index":0,"message":{"role":"assistant","content":"The refund goes to billing; priority high."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":9,"total_tokens":51}}"#;

/// Serves every request after `delay` with a small chat.completion body, until the process
/// ends. Returns the bound address.
pub async fn serve(listener: TcpListener, delay: Duration) -> std::io::Result<()> {
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| async move {
                // Drain the body like a real server would.
                let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                tokio::time::sleep(delay).await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(CHAT_BODY.as_bytes())))
                        .unwrap_or_default(),
                )
            });
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// Binds 127.0.0.1:0 and serves in the background; returns the address.
pub async fn spawn(delay: Duration) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve(listener, delay));
    Ok(addr)
}
