//! Open-loop constant-rate load generation. Each request has a scheduled send time and its
//! latency is measured from that time, so a stalled server is charged for the requests it
//! delayed (no coordinated omission).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// What one run measured. Latencies are in microseconds.
#[derive(Debug)]
pub struct LoadResult {
    pub sent: u64,
    pub ok: u64,
    pub errors: u64,
    pub latency_us: Histogram<u64>,
    pub elapsed: Duration,
}

impl LoadResult {
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.latency_us.value_at_quantile(q) as f64 / 1000.0
    }
}

/// One request template.
#[derive(Clone)]
pub struct Target {
    pub url: String,
    pub body: Bytes,
    pub headers: Vec<(String, String)>,
}

/// Sends `rate` requests per second for `duration`, at most `max_in_flight` at once (beyond
/// that, requests wait and their wait counts as latency).
pub async fn open_loop(
    target: &Target,
    rate: f64,
    duration: Duration,
    max_in_flight: usize,
) -> Result<LoadResult, hdrhistogram::CreationError> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_in_flight)
        .build(connector);
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let counts = Arc::new(std::sync::Mutex::new((0u64, 0u64)));
    let permits = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
    let total = (rate * duration.as_secs_f64()).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let scheduled = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(scheduled).await;
        let client = client.clone();
        let target = target.clone();
        let hist = hist.clone();
        let counts = counts.clone();
        let permits = permits.clone();
        tasks.spawn(async move {
            let Ok(_permit) = permits.acquire_owned().await else {
                return;
            };
            let mut req = hyper::Request::post(&target.url);
            for (k, v) in &target.headers {
                req = req.header(k, v);
            }
            let ok = match req.body(Full::new(target.body.clone())) {
                Ok(req) => match client.request(req).await {
                    Ok(resp) => {
                        let good = resp.status().is_success();
                        good && resp.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                },
                Err(_) => false,
            };
            let us = scheduled.elapsed().as_micros() as u64;
            hist.lock().await.saturating_record(us.max(1));
            if let Ok(mut c) = counts.lock() {
                if ok {
                    c.0 += 1;
                } else {
                    c.1 += 1;
                }
            }
        });
        // Reap finished tasks as we go so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = start.elapsed();
    let (ok, errors) = counts.lock().map(|c| *c).unwrap_or((0, 0));
    // Every task has finished, so this is the only reference left.
    let latency_us = hist.lock().await.clone();
    Ok(LoadResult {
        sent: total,
        ok,
        errors,
        latency_us,
        elapsed,
    })
}
