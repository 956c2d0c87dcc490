//! The loop's data path under a long run: one-turn episodes through `hindsight proxy` (Kafka
//! logging on, a fixed-latency mock upstream) with a signed thumb on each through the proxy's
//! feedback API, joined by a `hindsight join` process into episode records that a reader
//! follows on the episodes topic, all on the local broker and Redis (issue 38 item 0: "1M
//! records through proxy → joiner, produce and fetch latency over time, steady").
//!
//! Each episode is three records (the interaction, its feedback, the joined episode), so the
//! default 333,334 episodes are a million records. Per window of the run: chat requests and
//! feedback posts answered, episodes read (first time), and the end-to-end latency from the
//! chat request's send to its episode record's fetch (p50 / p99 / max), with the proxy's spill.
//! "Steady" means the last full window's latencies stay near the first's, every episode
//! arrives, nothing is dropped and nothing waits in the spill.
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench pipeline_soak                    # 333,334 episodes
//! EPISODES=20000 RATE=400 cargo bench -p hindsight-bench --bench pipeline_soak
//! ```
//! Knobs (env; a value that does not parse stops the run): EPISODES=333334, RATE=250 (episodes
//! started per second: that many chat requests and feedback posts each), WINDOW_S=30,
//! UPSTREAM_LATENCY_MS=10, PARTITIONS=1, MAX_IN_FLIGHT=256 (chat + feedback requests at once;
//! beyond it, sends wait and the wait counts), DRAIN_S=300 (how long to wait for the last
//! episodes), KAFKA_BROKERS, REDIS_URL. Topics and Redis keys are fresh (`soak-<uuid>`).
//!
//! What it does not cover: the learner (it reads the same topic, at its own pace) and more
//! cores than this machine has: the driver, proxy, joiner, broker, PostgreSQL and Redis share
//! its CPUs, so the rate it sustains is the machine's, not any one part's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use hindsight_bench::child::{brokers, log_config, metric_sum, run_role, ChildProc};
use hindsight_bench::knobs::knob;
use hindsight_feedback::{
    sign, EpisodeRecord, Secret, Topic, TopicReader, SIGNATURE_HEADER, TIMESTAMP_HEADER,
};
use uuid::Uuid;

const SECRET: &str = "pipeline-soak-secret";

fn main() -> anyhow::Result<()> {
    if let Some(role) = run_role() {
        return role;
    }
    let knobs = Knobs {
        episodes: knob("EPISODES", 333_334)?,
        rate: knob("RATE", 250.0)?,
        window_s: knob("WINDOW_S", 30)?,
        upstream_latency_ms: knob("UPSTREAM_LATENCY_MS", 10.0)?,
        partitions: knob("PARTITIONS", 1)?,
        max_in_flight: knob("MAX_IN_FLIGHT", 256)?,
        drain_s: knob("DRAIN_S", 300)?,
    };
    if knobs.episodes == 0
        || knobs.rate <= 0.0
        || knobs.window_s == 0
        || knobs.partitions < 1
        || knobs.max_in_flight == 0
    {
        bail!("EPISODES, RATE, WINDOW_S, PARTITIONS and MAX_IN_FLIGHT must be positive");
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(parent(knobs))
}

struct Knobs {
    episodes: u64,
    rate: f64,
    window_s: u64,
    upstream_latency_ms: f64,
    partitions: i32,
    max_in_flight: usize,
    drain_s: u64,
}

/// Counters the driver's tasks add to.
#[derive(Default)]
struct Sent {
    chat_ok: AtomicU64,
    chat_failed: AtomicU64,
    feedback_ok: AtomicU64,
    feedback_failed: AtomicU64,
}

/// One window's figures, by the time an episode was read.
struct Window {
    chat_ok: u64,
    feedback_ok: u64,
    episodes: u64,
    latency_us: Histogram<u64>,
}

impl Window {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            chat_ok: 0,
            feedback_ok: 0,
            episodes: 0,
            latency_us: Histogram::new_with_bounds(1, 3_600_000_000, 3)?,
        })
    }
}

async fn parent(k: Knobs) -> anyhow::Result<()> {
    let prefix = format!("soak-{}", Uuid::now_v7().simple());
    let spill = tempfile::tempdir()?;
    let mock = ChildProc::start(
        "mock",
        &[("UPSTREAM_LATENCY_MS", k.upstream_latency_ms.to_string())],
    )?;
    let proxy = ChildProc::start(
        "proxy",
        &[
            (
                "HINDSIGHT_PROXY__UPSTREAM_URL",
                format!("http://{}", mock.ready[0]),
            ),
            ("HINDSIGHT_LOG__BROKERS", brokers()),
            ("HINDSIGHT_LOG__TOPIC_PREFIX", prefix.clone()),
            ("HINDSIGHT_LOG__TOPIC_PARTITIONS", k.partitions.to_string()),
            (
                "HINDSIGHT_LOG__SPILL_DIR",
                spill.path().display().to_string(),
            ),
            (
                "HINDSIGHT_FEEDBACK__SIGNING__SECRETS",
                format!("[\"{SECRET}\"]"),
            ),
            ("RUST_LOG", "warn".into()),
        ],
    )?;
    let (proxy_addr, admin) = (proxy.ready[0].clone(), proxy.ready[1].clone());
    let joiner = ChildProc::start(
        "joiner",
        &[
            ("BENCH_PREFIX", prefix.clone()),
            ("PARTITIONS", k.partitions.to_string()),
            ("RUST_LOG", "warn".into()),
        ],
    )?;
    let reader_spill = tempfile::tempdir()?;
    let reader = TopicReader::new(
        &log_config(&prefix, k.partitions, reader_spill.path()).validate()?,
        &format!("{prefix}-reader"),
        &[Topic::Episodes],
    )
    .context("reader")?;
    println!(
        "pipeline_soak: {} one-turn episodes ({} records: interaction, thumb, episode) at {} /s through hindsight proxy -> hindsight join, upstream {} ms, {} partition(s), broker {}, topics {prefix}.*",
        k.episodes,
        k.episodes * 3,
        k.rate,
        k.upstream_latency_ms,
        k.partitions,
        brokers()
    );

    let started = Instant::now();
    let sent_us: Arc<Vec<AtomicU64>> =
        Arc::new((0..k.episodes).map(|_| AtomicU64::new(0)).collect());
    let sent = Arc::new(Sent::default());
    let driver = tokio::spawn(drive(
        proxy_addr,
        prefix.clone(),
        k.episodes,
        k.rate,
        k.max_in_flight,
        started,
        sent_us.clone(),
        sent.clone(),
    ));

    // The reader, on this task: each episode's first record with its thumb, into its window.
    let mut windows: Vec<Window> = Vec::new();
    let mut seen = vec![false; k.episodes as usize];
    let (mut read, mut repeats, mut foreign) = (0u64, 0u64, 0u64);
    let mut before = (0u64, 0u64);
    let mut overall = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)?;
    let mut last_progress = Instant::now();
    println!("| window | chat answered | feedback accepted | episodes read | latency p50 ms | p99 ms | max ms | proxy spill pending |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let close = |w: &mut Window, i: usize, before: &mut (u64, u64), pending: f64| {
        let now = (
            sent.chat_ok.load(Ordering::Relaxed),
            sent.feedback_ok.load(Ordering::Relaxed),
        );
        w.chat_ok = now.0 - before.0;
        w.feedback_ok = now.1 - before.1;
        *before = now;
        let ms = |q: f64| w.latency_us.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "| {}–{} s | {} | {} | {} | {:.1} | {:.1} | {:.1} | {pending} |",
            i as u64 * k.window_s,
            (i as u64 + 1) * k.window_s,
            w.chat_ok,
            w.feedback_ok,
            w.episodes,
            ms(0.5),
            ms(0.99),
            w.latency_us.max() as f64 / 1000.0
        );
    };
    while read < k.episodes {
        let idx = (started.elapsed().as_secs() / k.window_s) as usize;
        while windows.len() <= idx {
            let n = windows.len();
            if let Some(w) = windows.last_mut() {
                let pending = metric_sum(&admin, "hindsight_log_spill_pending_records").await;
                close(w, n - 1, &mut before, pending);
            }
            windows.push(Window::new()?);
        }
        let Some(rec) = reader.recv_timeout(Duration::from_millis(500)).await? else {
            if driver.is_finished() && last_progress.elapsed() > Duration::from_secs(k.drain_s) {
                break;
            }
            continue;
        };
        let ep: EpisodeRecord = rec.decode()?;
        let Some(i) = ep
            .episode_id
            .strip_prefix(&format!("{prefix}-"))
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&i| i < seen.len())
        else {
            foreign += 1;
            continue;
        };
        if ep.feedback.is_empty() {
            continue;
        }
        if std::mem::replace(&mut seen[i], true) {
            repeats += 1;
            continue;
        }
        let lat = (started.elapsed().as_micros() as u64)
            .saturating_sub(sent_us[i].load(Ordering::Relaxed))
            .max(1);
        if let Some(w) = windows.last_mut() {
            w.episodes += 1;
            w.latency_us.record(lat)?;
        }
        overall.record(lat)?;
        read += 1;
        last_progress = Instant::now();
    }
    driver.await.context("the driver panicked")??;
    let wall = started.elapsed().as_secs_f64();
    let n = windows.len();
    let pending = metric_sum(&admin, "hindsight_log_spill_pending_records").await;
    if let Some(w) = windows.last_mut() {
        close(w, n - 1, &mut before, pending);
    }
    let delivered = metric_sum(&admin, "hindsight_log_delivered_records_total").await;
    let spilled = metric_sum(&admin, "hindsight_log_spilled_records_total").await;
    let dropped = metric_sum(&admin, "hindsight_log_dropped_records_total").await;
    let (rss, peak) = proxy.rss_mib();
    let (proxy_cpu, joiner_cpu) = (proxy.cpu_seconds(), joiner.cpu_seconds());
    ChildProc::stop_all(vec![joiner, proxy, mock]);

    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let full: Vec<&Window> = windows.iter().filter(|w| w.episodes > 0).collect();
    println!(
        "\n{read} of {} episodes read in {wall:.0} s; request -> episode latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        k.episodes,
        ms(&overall, 0.5),
        ms(&overall, 0.99),
        overall.max() as f64 / 1000.0
    );
    if let (Some(f), Some(l)) = (full.first(), full.get(full.len().saturating_sub(2))) {
        println!(
            "first window p99 {:.1} ms, last full window p99 {:.1} ms ({:.2}x)",
            ms(&f.latency_us, 0.99),
            ms(&l.latency_us, 0.99),
            ms(&l.latency_us, 0.99) / ms(&f.latency_us, 0.99).max(0.001)
        );
    }
    let chat_failed = sent.chat_failed.load(Ordering::Relaxed);
    let feedback_failed = sent.feedback_failed.load(Ordering::Relaxed);
    println!(
        "chat failed {chat_failed}, feedback refused {feedback_failed}; proxy log: delivered {delivered}, spilled {spilled}, dropped {dropped}, spill pending {pending}; episode records repeated {repeats}, foreign {foreign}"
    );
    println!(
        "proxy RSS {rss:.1} MiB (peak {peak:.1}), CPU {:.1} µs per episode; joiner CPU {:.1} µs per episode",
        proxy_cpu / k.episodes as f64 * 1e6,
        joiner_cpu / k.episodes as f64 * 1e6
    );
    if read < k.episodes || chat_failed > 0 || feedback_failed > 0 || dropped > 0.0 {
        bail!(
            "not steady: {read} of {} episodes read, {chat_failed} chat and {feedback_failed} feedback failures, {dropped} records dropped",
            k.episodes
        );
    }
    Ok(())
}

/// Starts episode `i` at `started + i / rate`: its chat request (episode header) and, once
/// answered, its signed thumb; the send time goes to `sent_us[i]`.
#[allow(clippy::too_many_arguments)]
async fn drive(
    proxy: String,
    prefix: String,
    episodes: u64,
    rate: f64,
    max_in_flight: usize,
    started: Instant,
    sent_us: Arc<Vec<AtomicU64>>,
    sent: Arc<Sent>,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(max_in_flight)
        .timeout(Duration::from_secs(60))
        .build()?;
    let permits = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
    let secret = Secret::new(SECRET);
    let per = Duration::from_secs_f64(1.0 / rate);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..episodes {
        let due = started + per.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let permit = permits.clone().acquire_owned().await?;
        let (client, proxy, secret) = (client.clone(), proxy.clone(), secret.clone());
        let (sent_us, sent) = (sent_us.clone(), sent.clone());
        let episode = format!("{prefix}-{i}");
        tasks.spawn(async move {
            let _permit = permit;
            // Latency counts from the scheduled start, so a stalled proxy is charged for it.
            if let Some(slot) = sent_us.get(i as usize) {
                slot.store(
                    due.saturating_duration_since(started).as_micros() as u64,
                    Ordering::Relaxed,
                );
            }
            let chat = client
                .post(format!("http://{proxy}/v1/chat/completions"))
                .header("authorization", "Bearer sk-soak")
                .header(hindsight_core::headers::EPISODE, &episode)
                .json(&serde_json::json!({
                    "model": "mock-model",
                    "messages": [
                        {"role": "system", "content": "You route customer-support tickets."},
                        {"role": "user", "content": format!("Ticket {i}: my order arrived damaged, I want a refund.")}
                    ]
                }))
                .send()
                .await;
            let answered = match chat {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            if !answered {
                sent.chat_failed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            sent.chat_ok.fetch_add(1, Ordering::Relaxed);
            let body = serde_json::to_vec(&serde_json::json!({
                "episode_id": episode, "kind": "thumbs", "value": i % 3 != 0, "source": "soak",
            }))
            .unwrap_or_default();
            let ts = hindsight_feedback::now_ms() / 1000;
            let signature = sign(&secret, ts, &body);
            let posted = client
                .post(format!("http://{proxy}/hindsight/v1/feedback"))
                .header("content-type", "application/json")
                .header(TIMESTAMP_HEADER, ts.to_string())
                .header(SIGNATURE_HEADER, format!("v1={signature}"))
                .body(body)
                .send()
                .await;
            match posted {
                Ok(r) if r.status().as_u16() == 202 => {
                    sent.feedback_ok.fetch_add(1, Ordering::Relaxed)
                }
                _ => sent.feedback_failed.fetch_add(1, Ordering::Relaxed),
            };
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}
