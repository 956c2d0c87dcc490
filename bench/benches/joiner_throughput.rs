//! Joiner throughput: how fast K `hindsight join` processes in one group turn a backlog of
//! interactions and feedback into episode records, on the real broker and Redis (issue 38:
//! "which parts scale out by adding processes").
//!
//! For each K in `JOINERS` (default `1 2 3`): a fresh topic set with `PARTITIONS` partitions
//! (default 6) gets `EPISODES` one-turn episodes (default 2,000), each an interaction, a thumb
//! on it and a score on the episode (3 input records; the feedback keyed by its target, so a
//! turn and its feedback usually sit on different partitions). Then K joiner processes (this
//! binary re-executed as `HINDSIGHT_BENCH_ROLE=joiner`, each running `run_joiner` with the
//! default batch settings) start together, and a reader follows the episodes topic until every
//! turn's latest record carries both feedback events. Printed per K: input records per second
//! from the first episode record to the last (steady state, after the group has divided the
//! partitions), the time from start to the first record (membership), and episode records
//! emitted per turn (a turn goes out again when more feedback arrives).
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench joiner_throughput
//! JOINERS="1 2" EPISODES=5000 cargo bench -p hindsight-bench --bench joiner_throughput
//! ```
//!
//! What it does not say: the cost of the proxy's writes running at the same time (the backlog
//! is written first), or more cores than this machine has (every process shares its 2 vCPUs
//! with the broker and Redis).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hindsight_bench::child::{brokers, log_config, run_role, ChildProc};
use hindsight_bench::knobs::{knob, knob_list};
use hindsight_feedback::{
    EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue, InteractionRecord, RecordLog,
    Topic, TopicReader,
};
use serde_json::json;
use uuid::Uuid;

fn main() -> anyhow::Result<()> {
    if let Some(role) = run_role() {
        return role;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(parent())
}

fn interaction(episode: &str, t: i64) -> InteractionRecord {
    InteractionRecord::chat(
        episode,
        json!({"model": "m", "temperature": 0.7, "messages": [
            {"role": "system", "content": "You route customer-support tickets."},
            {"role": "user", "content": format!("Ticket {episode}: my order arrived damaged, I want a refund.")}]}),
        json!({"choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "{\"department\": \"returns\", \"priority\": \"normal\", \"refund\": \"full\"}"}}]}),
        t,
    )
}

/// One K's run: the backlog, the joiners, the reader. Returns the printed line's figures.
struct Run {
    joiners: usize,
    input_records: usize,
    to_first_s: f64,
    steady_s: f64,
    episode_records: usize,
}

async fn run_one(joiners: usize, episodes: usize, partitions: i32) -> anyhow::Result<Run> {
    let prefix = format!("bench-join-{}", Uuid::now_v7().simple());
    let spill = tempfile::tempdir()?;
    let cfg = log_config(&prefix, partitions, spill.path()).validate()?;
    let (log, h) = RecordLog::start(cfg.clone()).await?;
    let now = hindsight_feedback::now_ms();
    let mut want: HashMap<Uuid, BTreeSet<Uuid>> = HashMap::new();
    for k in 0..episodes {
        let ep = format!("{prefix}-{k}");
        let i = interaction(&ep, now);
        h.submit_json(Topic::Interactions, ep.clone(), i.interaction_id, &i);
        let thumb = FeedbackRecord::new(
            FeedbackTarget::Interaction(i.interaction_id),
            FeedbackValue::Thumbs(k % 3 != 0),
            now,
        );
        let score = FeedbackRecord {
            metric: Some("quality".into()),
            ..FeedbackRecord::new(
                FeedbackTarget::Episode(ep.clone()),
                FeedbackValue::Score(0.5),
                now,
            )
        };
        for f in [&thumb, &score] {
            h.submit_json(Topic::Feedback, f.target.key(), f.feedback_id, f);
        }
        want.insert(
            i.interaction_id,
            [thumb.feedback_id, score.feedback_id].into(),
        );
    }
    let report = log.shutdown(Duration::from_secs(600)).await;
    if !report.complete || report.dropped_records > 0 {
        bail!("the backlog did not all reach the broker: {report:?}");
    }

    let reader = TopicReader::new(&cfg, &format!("{prefix}-reader"), &[Topic::Episodes])?;
    let started = Instant::now();
    let children = (0..joiners)
        .map(|_| {
            ChildProc::start(
                "joiner",
                &[
                    ("BENCH_PREFIX", prefix.clone()),
                    ("PARTITIONS", partitions.to_string()),
                    ("RUST_LOG", "warn".into()),
                ],
            )
            .context("starting a joiner")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut latest: HashMap<Uuid, BTreeSet<Uuid>> = HashMap::new();
    let (mut first, mut last, mut records) = (None, started, 0usize);
    let deadline = started + Duration::from_secs(knob("TIMEOUT_S", 900)?);
    let mut complete = 0usize;
    while complete < want.len() {
        if Instant::now() > deadline {
            bail!(
                "{complete} of {} turns complete after the timeout",
                want.len()
            );
        }
        let Some(rec) = reader.recv_timeout(Duration::from_millis(500)).await? else {
            continue;
        };
        let ep: EpisodeRecord = rec.decode()?;
        records += 1;
        first.get_or_insert_with(Instant::now);
        last = Instant::now();
        let ids: BTreeSet<Uuid> = ep.feedback.iter().map(|f| f.feedback_id).collect();
        let was = latest.get(&ep.turn) == want.get(&ep.turn);
        let is = want.get(&ep.turn) == Some(&ids);
        latest.insert(ep.turn, ids);
        match (was, is) {
            (false, true) => complete += 1,
            (true, false) => complete -= 1,
            _ => {}
        }
    }
    ChildProc::stop_all(children);
    let first = first.unwrap_or(started);
    Ok(Run {
        joiners,
        input_records: episodes * 3,
        to_first_s: (first - started).as_secs_f64(),
        steady_s: (last - first).as_secs_f64(),
        episode_records: records,
    })
}

async fn parent() -> anyhow::Result<()> {
    let joiner_counts: Vec<usize> = knob_list("JOINERS", vec![1, 2, 3])?;
    let episodes: usize = knob("EPISODES", 2000)?;
    let partitions: i32 = knob("PARTITIONS", 6)?;
    if joiner_counts.is_empty() || joiner_counts.contains(&0) || episodes == 0 || partitions < 1 {
        bail!("JOINERS must list counts >= 1, EPISODES >= 1, PARTITIONS >= 1");
    }
    println!(
        "joiner_throughput: {episodes} one-turn episodes (interaction + thumb + score), {partitions} partitions, broker {}",
        brokers()
    );
    println!("| joiners | input records | to first record | steady | input records/s | episode records per turn |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for k in joiner_counts {
        let r = run_one(k, episodes, partitions).await?;
        // Under a second of steady state the rate says nothing (one batch can carry it all).
        let rate = if r.steady_s >= 1.0 {
            format!("{:.0}", r.input_records as f64 / r.steady_s)
        } else {
            "— (under 1 s: raise EPISODES)".into()
        };
        println!(
            "| {} | {} | {:.1} s | {:.1} s | {rate} | {:.2} |",
            r.joiners,
            r.input_records,
            r.to_first_s,
            r.steady_s,
            r.episode_records as f64 / episodes as f64
        );
    }
    Ok(())
}
