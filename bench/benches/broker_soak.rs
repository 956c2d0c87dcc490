//! Does the local broker hold up? Records of an interaction's size go through the record log
//! (the proxy's and the joiner's producer) into the broker at a fixed rate while a reader (the
//! joiner's and the learner's consumer) follows the topic; per window of the run: records
//! produced and read (distinct ids), and the end-to-end latency from submit to fetch (p50 / p99 / max).
//! "Steady" means the last window's latencies stay near the first's, nothing is dropped and
//! nothing waits in the spill.
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench broker_soak                 # 1,000,000 records
//! RECORDS=200000 RATE=4000 cargo bench -p hindsight-bench --bench broker_soak
//! ```
//! Knobs (env; a value that does not parse stops the run): RECORDS=1000000, RATE=5000
//! (records/s submitted), PAYLOAD_BYTES=2500 (the size of a logged single-turn interaction),
//! WINDOW_S=20, DRAIN_S=300 (how long to wait for the reader after the last submit),
//! KAFKA_BROKERS=127.0.0.1:9092. The topics are fresh (`soak-<uuid>`); the broker keeps them.
//!
//! What it does not cover: the proxy's HTTP path and the joiner's Redis work (their costs are in
//! the proxy_overhead bench and tests/joiners.rs); this is the broker under their record volume.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use hindsight_bench::knobs::knob;
use hindsight_feedback::{LogConfig, RecordLog, Topic, TopicReader};
use uuid::Uuid;

/// One window's figures, by the time a record was read.
struct Window {
    produced: u64,
    read: u64,
    latency_us: Histogram<u64>,
}

impl Window {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            produced: 0,
            read: 0,
            latency_us: Histogram::new_with_bounds(1, 600_000_000, 3)?,
        })
    }
}

fn main() -> anyhow::Result<()> {
    let records: u64 = knob("RECORDS", 1_000_000)?;
    let rate: f64 = knob("RATE", 5_000.0)?;
    let payload_bytes: usize = knob("PAYLOAD_BYTES", 2_500)?;
    let window_s: u64 = knob("WINDOW_S", 20)?;
    let drain_s: u64 = knob("DRAIN_S", 300)?;
    if records == 0 || rate <= 0.0 || payload_bytes < 16 || window_s == 0 {
        bail!("RECORDS, RATE and WINDOW_S must be positive and PAYLOAD_BYTES at least 16");
    }
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(
        records,
        rate,
        payload_bytes,
        window_s,
        drain_s,
        brokers,
    ))
}

async fn run(
    records: u64,
    rate: f64,
    payload_bytes: usize,
    window_s: u64,
    drain_s: u64,
    brokers: String,
) -> anyhow::Result<()> {
    let spill = tempfile::tempdir()?;
    let cfg = LogConfig {
        brokers,
        topic_prefix: format!("soak-{}", Uuid::now_v7().simple()),
        spill_dir: spill.path().to_path_buf(),
        ..LogConfig::default()
    }
    .validate()?;
    let (log, handle) = RecordLog::start(cfg.clone()).await?;
    let reader = TopicReader::new(
        &cfg,
        &format!("soak-{}", Uuid::now_v7()),
        &[Topic::Interactions],
    )
    .context("reader")?;
    let started = Instant::now();
    let produced = Arc::new(AtomicU64::new(0));

    // The producer: paced submits; each payload starts with its submit time (µs since start).
    let producer = {
        let (handle, produced) = (handle.clone(), produced.clone());
        tokio::spawn(async move {
            let pad = "x".repeat(payload_bytes - 16);
            let per = Duration::from_secs_f64(1.0 / rate);
            for i in 0..records {
                let due = started + per.mul_f64(i as f64);
                let now = Instant::now();
                if due > now {
                    tokio::time::sleep(due - now).await;
                }
                let t = started.elapsed().as_micros() as u64;
                let payload = Bytes::from(format!("{t:016}{pad}"));
                handle.submit(
                    Topic::Interactions,
                    format!("episode-{}", i % 1024),
                    Uuid::now_v7(),
                    payload,
                );
                produced.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    // The reader, on this task: every record's latency into its window.
    let mut windows: Vec<Window> = Vec::new();
    let mut read = 0u64;
    let (mut seen, mut duplicates) = (std::collections::HashSet::new(), 0u64);
    let mut last_progress = Instant::now();
    let mut produced_before = 0u64;
    let mut overall = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    println!("| window | submitted | read | latency p50 ms | p99 ms | max ms | spill pending |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let print_window = |w: &Window, i: usize, pending: u64| {
        let ms = |q: f64| w.latency_us.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "| {}–{} s | {} | {} | {:.1} | {:.1} | {:.1} | {pending} |",
            i as u64 * window_s,
            (i as u64 + 1) * window_s,
            w.produced,
            w.read,
            ms(0.5),
            ms(0.99),
            w.latency_us.max() as f64 / 1000.0
        );
    };
    while read < records {
        let idx = (started.elapsed().as_secs() / window_s) as usize;
        while windows.len() <= idx {
            let n = windows.len();
            if let Some(w) = windows.last_mut() {
                let now_produced = produced.load(Ordering::Relaxed);
                w.produced = now_produced - produced_before;
                produced_before = now_produced;
                print_window(w, n - 1, handle.stats().spill_pending_records);
            }
            windows.push(Window::new()?);
        }
        let Some(rec) = reader.recv_timeout(Duration::from_millis(500)).await? else {
            let submitting = produced.load(Ordering::Relaxed) < records;
            if !submitting && last_progress.elapsed() > Duration::from_secs(drain_s) {
                bail!("{read} of {records} records read; nothing more for {drain_s} s");
            }
            continue;
        };
        // At least once: a record the log re-sent after a timeout may arrive twice.
        if !seen.insert(rec.id.context("a record without its id")?) {
            duplicates += 1;
            continue;
        }
        let sent_us: u64 = std::str::from_utf8(rec.payload.get(..16).unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .context("a record without its submit time")?;
        let lat = (started.elapsed().as_micros() as u64)
            .saturating_sub(sent_us)
            .max(1);
        if let Some(w) = windows.last_mut() {
            w.read += 1;
            w.latency_us.record(lat)?;
        }
        overall.record(lat)?;
        read += 1;
        last_progress = Instant::now();
    }
    producer.await?;
    let n = windows.len();
    if let Some(w) = windows.last_mut() {
        w.produced = produced.load(Ordering::Relaxed) - produced_before;
        print_window(w, n - 1, handle.stats().spill_pending_records);
    }
    let wall = started.elapsed().as_secs_f64();
    let stats = handle.stats();
    let report = log.shutdown(Duration::from_secs(30)).await;
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let full: Vec<&Window> = windows.iter().filter(|w| w.read > 0).collect();
    let (first, last) = (full.first(), full.get(full.len().saturating_sub(2)));
    println!(
        "\n{records} records of {payload_bytes} B at {rate} /s: all read in {wall:.0} s; latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(&overall, 0.5),
        ms(&overall, 0.99),
        overall.max() as f64 / 1000.0
    );
    if let (Some(f), Some(l)) = (first, last) {
        println!(
            "first window p99 {:.1} ms, last full window p99 {:.1} ms ({:.2}x)",
            ms(&f.latency_us, 0.99),
            ms(&l.latency_us, 0.99),
            ms(&l.latency_us, 0.99) / ms(&f.latency_us, 0.99).max(0.001)
        );
    }
    println!(
        "spilled {} (replayed {}), dropped {}, delivered {}, read twice {duplicates}",
        stats.spilled_records,
        stats.replayed_records,
        report.dropped_records,
        report.delivered_records
    );
    if report.dropped_records > 0 {
        bail!("{} records dropped", report.dropped_records);
    }
    Ok(())
}
