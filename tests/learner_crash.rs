//! Crash/restart of `hindsight learner` with SIGKILL: no example is lost or repeated.
//!
//! Real parts only: the `hindsight` binary as a child process, the real Kafka-protocol broker
//! (KAFKA_BROKERS, default 127.0.0.1:9092) and the real default model. The test writes
//! episode records to a fresh topic (trainable ones, two without an answer, two exact
//! duplicates), then runs the learner, kills it with SIGKILL three times at pseudo-random
//! moments (right after a "batch" line, right after a "checkpoint" line, or a little later in
//! the middle of a step or a save) and restarts it; the fourth run stops by itself at
//! `max_records`.
//!
//! It then replays the run log: every "start" line says which batch counter the process
//! restored from its checkpoint, so "batch" lines numbered above it died with the previous
//! process. What remains must train every trainable record exactly once, and nothing else; the
//! final checkpoint and the consumer group's committed offsets must stand at the end of the
//! topic. `CRASH_SEED=<n>` replays a given schedule of kills; `CRASH_KAFKA_DEBUG=1` adds
//! librdkafka's consumer-group debugging to the learners' logs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_feedback::{
    ensure_topics, now_ms, Correction, EpisodeContext, EpisodeRecord, EpisodeSource,
    FeedbackRecord, FeedbackTarget, FeedbackValue, LogConfig, Topic,
};
use hindsight_learner::checkpoint::LoopState;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use uuid::Uuid;

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Trainable records.
const TRAINABLE: usize = 38;
/// Records without an answer (skipped as `no_answer`), at these positions among the trainable.
const NO_ANSWER_AT: [usize; 2] = [5, 17];
/// A trainable record re-sent (same record id) much later, as a re-emitting joiner would: the
/// dedup memory in the checkpoints must catch it (across restarts).
const DUPLICATE_OF: usize = 2;
const DUPLICATE_AT: usize = 30;
/// A trainable record re-sent right after itself, as a producer retry would: caught in the
/// micro-batch being gathered, or by the memory when a batch boundary falls between them.
const ADJACENT_DUPLICATE_OF: usize = 11;
/// Records skipped as duplicates.
const DUPLICATES: u64 = 2;
const KILLS: usize = 3;
/// Longest wait for any one thing a run should do.
const RUN_TIMEOUT: Duration = Duration::from_secs(150);
/// How long after a kill the next run starts: at once. The learner owns its partitions and
/// starts from its checkpoint (`assignment = "checkpoint"`, the default), so there is no group
/// rebalance to wait for. (In `group` mode the local broker, tansu 0.6, hands a member that joins
/// while the killed leader's 10 s session is still alive an empty assignment and never
/// rebalances it; this test used to wait 11 s before each restart for that reason.)
const RESTART_AFTER_KILL: Duration = Duration::from_millis(0);

/// The tests of this binary each run learner processes; one at a time keeps the crash test's
/// kill timing as it was measured on two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CAPITALS: [(&str, &str); 8] = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Japan", "Tokyo"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
];

fn model_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(MODEL);
    if !p.is_file() {
        panic!(
            "{} is missing: run deploy/fetch-model.sh to fetch the default model",
            p.display()
        );
    }
    p
}

/// `CRASH_KAFKA_DEBUG=1`: the learners log librdkafka's consumer-group debugging (to see a
/// stalled group in their output, kept in the temp dir when the test fails).
fn kafka_debug() -> bool {
    std::env::var_os("CRASH_KAFKA_DEBUG").is_some_and(|v| v == "1")
}

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// splitmix64: a small deterministic generator for the kill schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// One episode turn: a short question, a short answer and a correction (so SFT applies).
fn episode(i: usize, answered: bool) -> EpisodeRecord {
    let (country, capital) = CAPITALS[i % CAPITALS.len()];
    let turn = Uuid::now_v7();
    let t = now_ms();
    let correction = FeedbackRecord {
        source: Some("crash-test".into()),
        ..FeedbackRecord::new(
            FeedbackTarget::Interaction(turn),
            FeedbackValue::Correction(Correction::Text(format!("{capital}."))),
            t,
        )
    };
    let context = EpisodeContext {
        messages: json!([{"role": "user", "content": format!("Capital of {country}? ({i})")}]),
        ..Default::default()
    };
    let answer = answered.then(|| json!({"role": "assistant", "content": format!("{capital}.")}));
    EpisodeRecord {
        episode_source: EpisodeSource::New,
        turn,
        interaction_time_ms: t,
        feedback_time_ms: t,
        emitted_at_ms: t,
        ..EpisodeRecord::turn(format!("ep-{i}"), context, answer, vec![correction])
    }
}

/// What was written to the topic.
struct Produced {
    topic: String,
    /// Next offset after the last record.
    end_offset: i64,
    /// Records written (duplicates included).
    total: u64,
    trainable: BTreeSet<Uuid>,
    no_answer: BTreeSet<Uuid>,
}

/// The episodes topic (created with one partition) and a producer for it.
async fn episodes_producer(log: &LogConfig) -> (String, FutureProducer) {
    let log = log.clone().validate().unwrap();
    let topic = log.topics().get(Topic::Episodes).to_string();
    ensure_topics(
        &log.client_config(),
        std::slice::from_ref(&topic),
        1,
        1,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let producer: FutureProducer = log
        .client_config()
        .set("acks", "all")
        .set("enable.idempotence", "false")
        .set("message.timeout.ms", "20000")
        .create()
        .unwrap();
    (topic, producer)
}

async fn produce(log: &LogConfig) -> Produced {
    let (topic, producer) = episodes_producer(log).await;

    let mut records = Vec::new();
    let mut trainable = BTreeSet::new();
    let mut no_answer = BTreeSet::new();
    let mut duplicate = None;
    for i in 0..TRAINABLE {
        if NO_ANSWER_AT.contains(&i) {
            let rec = episode(1000 + i, false);
            no_answer.insert(rec.record_id);
            records.push(rec);
        }
        if i == DUPLICATE_AT {
            records.push(duplicate.clone().unwrap());
        }
        let rec = episode(i, true);
        trainable.insert(rec.record_id);
        if i == DUPLICATE_OF {
            duplicate = Some(rec.clone());
        }
        let again = (i == ADJACENT_DUPLICATE_OF).then(|| rec.clone());
        records.push(rec);
        records.extend(again);
    }

    // One at a time, in order: the offsets are then exactly 0..total.
    let mut end_offset = 0;
    for (n, rec) in records.iter().enumerate() {
        let payload = serde_json::to_vec(rec).unwrap();
        let delivery = producer
            .send(
                FutureRecord::to(&topic)
                    .key(&rec.episode_id)
                    .payload(&payload),
                Duration::from_secs(20),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        assert_eq!(
            (delivery.partition, delivery.offset),
            (0, n as i64),
            "record {n} landed out of order"
        );
        end_offset = delivery.offset + 1;
    }
    assert_eq!(
        records.len(),
        TRAINABLE + NO_ANSWER_AT.len() + DUPLICATES as usize
    );
    Produced {
        topic,
        end_offset,
        total: records.len() as u64,
        trainable,
        no_answer,
    }
}

/// The run log's lines, parsed.
fn run_log(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("run log line is not JSON ({e}): {l:?}"))
        })
        .collect()
}

fn event(v: &Value) -> &str {
    v["event"].as_str().unwrap_or("")
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

struct Dirs {
    root: PathBuf,
    config: PathBuf,
    run_log: PathBuf,
    checkpoints: PathBuf,
}

impl Dirs {
    /// What a failure shows: the run's output (logs on stderr, the summary on stdout) and the
    /// run log.
    /// The temp dir is kept on failure.
    fn failure(&self, run: usize, what: &str) -> String {
        format!(
            "run {run}: {what} (files kept in {})\n--- output of run {run} (tail) ---\n{}\n{}\n\
             --- run log (tail) ---\n{}",
            self.root.display(),
            tail(&self.root.join(format!("run{run}.stdout")), 20),
            tail(&self.root.join(format!("run{run}.stderr")), 40),
            tail(&self.run_log, 10),
        )
    }
}

fn spawn(dirs: &Dirs, run: usize) -> Child {
    let out = std::fs::File::create(dirs.root.join(format!("run{run}.stdout"))).unwrap();
    let err = std::fs::File::create(dirs.root.join(format!("run{run}.stderr"))).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hindsight"));
    cmd.arg("learner")
        .arg("-c")
        .arg(&dirs.config)
        .current_dir(&dirs.root)
        .env(
            "RUST_LOG",
            if kafka_debug() {
                "info,librdkafka=debug"
            } else {
                "info"
            },
        )
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // The config file is the whole configuration: no HINDSIGHT_* override from outside.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("HINDSIGHT_") {
            cmd.env_remove(k);
        }
    }
    let child = cmd.spawn().unwrap();
    eprintln!("crash test: run {run} is pid {}", child.id());
    child
}

/// When a run is killed: after `count` new lines of `event`, plus `delay`.
#[derive(Debug, Clone, Copy)]
struct Kill {
    event: &'static str,
    count: usize,
    delay: Duration,
}

/// Waits for the kill point of `plan` in run `run` (whose lines start at `from`), then
/// SIGKILLs the child; returns when it is reaped, with the instant of the kill.
async fn kill_at(dirs: &Dirs, run: usize, mut child: Child, from: usize, plan: Kill) -> Instant {
    let deadline = Instant::now() + RUN_TIMEOUT;
    loop {
        let lines = run_log(&dirs.run_log);
        let seen = lines[from.min(lines.len())..]
            .iter()
            .filter(|l| event(l) == plan.event)
            .count();
        if seen >= plan.count {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "{}",
                dirs.failure(run, &format!("exited ({status}) before its kill point"))
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{}",
                dirs.failure(run, &format!("no kill point ({plan:?}) in {RUN_TIMEOUT:?}"))
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if !plan.delay.is_zero() {
        tokio::time::sleep(plan.delay).await;
    }
    child.kill().unwrap(); // SIGKILL on Unix
    let killed = Instant::now();
    let status = child.wait().unwrap();
    assert!(!status.success(), "run {run} was not killed: {status}");
    killed
}

/// Offsets the consumer group has committed for partition 0 of `topic`.
fn committed_offset(brokers: &str, group: &str, topic: &str) -> Option<i64> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap();
    match got.find_partition(topic, 0).map(|p| p.offset()) {
        Some(Offset::Offset(o)) => Some(o),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_learner_neither_loses_nor_repeats_an_example() {
    let _one = ONE_AT_A_TIME.lock().await;
    let started = Instant::now();
    let model = model_path();
    let mut tmp = tempfile::tempdir().unwrap();
    tmp.disable_cleanup(true); // kept when the test fails; removed at the end otherwise
    let id = Uuid::now_v7().simple().to_string();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: format!("test-crash-{id}"),
        spill_dir: tmp.path().join("spill"),
        ..LogConfig::default()
    };
    let group = format!("test-crash-{id}");
    let dirs = Dirs {
        root: tmp.path().to_path_buf(),
        config: tmp.path().join("learner.toml"),
        run_log: tmp.path().join("run.jsonl"),
        checkpoints: tmp.path().join("ckpt"),
    };

    let produced = produce(&log).await;
    let produced_at = started.elapsed();

    let config = format!(
        r#"[log]
brokers = {brokers:?}
topic_prefix = {prefix:?}
spill_dir = {spill:?}
{client_options}

[learner]
model_path = {model:?}
group_id = {group:?}
checkpoint_dir = {ckpt:?}
run_log = {run_log:?}
max_records = {total}
max_batch_examples = 2
max_batch_wait_ms = 300
replay_steps_per_batch = 1
candidate_every_batches = 0
candidate_every_ms = 0

[learner.trainer]
kl_penalty = 0.0

[learner.trainer.objectives]
sft = 1.0
kto = 0.0
distill = 0.0
dense = 0.0
"#,
        brokers = log.brokers,
        prefix = log.topic_prefix,
        spill = log.spill_dir.to_string_lossy(),
        client_options = if kafka_debug() {
            r#"client_options = { debug = "cgrp,consumer" }"#
        } else {
            ""
        },
        model = model.to_string_lossy(),
        ckpt = dirs.checkpoints.to_string_lossy(),
        run_log = dirs.run_log.to_string_lossy(),
        total = produced.total,
    );
    std::fs::write(&dirs.config, config).unwrap();

    // The kill schedule: one kill right after a "batch" line (often before its checkpoint),
    // one right after a "checkpoint" line, one a little later (mid-step or mid-save), in a
    // random order. At least 2 new lines each, so every restart resumes from a checkpoint
    // of this test's training (checkpoints follow every batch).
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() as u64);
    let mut rng = Rng(seed);
    let mut plans = vec![
        Kill {
            event: "batch",
            count: rng.range(2, 4) as usize,
            delay: Duration::ZERO,
        },
        Kill {
            event: "checkpoint",
            count: rng.range(2, 4) as usize,
            delay: Duration::ZERO,
        },
        Kill {
            event: if rng.range(0, 1) == 0 {
                "batch"
            } else {
                "checkpoint"
            },
            count: rng.range(2, 3) as usize,
            delay: Duration::from_millis(rng.range(20, 600)),
        },
    ];
    for i in (1..plans.len()).rev() {
        plans.swap(i, rng.range(0, i as u64) as usize);
    }
    eprintln!("crash test: CRASH_SEED={seed}, kills {plans:?}");

    let mut run_times = Vec::new();
    let mut killed: Option<Instant> = None;
    for (run, plan) in plans.iter().enumerate().take(KILLS) {
        if let Some(k) = killed {
            tokio::time::sleep((k + RESTART_AFTER_KILL).saturating_duration_since(Instant::now()))
                .await;
        }
        let t = Instant::now();
        let from = run_log(&dirs.run_log).len();
        let child = spawn(&dirs, run);
        killed = Some(kill_at(&dirs, run, child, from, *plan).await);
        run_times.push(t.elapsed());
    }

    // The last run finishes by itself at max_records.
    if let Some(k) = killed {
        tokio::time::sleep((k + RESTART_AFTER_KILL).saturating_duration_since(Instant::now()))
            .await;
    }
    let t = Instant::now();
    let mut child = spawn(&dirs, KILLS);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{}",
                dirs.failure(KILLS, &format!("did not finish in {RUN_TIMEOUT:?}"))
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    run_times.push(t.elapsed());
    assert!(
        status.success(),
        "{}",
        dirs.failure(KILLS, &format!("exited with {status}"))
    );

    // The last run stopped at max_records, not early (a stray SIGTERM or SIGINT stops it
    // cleanly too, with exit status 0).
    // (the summary is the pretty JSON at the end of stdout).
    let stdout = std::fs::read_to_string(dirs.root.join(format!("run{KILLS}.stdout"))).unwrap();
    let at = stdout.rfind("\n{\n").map_or(0, |i| i + 1);
    let summary: Value = serde_json::from_str(&stdout[at..]).unwrap();
    assert_eq!(
        summary["records"],
        json!(produced.total),
        "{}",
        dirs.failure(
            KILLS,
            "stopped before max_records: was it sent SIGTERM or SIGINT?"
        )
    );
    assert_eq!(summary["examples"], json!(produced.trainable.len()));

    // Replay the run log.
    let lines = run_log(&dirs.run_log);
    let mut kept: Vec<(u64, Vec<Uuid>)> = Vec::new();
    let mut starts: Vec<(u64, u64)> = Vec::new(); // (checkpoint_seq, batches)
    let mut dropped = 0usize;
    let mut checkpoints: BTreeMap<u64, &Value> = BTreeMap::new();
    for l in &lines {
        match event(l) {
            "checkpoint" => {
                checkpoints.insert(l["seq"].as_u64().unwrap(), l);
            }
            "start" => {
                let restored = l["batches"].as_u64().unwrap();
                let seq = l["checkpoint_seq"].as_u64().unwrap();
                // A restart resumes from the last checkpoint logged, or from one made durable
                // just before the kill whose line did not make it into the log.
                let logged = checkpoints.keys().next_back().copied().unwrap_or(0);
                match checkpoints.get(&seq) {
                    Some(c) => {
                        assert_eq!(seq, logged, "resumed from an older checkpoint: {l}");
                        assert_eq!(c["batches"], l["batches"], "{c} vs {l}");
                        assert_eq!(c["positions"], l["positions"], "{c} vs {l}");
                    }
                    None => assert!(
                        seq == 0 && logged == 0 || seq == logged + 1,
                        "resumed from checkpoint {seq}, last logged {logged}"
                    ),
                }
                starts.push((seq, restored));
                let before = kept.len();
                kept.retain(|(b, _)| *b <= restored);
                dropped += before - kept.len();
                assert_eq!(
                    kept.last().map_or(0, |(b, _)| *b),
                    restored,
                    "a restart restored batch counter {restored}, but the run log's last \
                     surviving batch is another one"
                );
            }
            "batch" => {
                let b = l["batch"].as_u64().unwrap();
                let expected = kept.last().map_or(0, |(b, _)| *b) + 1;
                assert_eq!(b, expected, "batch numbers must run on without gaps: {l}");
                let ids = l["record_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().parse().unwrap())
                    .collect();
                kept.push((b, ids));
            }
            _ => {}
        }
    }
    assert_eq!(starts.len(), KILLS + 1, "one start line per run");
    assert_eq!(
        event(lines.last().unwrap()),
        "stop",
        "the last run stopped cleanly"
    );

    let mut counts: BTreeMap<Uuid, usize> = BTreeMap::new();
    for id in kept.iter().flat_map(|(_, ids)| ids) {
        *counts.entry(*id).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "trained more than once: {repeated:?}");
    let trained: BTreeSet<Uuid> = counts.keys().copied().collect();
    let lost: Vec<_> = produced.trainable.difference(&trained).collect();
    assert!(lost.is_empty(), "never trained: {lost:?}");
    let foreign: Vec<_> = trained.difference(&produced.trainable).collect();
    assert!(
        foreign.is_empty(),
        "trained though not trainable: {foreign:?}"
    );
    assert!(produced.no_answer.is_disjoint(&trained));

    // Not vacuous: the restarts resumed from checkpoints of this test's training.
    let resumed = starts[1..].iter().filter(|(_, b)| *b > 0).count();
    assert!(
        resumed >= 2,
        "only {resumed} restarts resumed from a checkpoint with batches > 0: {starts:?}"
    );
    assert_eq!(starts[0], (0, 0), "the first run starts fresh");

    // The final checkpoint.
    let latest = std::fs::read_to_string(dirs.checkpoints.join("LATEST")).unwrap();
    let state: LoopState = serde_json::from_slice(
        &std::fs::read(dirs.checkpoints.join(latest.trim()).join("loop.json")).unwrap(),
    )
    .unwrap();
    let final_batches = kept.last().unwrap().0;
    assert_eq!(state.examples, produced.trainable.len() as u64);
    assert_eq!(state.records, produced.total);
    assert_eq!(state.batches, final_batches);
    let key = format!("{}/0", produced.topic);
    assert_eq!(
        state.positions,
        BTreeMap::from([(key, produced.end_offset)]),
        "the final checkpoint stands at the end of the topic"
    );
    assert_eq!(
        state.skipped,
        BTreeMap::from([
            ("duplicate".to_string(), DUPLICATES),
            ("no_answer".to_string(), NO_ANSWER_AT.len() as u64)
        ]),
        "skipped and duplicate records are counted once each"
    );
    let remembered: BTreeSet<Uuid> = state.recent_records.iter().copied().collect();
    assert_eq!(remembered, produced.trainable);
    assert_eq!(state.recent_records.len(), produced.trainable.len());

    // Offsets were committed after the last checkpoint.
    assert_eq!(
        committed_offset(&log.brokers, &group, &produced.topic),
        Some(produced.end_offset)
    );

    eprintln!(
        "crash test: {} records ({} trainable), {final_batches} batches kept, {dropped} batch \
         lines dropped by restarts, starts (seq, batches) {starts:?}; produce {produced_at:?}, \
         runs {run_times:?}, total {:?}",
        produced.total,
        produced.trainable.len(),
        started.elapsed()
    );
    tmp.disable_cleanup(false);
}

/// Writes `n` trainable episodes (questions `first..first + n`) to the episodes topic, in order.
async fn produce_episodes(log: &LogConfig, first: usize, n: usize) -> Vec<Uuid> {
    let (topic, producer) = episodes_producer(log).await;
    let mut ids = Vec::new();
    for i in first..first + n {
        let rec = episode(i, true);
        let payload = serde_json::to_vec(&rec).unwrap();
        let id = Uuid::now_v7().to_string();
        producer
            .send(
                FutureRecord::to(&topic)
                    .key(&rec.episode_id)
                    .payload(&payload)
                    .headers(rdkafka::message::OwnedHeaders::new().insert(
                        rdkafka::message::Header {
                            key: "hindsight-id",
                            value: Some(&id),
                        },
                    )),
                Duration::from_secs(20),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        ids.push(rec.record_id);
    }
    ids
}

/// The checkpoint's loop state, with every position moved from `from`'s episodes topic to
/// `to`'s: as if the topic the checkpoint was read from had been replaced under the same name
/// (the local broker emptied, or the topic deleted and created again). Done on the checkpoint
/// rather than by deleting topics, which the local broker handles poorly under other clients.
fn move_positions(checkpoints: &Path, from: &LogConfig, to: &LogConfig) {
    let topic = |l: &LogConfig| {
        l.clone()
            .validate()
            .unwrap()
            .topics()
            .get(Topic::Episodes)
            .to_string()
    };
    let (a, b) = (topic(from), topic(to));
    let latest = std::fs::read_to_string(checkpoints.join("LATEST")).unwrap();
    let path = checkpoints.join(latest.trim()).join("loop.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(&a), "{text}");
    std::fs::write(&path, text.replace(&a, &b)).unwrap();
}

fn final_state(checkpoints: &Path) -> LoopState {
    let latest = std::fs::read_to_string(checkpoints.join("LATEST")).unwrap();
    serde_json::from_slice(
        &std::fs::read(checkpoints.join(latest.trim()).join("loop.json")).unwrap(),
    )
    .unwrap()
}

/// Runs the learner to completion (it stops at `max_records`), or fails the test after
/// [`RUN_TIMEOUT`]; returns whether it exited successfully.
async fn run_to_end(dirs: &Dirs, run: usize) -> bool {
    let mut child = spawn(dirs, run);
    let deadline = Instant::now() + RUN_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{}",
                dirs.failure(run, "did not finish: did it skip the new topic's records?")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A checkpoint outlives its topic (the broker emptied, the topic deleted and created again,
/// as `deploy/test.sh` then `deploy/up.sh` once did to the demo): the learner must notice that
/// its saved positions refer to records that no longer exist and, by default, read the new
/// topic from its beginning, instead of skipping its first records as "already trained".
/// Both ways of noticing are exercised: the record before the position has another id (the new
/// topic is longer), and the position is beyond the new topic's end. With
/// `on_replaced_topic = "refuse"` the learner stops with an error naming the partition. The
/// replacement is made by pointing the checkpoint's positions at a fresh topic
/// ([`move_positions`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_reads_a_replaced_topic_from_its_beginning() {
    let _one = ONE_AT_A_TIME.lock().await;
    let model = model_path();
    let tmp = tempfile::tempdir().unwrap();
    let id = Uuid::now_v7().simple().to_string();
    let log_for = |generation: usize| LogConfig {
        brokers: brokers(),
        topic_prefix: format!("test-replaced-{id}-{generation}"),
        spill_dir: tmp.path().join("spill"),
        ..LogConfig::default()
    };
    let dirs = Dirs {
        root: tmp.path().to_path_buf(),
        config: tmp.path().join("learner.toml"),
        run_log: tmp.path().join("run.jsonl"),
        checkpoints: tmp.path().join("ckpt"),
    };
    let write_config = |log: &LogConfig, max_records: usize, policy: &str| {
        let config = format!(
            r#"[log]
brokers = {brokers:?}
topic_prefix = {prefix:?}
spill_dir = {spill:?}

[learner]
model_path = {model:?}
group_id = "test-replaced-{id}"
checkpoint_dir = {ckpt:?}
run_log = {run_log:?}
max_records = {max_records}
max_batch_examples = 4
max_batch_wait_ms = 300
replay_steps_per_batch = 0
candidate_every_batches = 0
candidate_every_ms = 0
on_replaced_topic = "{policy}"

[learner.trainer]
kl_penalty = 0.0

[learner.trainer.objectives]
sft = 1.0
distill = 0.0
"#,
            brokers = log.brokers,
            prefix = log.topic_prefix,
            spill = log.spill_dir.to_string_lossy(),
            model = model.to_string_lossy(),
            ckpt = dirs.checkpoints.to_string_lossy(),
            run_log = dirs.run_log.to_string_lossy(),
        );
        std::fs::write(&dirs.config, config).unwrap();
    };

    // Run 1: four episodes, trained and checkpointed at position 4.
    let first_topic = log_for(1);
    produce_episodes(&first_topic, 0, 4).await;
    write_config(&first_topic, 4, "restart");
    assert!(run_to_end(&dirs, 1).await, "{}", dirs.failure(1, "failed"));
    let first = final_state(&dirs.checkpoints);
    assert_eq!(
        (first.examples, first.positions.values().copied().max()),
        (4, Some(4))
    );
    assert_eq!(
        first.last_ids.len(),
        1,
        "the position's record id is saved: {first:?}"
    );

    // The topic is replaced by a longer one: offset 3 now holds another record.
    let second_topic = log_for(2);
    produce_episodes(&second_topic, 100, 6).await;
    move_positions(&dirs.checkpoints, &first_topic, &second_topic);
    write_config(&second_topic, 10, "restart");
    assert!(run_to_end(&dirs, 2).await, "{}", dirs.failure(2, "failed"));
    let second = final_state(&dirs.checkpoints);
    assert_eq!(
        second.examples - first.examples,
        6,
        "every record of the new topic is trained, none skipped"
    );
    assert_eq!(second.positions.values().copied().max(), Some(6));
    let stderr = std::fs::read_to_string(dirs.root.join("run2.stderr")).unwrap();
    assert!(stderr.contains("does not refer to this topic"), "{stderr}");

    // Replaced again by a shorter one (the position is beyond its end), and refused.
    let third_topic = log_for(3);
    produce_episodes(&third_topic, 200, 2).await;
    move_positions(&dirs.checkpoints, &second_topic, &third_topic);
    write_config(&third_topic, 12, "refuse");
    assert!(
        !run_to_end(&dirs, 3).await,
        "{}",
        dirs.failure(3, "did not refuse")
    );
    let stderr = std::fs::read_to_string(dirs.root.join("run3.stderr")).unwrap();
    assert!(
        stderr.contains("does not refer to this topic") && stderr.contains("BeyondEnd"),
        "{stderr}"
    );
    // Nothing was trained by the refusing run.
    assert_eq!(final_state(&dirs.checkpoints).examples, second.examples);
}
