//! Several `hindsight join` processes in one consumer group on partitioned topics (issue 38):
//! three joiners share six partitions, one is SIGKILLed mid-stream, the survivors take over its
//! partitions once its heartbeat in Redis times out (feedback/src/joiner/members.rs), and a
//! replacement joins later. Interactions are keyed
//! by episode and feedback by its target, so a turn and its feedback usually sit on partitions
//! that different joiners own: the per-target leases (feedback/src/joiner/leases.rs) must keep a
//! stale record from being the last word on any turn. Checked by id: every turn of every
//! episode ends with exactly its feedback, no record is lost, and a record repeats only when
//! the kill fell between Kafka's ack and the Redis marker (at most one batch).
//!
//! What this test does not prove: the interleaving the leases exist for (two joiners reading
//! one turn around each other's writes, the older record acknowledged last) is narrow. With
//! leases switched off (2026-12-06, one run) this test still passed, so it shows the lease path
//! working under contention and across a kill, not that the race is closed; the lease
//! guarantees themselves (all or nothing, wait for the holder, expiry, a late release freeing
//! nothing) are tested against Redis beside the code in leases.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_feedback::{
    EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue, InteractionRecord, LogConfig,
    LogHandle, RecordLog, Topic, TopicReader,
};
use serde_json::json;
use support::{brokers, free_port, metric_sum};
use uuid::Uuid;

const PARTITIONS: i32 = 6;
const BATCH: usize = 20;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A `hindsight join` process with its metrics on `metrics`.
struct JoinProcess {
    child: Child,
    metrics: u16,
    killed: bool,
}

impl JoinProcess {
    fn start(dir: &Path, name: &str, prefix: &str, group: &str, redis_prefix: &str) -> Self {
        let metrics = free_port();
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                r#"[log]
brokers = "{brokers}"
topic_prefix = "{prefix}"
topic_partitions = {PARTITIONS}
spill_dir = "{spill}"
[joiner]
group_id = "{group}"
redis_url = "{redis}"
redis_key_prefix = "{redis_prefix}"
batch_max_records = {BATCH}
batch_max_wait_ms = 100
sweep_interval_ms = 200
produce_timeout_ms = 5000
"#,
                brokers = brokers(),
                spill = dir.join(format!("spill-{name}")).display(),
                redis = redis_url(),
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["join", "--metrics-listen"])
            .arg(format!("127.0.0.1:{metrics}"))
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", metrics)).is_err() {
            assert!(Instant::now() < deadline, "{name} did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            metrics,
            killed: false,
        }
    }

    async fn partitions(&self) -> f64 {
        metric_sum(
            format!("127.0.0.1:{}", self.metrics),
            "hindsight_join_partitions",
        )
        .await
    }

    async fn interactions(&self) -> f64 {
        metric_sum(
            format!("127.0.0.1:{}", self.metrics),
            "hindsight_join_interactions_total",
        )
        .await
    }

    fn child_alive(&self) -> bool {
        !self.killed
    }

    /// SIGKILL: no flush, no leave-group, leases left held.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.killed = true;
    }
}

impl Drop for JoinProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn interaction(episode: &str, content: &str, t: i64) -> InteractionRecord {
    InteractionRecord::chat(
        episode,
        json!({"model": "m", "messages": [{"role": "user", "content": content}]}),
        json!({"choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ok"}}]}),
        t,
    )
}

fn feedback(target: FeedbackTarget, value: FeedbackValue, t: i64) -> FeedbackRecord {
    let metric = matches!(value, FeedbackValue::Score(_)).then(|| "quality".to_string());
    FeedbackRecord {
        metric,
        ..FeedbackRecord::new(target, value, t)
    }
}

/// Writes `episodes` two-turn episodes: a thumb on the first turn, a score on the episode
/// (both turns). Feedback goes first for every other episode (it waits for its target).
/// Returns each turn's expected feedback ids.
fn write_episodes(h: &LogHandle, tag: &str, episodes: usize) -> HashMap<Uuid, BTreeSet<Uuid>> {
    let now = hindsight_feedback::now_ms();
    let mut want = HashMap::new();
    for k in 0..episodes {
        let ep = format!("{tag}-{k}");
        let first = interaction(&ep, &format!("{tag} q{k}"), now);
        let second = interaction(&ep, &format!("{tag} q{k} again"), now);
        let thumb = feedback(
            FeedbackTarget::Interaction(first.interaction_id),
            FeedbackValue::Thumbs(k % 2 == 0),
            now,
        );
        let score = feedback(
            FeedbackTarget::Episode(ep.clone()),
            FeedbackValue::Score(0.5),
            now,
        );
        want.insert(
            first.interaction_id,
            [thumb.feedback_id, score.feedback_id].into(),
        );
        want.insert(second.interaction_id, [score.feedback_id].into());
        let put_turns = |h: &LogHandle| {
            for i in [&first, &second] {
                h.submit_json(Topic::Interactions, ep.clone(), i.interaction_id, i);
            }
        };
        let put_feedback = |h: &LogHandle| {
            for f in [&thumb, &score] {
                h.submit_json(Topic::Feedback, f.target.key(), f.feedback_id, f);
            }
        };
        if k % 2 == 0 {
            put_turns(h);
            put_feedback(h);
        } else {
            put_feedback(h);
            put_turns(h);
        }
    }
    want
}

/// `turns` one-turn episodes, each with `events` thumbs on the turn and `events` scores on
/// the episode, written interleaved.
fn write_hot_turns(h: &LogHandle, turns: usize, events: usize) -> HashMap<Uuid, BTreeSet<Uuid>> {
    let now = hindsight_feedback::now_ms();
    let mut want = HashMap::new();
    for k in 0..turns {
        let ep = format!("hot-{k}");
        let i = interaction(&ep, &format!("hot q{k}"), now);
        h.submit_json(Topic::Interactions, ep.clone(), i.interaction_id, &i);
        let mut ids = BTreeSet::new();
        for e in 0..events {
            for f in [
                feedback(
                    FeedbackTarget::Interaction(i.interaction_id),
                    FeedbackValue::Thumbs(e % 2 == 0),
                    now,
                ),
                feedback(
                    FeedbackTarget::Episode(ep.clone()),
                    FeedbackValue::Score(0.25),
                    now,
                ),
            ] {
                ids.insert(f.feedback_id);
                h.submit_json(Topic::Feedback, f.target.key(), f.feedback_id, &f);
            }
        }
        want.insert(i.interaction_id, ids);
    }
    want
}

/// Follows the episodes topic: the latest record per turn (partition order: records of one
/// episode share a partition) and every record id read.
struct Episodes {
    reader: TopicReader,
    latest: HashMap<Uuid, BTreeSet<Uuid>>,
    ids: Vec<Uuid>,
}

impl Episodes {
    async fn read_for(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            if let Some(rec) = self
                .reader
                .recv_timeout(Duration::from_millis(200))
                .await
                .unwrap()
            {
                let ep: EpisodeRecord = rec.decode().unwrap();
                self.ids.push(ep.record_id);
                self.latest
                    .insert(ep.turn, ep.feedback.iter().map(|f| f.feedback_id).collect());
            }
        }
    }

    fn correct(&self, want: &HashMap<Uuid, BTreeSet<Uuid>>) -> usize {
        want.iter()
            .filter(|(t, f)| self.latest.get(t) == Some(f))
            .count()
    }

    async fn until_correct(
        &mut self,
        want: &HashMap<Uuid, BTreeSet<Uuid>>,
        at_least: usize,
        joiners: &[JoinProcess],
    ) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.correct(want) < at_least {
            if Instant::now() >= deadline {
                let mut held = Vec::new();
                for j in joiners.iter().filter(|j| j.child_alive()) {
                    held.push((j.partitions().await, j.interactions().await));
                }
                panic!(
                    "{} of {} turns right ({at_least} wanted) after 120 s; live members' \
                     (partitions, interactions joined): {held:?}",
                    self.correct(want),
                    want.len()
                );
            }
            self.read_for(Duration::from_millis(500)).await;
        }
    }
}

/// Waits until `members` of the joiners hold every topic-partition between them, each some.
async fn until_spread(joiners: &[JoinProcess], members: usize) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut held = Vec::new();
        for j in joiners {
            if j.child_alive() {
                held.push(j.partitions().await);
            }
        }
        let total: f64 = held.iter().sum();
        if held.len() == members
            && held.iter().all(|p| *p > 0.0)
            && total == f64::from(2 * PARTITIONS)
        {
            eprintln!("joiners test: partitions per member {held:?}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the group did not spread the partitions: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_joiners_on_six_partitions_survive_a_sigkill_without_losing_or_repeating() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("test-joiners-{}", Uuid::now_v7().simple());
    let cfg = LogConfig {
        brokers: brokers(),
        topic_prefix: prefix.clone(),
        topic_partitions: PARTITIONS,
        spill_dir: dir.path().join("spill"),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (log, h) = RecordLog::start(cfg.clone()).await.unwrap();
    let group = format!("{prefix}-group");
    let redis_prefix = format!("{prefix}:");
    let start = |name: &str| JoinProcess::start(dir.path(), name, &prefix, &group, &redis_prefix);
    let mut joiners = vec![start("j1"), start("j2"), start("j3")];
    let mut eps = Episodes {
        reader: TopicReader::new(&cfg, &format!("{prefix}-reader"), &[Topic::Episodes]).unwrap(),
        latest: HashMap::new(),
        ids: vec![],
    };

    // The group settles: the 12 topic-partitions (interactions and feedback, 6 each) spread
    // over the three members.
    until_spread(&joiners, 3).await;

    // Wave 1, with all three members: each must have joined part of it.
    let mut want = write_episodes(&h, "w1", 150);
    eps.until_correct(&want, want.len(), &joiners).await;
    for (n, j) in joiners.iter().enumerate() {
        let got = j.interactions().await;
        assert!(
            got > 0.0,
            "joiner {} got no partition ({got} interactions)",
            n + 1
        );
    }

    // Wave 2, and joiner 1 SIGKILLed while it is in the middle of it: its partitions (and
    // any leases it held) pass to the other two once its session times out.
    let base = want.len();
    want.extend(write_episodes(&h, "w2", 300));
    eps.until_correct(&want, base + 20, &joiners).await;
    joiners[0].kill();
    let killed_at = Instant::now();
    let done_before = eps.correct(&want) - base;
    until_spread(&joiners, 2).await;
    eprintln!(
        "joiners test: survivors hold every partition {:.1} s after the kill",
        killed_at.elapsed().as_secs_f64()
    );
    eps.until_correct(&want, want.len(), &joiners).await;
    eprintln!(
        "joiners test: wave 2 ({done_before} of 600 turns out at the kill) complete {:.1} s after it",
        killed_at.elapsed().as_secs_f64()
    );

    // A replacement joins (another rebalance), then wave 3 goes through the new group.
    joiners.push(start("j4"));
    until_spread(&joiners, 3).await;
    want.extend(write_episodes(&h, "w3", 150));
    eps.until_correct(&want, want.len(), &joiners).await;

    // Hot turns: many feedback events for the same few turns, half on the interaction (keyed
    // by it) and half on the episode (keyed by the episode), so two joiners recompute one turn
    // at the same moment again and again. Under the leases neither may emit a record the
    // other already emitted, nor leave an older one last.
    let before_hot = eps.ids.len();
    want.extend(write_hot_turns(&h, 8, 40));
    eps.until_correct(&want, want.len(), &joiners).await;
    eps.read_for(Duration::from_secs(3)).await;
    let hot: Vec<Uuid> = eps.ids[before_hot..].to_vec();
    let hot_distinct: HashSet<Uuid> = hot.iter().copied().collect();
    eprintln!(
        "joiners test: hot turns: {} records, {} distinct",
        hot.len(),
        hot_distinct.len()
    );
    assert_eq!(
        hot.len(),
        hot_distinct.len(),
        "two joiners emitted one record twice"
    );

    // Nothing stale may arrive late and become the last word on a turn.
    eps.read_for(Duration::from_secs(5)).await;
    assert_eq!(eps.correct(&want), want.len(), "a late record undid a turn");
    assert_eq!(
        eps.latest.len(),
        want.len(),
        "records for turns nobody wrote"
    );
    // Turns go out with part of their feedback and again with all of it (superseding records,
    // different ids); an identical record repeats only when a joiner died between Kafka's ack
    // and the Redis marker, at most one batch of the killed joiner.
    let distinct: HashSet<Uuid> = eps.ids.iter().copied().collect();
    let repeats = eps.ids.len() - distinct.len();
    eprintln!(
        "joiners test: {} turns, {} records, {} distinct, {repeats} identical repeats",
        want.len(),
        eps.ids.len(),
        distinct.len()
    );
    assert!(repeats <= BATCH, "{repeats} repeated records");
    drop(joiners);
    log.shutdown(Duration::from_secs(10)).await;
}
