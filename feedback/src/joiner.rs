//! The joiner (`hindsight join`): interactions ⋈ feedback → training episodes.
//!
//! It consumes `hindsight.interactions` and `hindsight.feedback` (several joiners divide the
//! partitions through Redis, `members`, and lease the turns they recompute, `leases`) and keeps
//! its state in Redis (turns, feedback per target, retractions, pending deadlines, the id of
//! the last record emitted per turn). Each batch runs: apply records to the state (idempotent),
//! recompute the affected turns, produce the changed episode records and dead letters and wait
//! for Kafka's acks, remember what was emitted, and only then commit the consumer offsets. A
//! crash anywhere re-reads the uncommitted records; applying them again changes nothing and a
//! turn is re-emitted only if its record differs from the one already acknowledged. Records
//! carry a deterministic id (from the turn and its feedback ids), so the one remaining window
//! (killed between Kafka's ack and the Redis write) yields an identical record consumers drop.
//!
//! Semantics: feedback applies to a turn when `feedback time - interaction time <= window`
//! (feedback may also come first: it waits for its target up to `unknown_target_grace_ms`,
//! then goes to the dead-letter topic as `unknown_target`); feedback outside the window is
//! dead-lettered as `expired_target`, whichever of the two came first; duplicates (same feedback id) count once; a retraction
//! removes the feedback it names and re-emits the turn. Episode-level feedback applies to every
//! turn of the episode, including turns that arrive later within the window. Every emission for
//! a turn supersedes the previous one (the latest record per `turn` is the truth; a turn whose
//! feedback was all retracted is re-emitted with an empty `feedback` list). Turns are emitted
//! in the order of the record that last touched them (usually their feedback), so a learner
//! trains in feedback order.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tracing::{error, info, warn};
use uuid::Uuid;

use crate::log::{ensure_topics, LogError, ValidatedLogConfig, ID_HEADER};
use crate::reader::{Positions, RawRecord, TopicReader};
use crate::records::{
    now_ms, DeadLetterRecord, EpisodeContext, EpisodeRecord, FeedbackRecord, FeedbackTarget,
    FeedbackValue, InteractionRecord, Topic, DEAD_LETTER_SCHEMA, EPISODE_SCHEMA,
};
use crate::redis_conn::LazyRedis;
use crate::FeedbackError;

mod leases;
mod members;

use members::{heartbeat, take_share, AbortOnDrop, Membership};

/// Joiner settings (raw, as read from TOML).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinerConfig {
    /// Kafka consumer group the joiners commit their offsets to (the partitions are divided
    /// through Redis, joiner/members.rs).
    #[serde(default = "default_group_id")]
    pub group_id: String,
    /// Redis holding the join state.
    #[serde(default = "default_redis_url")]
    pub redis_url: String,
    /// Prefix of the joiner's Redis keys.
    #[serde(default = "default_redis_key_prefix")]
    pub redis_key_prefix: String,
    /// Event-time window: feedback later than this after its interaction is expired.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// How long feedback waits for an unknown target before it is dead-lettered.
    #[serde(default = "default_unknown_target_grace_ms")]
    pub unknown_target_grace_ms: u64,
    /// Most records per batch.
    #[serde(default = "default_batch_max_records")]
    pub batch_max_records: usize,
    /// Longest wait to fill a batch.
    #[serde(default = "default_batch_max_wait_ms")]
    pub batch_max_wait_ms: u64,
    /// How often pending feedback deadlines are checked.
    #[serde(default = "default_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
    /// How long to wait for Kafka to acknowledge a batch's output before retrying it.
    #[serde(default = "default_produce_timeout_ms")]
    pub produce_timeout_ms: u64,
    /// A joiner silent this long (no heartbeat in Redis) is taken for dead and its partitions
    /// pass to the others (joiner/members.rs).
    #[serde(default = "default_member_timeout_ms")]
    pub member_timeout_ms: u64,
}

fn default_group_id() -> String {
    "hindsight-joiner".into()
}
fn default_redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}
fn default_redis_key_prefix() -> String {
    "hindsight:join:".into()
}
fn default_window_ms() -> u64 {
    7 * 24 * 3600 * 1000
}
fn default_unknown_target_grace_ms() -> u64 {
    3600 * 1000
}
fn default_batch_max_records() -> usize {
    500
}
fn default_batch_max_wait_ms() -> u64 {
    200
}
fn default_sweep_interval_ms() -> u64 {
    1000
}
fn default_produce_timeout_ms() -> u64 {
    30_000
}
fn default_member_timeout_ms() -> u64 {
    10_000
}

impl Default for JoinerConfig {
    fn default() -> Self {
        JoinerConfig {
            group_id: default_group_id(),
            redis_url: default_redis_url(),
            redis_key_prefix: default_redis_key_prefix(),
            window_ms: default_window_ms(),
            unknown_target_grace_ms: default_unknown_target_grace_ms(),
            batch_max_records: default_batch_max_records(),
            batch_max_wait_ms: default_batch_max_wait_ms(),
            sweep_interval_ms: default_sweep_interval_ms(),
            produce_timeout_ms: default_produce_timeout_ms(),
            member_timeout_ms: default_member_timeout_ms(),
        }
    }
}

fn bad(key: &str, reason: &str) -> FeedbackError {
    FeedbackError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

impl JoinerConfig {
    /// Checks every value once.
    pub fn validate(self) -> Result<ValidatedJoinerConfig, FeedbackError> {
        if self.group_id.is_empty() {
            return Err(bad("group_id", "must not be empty"));
        }
        if redis::Client::open(self.redis_url.as_str()).is_err() {
            return Err(bad("redis_url", "is not a valid redis:// URL"));
        }
        if self.window_ms == 0 {
            return Err(bad("window_ms", "must be at least 1"));
        }
        if self.batch_max_records == 0 {
            return Err(bad("batch_max_records", "must be at least 1"));
        }
        if self.sweep_interval_ms == 0 {
            return Err(bad("sweep_interval_ms", "must be at least 1"));
        }
        if self.member_timeout_ms < 500 {
            return Err(bad("member_timeout_ms", "must be at least 500"));
        }
        Ok(ValidatedJoinerConfig { raw: self })
    }
}

/// A checked [`JoinerConfig`].
#[derive(Debug, Clone)]
pub struct ValidatedJoinerConfig {
    raw: JoinerConfig,
}

/// What a joiner run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JoinerStats {
    /// Interaction records applied.
    pub interactions: u64,
    /// Feedback records applied.
    pub feedback: u64,
    /// Episode records emitted.
    pub episodes: u64,
    /// Dead letters emitted.
    pub dead_letters: u64,
    /// Batches committed.
    pub batches: u64,
}

/// Runs the joiner until `shutdown` resolves (finishing the batch in hand).
pub async fn run_joiner<F>(
    cfg: ValidatedJoinerConfig,
    log: ValidatedLogConfig,
    shutdown: F,
) -> Result<JoinerStats, FeedbackError>
where
    F: Future<Output = ()> + Send,
{
    let mut shutdown = std::pin::pin!(shutdown);
    let raw = cfg.raw.clone();
    let redis = LazyRedis::new(&raw.redis_url)?;
    // Topics must exist before subscribing (the local broker does not auto-create them).
    loop {
        let l = log.raw();
        match ensure_topics(
            &log.client_config(),
            log.topics().all(),
            l.topic_partitions,
            l.topic_replication,
            Duration::from_secs(5),
        )
        .await
        {
            Ok(()) => break,
            Err(e) => warn!(error = %e, "Joiner waiting for the broker."),
        }
        tokio::select! {
            () = &mut shutdown => return Ok(JoinerStats::default()),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    // Partitions are divided among the joiners through Redis (joiner/members.rs), offsets
    // committed to the consumer group `group_id`.
    let reader = TopicReader::manual(&log, &raw.group_id)?;
    let topic_names: Vec<String> = [Topic::Interactions, Topic::Feedback]
        .iter()
        .map(|t| log.topics().get(*t).to_string())
        .collect();
    let membership = Membership::new(
        format!("{}members", raw.redis_key_prefix),
        Uuid::now_v7().to_string(),
        Duration::from_millis(raw.member_timeout_ms),
    );
    let (live_tx, mut live) = tokio::sync::watch::channel::<Option<Vec<String>>>(None);
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
        LazyRedis::new(&raw.redis_url)?,
        membership.clone(),
        live_tx,
    )));
    let mut owned: Vec<(String, i32)> = Vec::new();
    let producer: FutureProducer = log.producer_config().create().map_err(LogError::from)?;
    let mut joiner = Joiner {
        cfg: raw.clone(),
        log,
        producer,
        stats: JoinerStats::default(),
        last_sweep: Instant::now(),
    };
    info!(group = %raw.group_id, "Joiner started.");
    let max_wait = Duration::from_millis(raw.batch_max_wait_ms);
    loop {
        if live.has_changed().unwrap_or(false) {
            let members = live.borrow_and_update().clone();
            owned = take_share(&reader, &membership, &members, &topic_names, owned);
        }
        // Fill a batch: up to batch_max_records, or until max_wait after the first record.
        let mut batch: Vec<RawRecord> = Vec::new();
        let mut first_at: Option<Instant> = None;
        let stop = loop {
            let wait = match first_at {
                Some(t) => max_wait.saturating_sub(t.elapsed()),
                None => Duration::from_millis(raw.sweep_interval_ms),
            };
            tokio::select! {
                () = &mut shutdown => break true,
                r = reader.recv_timeout(wait) => match r {
                    Ok(Some(rec)) => {
                        batch.push(rec);
                        first_at.get_or_insert_with(Instant::now);
                        if batch.len() >= raw.batch_max_records { break false; }
                    }
                    Ok(None) => break false,
                    Err(e) => {
                        warn!(error = %e, "Joiner read failed; retrying.");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        break false;
                    }
                }
            }
        };
        if !batch.is_empty()
            || joiner.last_sweep.elapsed() >= Duration::from_millis(raw.sweep_interval_ms)
        {
            // A failed batch is retried from the same records: nothing is committed until it succeeds.
            let mut attempt = 0u32;
            loop {
                match joiner.process(&redis, &batch).await {
                    Ok(()) => break,
                    Err(e) => {
                        attempt += 1;
                        error!(error = %e, attempt, "Joiner batch failed; retrying.");
                        let backoff = Duration::from_millis(500 * u64::from(attempt.min(10)));
                        if stop {
                            // Shutting down: a few tries, then leave the batch uncommitted
                            // (the next start re-reads it).
                            if attempt >= 3 {
                                return Ok(joiner.stats);
                            }
                            tokio::time::sleep(backoff).await;
                        } else {
                            tokio::select! {
                                () = &mut shutdown => return Ok(joiner.stats),
                                () = tokio::time::sleep(backoff) => {}
                            }
                        }
                    }
                }
            }
            let mut positions = Positions::new();
            for r in &batch {
                let e = positions.entry((r.topic.clone(), r.partition)).or_insert(0);
                *e = (*e).max(r.offset + 1);
            }
            if let Err(e) = reader.commit_offsets(&positions) {
                // Not fatal: the records are re-read and re-applied idempotently.
                warn!(error = %e, "Committing joiner offsets failed.");
            }
            joiner.stats.batches += 1;
        }
        if stop {
            // Leave the table so the others take the partitions now, not after the timeout.
            if let Ok(mut conn) = redis.get().await {
                if let Err(e) = membership.leave(&mut conn).await {
                    warn!(error = %e, "Leaving the joiners' membership table failed.");
                }
            }
            info!(?joiner.stats, "Joiner stopped.");
            return Ok(joiner.stats);
        }
    }
}

struct Joiner {
    cfg: JoinerConfig,
    log: ValidatedLogConfig,
    producer: FutureProducer,
    stats: JoinerStats,
    last_sweep: Instant,
}

/// Something to produce, and the Redis write that marks it done once Kafka acked it.
struct Output {
    topic: Topic,
    key: String,
    id: Uuid,
    payload: Vec<u8>,
    marker: (String, String),
    pending_member: Option<(String, String, String)>,
}

fn det_uuid(parts: &[&str]) -> Uuid {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    let full = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&full[..16]);
    uuid::Builder::from_sha1_bytes(b).into_uuid()
}

fn target_key(t: &FeedbackTarget) -> String {
    match t {
        FeedbackTarget::Interaction(id) => format!("i:{id}"),
        FeedbackTarget::Episode(e) => format!("e:{e}"),
    }
}

impl Joiner {
    fn k(&self, rest: &str) -> String {
        format!("{}{}", self.cfg.redis_key_prefix, rest)
    }

    fn ttl_s(&self) -> u64 {
        (self.cfg.window_ms + self.cfg.unknown_target_grace_ms) / 1000 + 86_400
    }

    async fn process(
        &mut self,
        redis: &LazyRedis,
        batch: &[RawRecord],
    ) -> Result<(), FeedbackError> {
        let mut conn = redis.get().await?;
        // Every turn a record touched, in record order; emitted in the order of each turn's
        // last touch (below).
        let mut affected: Vec<Uuid> = Vec::new();
        let mut outputs: Vec<Output> = Vec::new();
        let interactions_topic = self.log.topics().get(Topic::Interactions).to_string();
        // Event-time lag: how old the newest record of the batch was when the joiner got to it
        // (produce to join; grows while the joiner falls behind, e.g. on a backlog).
        if let Some(newest_ms) = batch.iter().filter_map(|r| r.timestamp_ms).max() {
            let lag_s = (hindsight_core::now_ms() - newest_ms).max(0) as f64 / 1000.0;
            metrics::gauge!("hindsight_join_lag_seconds").set(lag_s);
        }
        for rec in batch {
            if rec.topic == interactions_topic {
                match rec.decode::<InteractionRecord>() {
                    Ok(i) => {
                        self.apply_interaction(&mut conn, &i).await?;
                        affected.push(i.interaction_id);
                        self.stats.interactions += 1;
                        metrics::counter!("hindsight_join_interactions_total").increment(1);
                    }
                    Err(e) => outputs.extend(self.malformed(&mut conn, rec, &e.to_string()).await?),
                }
            } else {
                match rec.decode::<FeedbackRecord>() {
                    Ok(f) => {
                        let (turns, dead) = self.apply_feedback(&mut conn, &f).await?;
                        affected.extend(turns);
                        outputs.extend(dead);
                        self.stats.feedback += 1;
                        metrics::counter!("hindsight_join_feedback_total").increment(1);
                    }
                    Err(e) => outputs.extend(self.malformed(&mut conn, rec, &e.to_string()).await?),
                }
            }
        }
        // Interaction records never change once written, so the turns (and their episodes,
        // for the leases) can be read before leasing.
        let mut turns = Vec::new();
        for turn in in_last_touch_order(affected) {
            if let Some(i) = self.load_turn(&mut conn, turn).await? {
                turns.push(i);
            }
        }
        let sweep_due =
            self.last_sweep.elapsed() >= Duration::from_millis(self.cfg.sweep_interval_ms);
        let due = if sweep_due {
            self.due_pending(&mut conn).await?
        } else {
            vec![]
        };
        let mut keys = BTreeSet::new();
        for i in &turns {
            keys.insert(self.k(&format!("lease:i:{}", i.interaction_id)));
            keys.insert(self.k(&format!("lease:e:{}", i.episode_id)));
        }
        for member in &due {
            if let Some((_, tkey)) = member.split_once('|') {
                keys.insert(self.k(&format!("lease:{tkey}")));
            }
        }
        let held = leases::acquire(&mut conn, keys, self.lease_ttl()).await?;
        let result = async {
            for i in turns {
                if let Some(o) = self.recompute(&mut conn, i).await? {
                    outputs.push(o);
                }
            }
            if sweep_due {
                outputs.extend(self.sweep(&mut conn, due).await?);
            }
            self.emit(&mut conn, outputs, &held).await
        }
        .await;
        // Given back on failure too (the batch is retried and leases again).
        let released = leases::release(&mut conn, held).await;
        if result.is_ok() && sweep_due {
            self.last_sweep = Instant::now();
        }
        result.and(released)
    }

    /// How long a batch's leases live: its longest produce wait plus room for the reads before
    /// it and the Redis writes after it. A joiner killed while holding leases blocks those
    /// targets this long.
    fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.cfg.produce_timeout_ms.saturating_mul(2) + 10_000)
    }

    async fn apply_interaction(
        &self,
        conn: &mut ConnectionManager,
        i: &InteractionRecord,
    ) -> Result<(), FeedbackError> {
        let ttl = self.ttl_s();
        let json = serde_json::to_string(i).unwrap_or_default();
        let ep_key = self.k(&format!("ep:{}", i.episode_id));
        redis::pipe()
            .set_ex(self.k(&format!("int:{}", i.interaction_id)), json, ttl)
            .ignore()
            .sadd(&ep_key, i.interaction_id.to_string())
            .ignore()
            .expire(&ep_key, ttl as i64)
            .ignore()
            .query_async::<()>(conn)
            .await?;
        Ok(())
    }

    async fn turns_of(
        &self,
        conn: &mut ConnectionManager,
        tkey: &str,
    ) -> Result<Vec<Uuid>, FeedbackError> {
        if let Some(id) = tkey.strip_prefix("i:") {
            let exists: bool = conn.exists(self.k(&format!("int:{id}"))).await?;
            Ok(if exists {
                Uuid::parse_str(id).ok().into_iter().collect()
            } else {
                vec![]
            })
        } else if let Some(ep) = tkey.strip_prefix("e:") {
            let members: Vec<String> = conn.smembers(self.k(&format!("ep:{ep}"))).await?;
            Ok(members
                .iter()
                .filter_map(|m| Uuid::parse_str(m).ok())
                .collect())
        } else {
            Ok(vec![])
        }
    }

    async fn load_turn(
        &self,
        conn: &mut ConnectionManager,
        turn: Uuid,
    ) -> Result<Option<InteractionRecord>, FeedbackError> {
        let raw: Option<String> = conn.get(self.k(&format!("int:{turn}"))).await?;
        Ok(raw.and_then(|s| serde_json::from_str(&s).ok()))
    }

    /// Stores the feedback; returns the turns to recompute and any dead letter.
    async fn apply_feedback(
        &self,
        conn: &mut ConnectionManager,
        f: &FeedbackRecord,
    ) -> Result<(Vec<Uuid>, Vec<Output>), FeedbackError> {
        let ttl = self.ttl_s();
        let tkey = target_key(&f.target);
        let fid = f.feedback_id.to_string();
        let fb_key = self.k(&format!("fb:{tkey}"));
        let json = serde_json::to_string(f).unwrap_or_default();
        redis::pipe()
            .hset(&fb_key, &fid, json)
            .ignore()
            .expire(&fb_key, ttl as i64)
            .ignore()
            .set_ex(self.k(&format!("fbt:{fid}")), &tkey, ttl)
            .ignore()
            .query_async::<()>(conn)
            .await?;
        let mut turns = Vec::new();
        if let Some(r) = f.retracts {
            let _: () = conn.set_ex(self.k(&format!("rt:{r}")), "1", ttl).await?;
            let orig: Option<String> = conn.get(self.k(&format!("fbt:{r}"))).await?;
            if let Some(t) = orig {
                turns.extend(self.turns_of(conn, &t).await?);
            }
        }
        if matches!(f.value, FeedbackValue::Retraction) {
            return Ok((turns, vec![]));
        }
        let own = self.turns_of(conn, &tkey).await?;
        if own.is_empty() {
            let deadline = f.event_time_ms + self.cfg.unknown_target_grace_ms as i64;
            let _: () = conn
                .zadd(self.k("pending"), format!("{fid}|{tkey}"), deadline)
                .await?;
            return Ok((turns, vec![]));
        }
        let mut in_window = false;
        for t in &own {
            if let Some(i) = self.load_turn(conn, *t).await? {
                if self.within_window(&i, f) {
                    in_window = true;
                }
            }
        }
        let mut dead = Vec::new();
        if in_window {
            turns.extend(own);
        } else if let Some(o) = self
            .dead_letter(
                conn,
                f.feedback_id,
                "expired_target",
                serde_json::to_value(f).unwrap_or(Value::Null),
            )
            .await?
        {
            dead.push(o);
        }
        Ok((turns, dead))
    }

    fn within_window(&self, i: &InteractionRecord, f: &FeedbackRecord) -> bool {
        f.event_time_ms.saturating_sub(i.event_time_ms) <= self.cfg.window_ms as i64
    }

    async fn dead_letter(
        &self,
        conn: &mut ConnectionManager,
        fid: Uuid,
        reason: &str,
        record: Value,
    ) -> Result<Option<Output>, FeedbackError> {
        let marker = self.k(&format!("dl:{fid}"));
        let done: bool = conn.exists(&marker).await?;
        if done {
            return Ok(None);
        }
        let id = det_uuid(&["deadletter", &fid.to_string(), reason]);
        let rec = DeadLetterRecord {
            schema: DEAD_LETTER_SCHEMA.into(),
            reason: reason.into(),
            feedback_id: Some(fid),
            record,
            event_time_ms: now_ms(),
        };
        Ok(Some(Output {
            topic: Topic::DeadLetter,
            key: fid.to_string(),
            id,
            payload: serde_json::to_vec(&rec).unwrap_or_default(),
            marker: (marker, reason.into()),
            pending_member: None,
        }))
    }

    async fn malformed(
        &self,
        conn: &mut ConnectionManager,
        rec: &RawRecord,
        why: &str,
    ) -> Result<Option<Output>, FeedbackError> {
        warn!(topic = %rec.topic, offset = rec.offset, error = why, "Malformed record dead-lettered.");
        let pseudo = det_uuid(&[
            "malformed",
            &rec.topic,
            &rec.partition.to_string(),
            &rec.offset.to_string(),
        ]);
        let record = serde_json::from_slice(&rec.payload)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&rec.payload).into_owned()));
        let mut o = self
            .dead_letter(
                conn,
                pseudo,
                "malformed",
                json!({"error": why, "record": record}),
            )
            .await?;
        if let Some(o) = o.as_mut() {
            o.key = rec.key.clone().unwrap_or_default();
        }
        Ok(o)
    }

    /// Builds the turn's record; None when nothing changed since the last acked emission.
    async fn recompute(
        &self,
        conn: &mut ConnectionManager,
        i: InteractionRecord,
    ) -> Result<Option<Output>, FeedbackError> {
        let turn = i.interaction_id;
        let mut fb: Vec<FeedbackRecord> = Vec::new();
        for tkey in [format!("i:{turn}"), format!("e:{}", i.episode_id)] {
            let all: HashMap<String, String> = conn.hgetall(self.k(&format!("fb:{tkey}"))).await?;
            fb.extend(
                all.values()
                    .filter_map(|s| serde_json::from_str::<FeedbackRecord>(s).ok()),
            );
        }
        fb.retain(|f| !matches!(f.value, FeedbackValue::Retraction) && self.within_window(&i, f));
        if !fb.is_empty() {
            let keys: Vec<String> = fb
                .iter()
                .map(|f| self.k(&format!("rt:{}", f.feedback_id)))
                .collect();
            let retracted: Vec<Option<String>> =
                redis::cmd("MGET").arg(&keys).query_async(conn).await?;
            let mut keep = retracted.iter().map(Option::is_none);
            fb.retain(|_| keep.next().unwrap_or(true));
        }
        fb.sort_by_key(|f| (f.event_time_ms, f.feedback_id));
        fb.dedup_by_key(|f| f.feedback_id);
        let marker_key = self.k(&format!("emitted:{turn}"));
        let last: Option<String> = conn.get(&marker_key).await?;
        if fb.is_empty() && last.is_none() {
            return Ok(None);
        }
        let ids: Vec<String> = fb.iter().map(|f| f.feedback_id.to_string()).collect();
        let mut parts: Vec<&str> = vec!["episode", &i.episode_id];
        let turn_s = turn.to_string();
        parts.push(&turn_s);
        parts.extend(ids.iter().map(String::as_str));
        let record_id = det_uuid(&parts);
        if last.as_deref() == Some(record_id.to_string().as_str()) {
            return Ok(None);
        }
        let answer = answer_of(&i);
        let context = EpisodeContext {
            messages: i
                .request
                .get("messages")
                .or_else(|| i.request.get("prompt"))
                .cloned()
                .unwrap_or(Value::Null),
            tools: i.request.get("tools").cloned(),
            tool_choice: i.request.get("tool_choice").cloned(),
            model: i
                .request
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string),
            response_format: i.request.get("response_format").cloned(),
            temperature: i.request.get("temperature").and_then(Value::as_f64),
            top_p: i.request.get("top_p").and_then(Value::as_f64),
        };
        let rec = EpisodeRecord {
            schema: EPISODE_SCHEMA.into(),
            record_id,
            episode_id: i.episode_id.clone(),
            episode_source: i.episode_source,
            turn,
            route: i.route.clone(),
            context,
            answer,
            behaviour: i.behaviour.clone(),
            adapter: i.adapter.clone(),
            feedback_time_ms: fb.iter().map(|f| f.event_time_ms).max().unwrap_or(0),
            feedback: fb,
            interaction_time_ms: i.event_time_ms,
            emitted_at_ms: now_ms(),
        };
        Ok(Some(Output {
            topic: Topic::Episodes,
            key: i.episode_id.clone(),
            id: record_id,
            payload: serde_json::to_vec(&rec).unwrap_or_default(),
            marker: (marker_key, record_id.to_string()),
            pending_member: None,
        }))
    }

    /// Pending feedback whose grace period is over (at most 1000 per sweep).
    async fn due_pending(
        &self,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<String>, FeedbackError> {
        Ok(conn
            .zrangebyscore_limit(self.k("pending"), "-inf", now_ms(), 0, 1000)
            .await?)
    }

    /// Dead-letters pending feedback whose target never arrived within the grace period
    /// (`unknown_target`), or arrived but too old for it (`expired_target`). Runs under the
    /// leases of the feedback's targets.
    async fn sweep(
        &self,
        conn: &mut ConnectionManager,
        due: Vec<String>,
    ) -> Result<Vec<Output>, FeedbackError> {
        let mut out = Vec::new();
        for member in due {
            // Another joiner may have settled it while this one waited for the lease.
            let still: Option<f64> = conn.zscore(self.k("pending"), &member).await?;
            if still.is_none() {
                continue;
            }
            let Some((fid, tkey)) = member.split_once('|') else {
                let _: () = conn.zrem(self.k("pending"), &member).await?;
                continue;
            };
            let fb_key = self.k(&format!("fb:{tkey}"));
            let raw: Option<String> = conn.hget(&fb_key, fid).await?;
            let turns = self.turns_of(conn, tkey).await?;
            let reason = if turns.is_empty() {
                "unknown_target"
            } else {
                // The target arrived after its feedback. It was joined then if the feedback falls
                // inside its window; otherwise it joined nothing and is as late as feedback that
                // came after an expired target (`apply_feedback`), so it is dead-lettered alike.
                let f = raw
                    .as_deref()
                    .and_then(|s| serde_json::from_str::<FeedbackRecord>(s).ok());
                let mut joined = f.is_none();
                if let Some(f) = &f {
                    for t in &turns {
                        if let Some(i) = self.load_turn(conn, *t).await? {
                            joined |= self.within_window(&i, f);
                        }
                    }
                }
                if joined {
                    let _: () = conn.zrem(self.k("pending"), &member).await?;
                    continue;
                }
                "expired_target"
            };
            let record = raw
                .and_then(|s| serde_json::from_str::<Value>(&s).ok())
                .unwrap_or(Value::Null);
            let Ok(fid_u) = Uuid::parse_str(fid) else {
                let _: () = conn.zrem(self.k("pending"), &member).await?;
                continue;
            };
            match self.dead_letter(conn, fid_u, reason, record).await? {
                Some(mut o) => {
                    o.pending_member = Some((member.clone(), fb_key, fid.to_string()));
                    out.push(o);
                }
                None => {
                    let _: () = conn.zrem(self.k("pending"), &member).await?;
                }
            }
        }
        Ok(out)
    }

    /// Produces the outputs, waits for every ack, then records them as done in Redis.
    async fn emit(
        &mut self,
        conn: &mut ConnectionManager,
        outputs: Vec<Output>,
        held: &leases::Held,
    ) -> Result<(), FeedbackError> {
        if outputs.is_empty() {
            return Ok(());
        }
        let timeout = Duration::from_millis(self.cfg.produce_timeout_ms);
        if !held.may_produce_for(timeout) {
            return Err(FeedbackError::Busy(
                "the batch's leases would expire during the produce; retrying".into(),
            ));
        }
        let mut futs = Vec::with_capacity(outputs.len());
        for o in &outputs {
            let mut buf = Uuid::encode_buffer();
            let id = o.id.hyphenated().encode_lower(&mut buf);
            let headers = OwnedHeaders::new().insert(Header {
                key: ID_HEADER,
                value: Some(id.as_bytes()),
            });
            let topic = self.log.topics().get(o.topic);
            let fut = self
                .producer
                .send_result(
                    FutureRecord::to(topic)
                        .key(o.key.as_bytes())
                        .payload(&o.payload)
                        .headers(headers),
                )
                .map_err(|(e, _)| LogError::from(e))?;
            futs.push(fut);
        }
        let results = tokio::time::timeout(timeout, futures::future::join_all(futs))
            .await
            .map_err(|_| LogError::Timeout("joiner output acks".into()))?;
        for r in results {
            match r {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => return Err(LogError::from(e).into()),
                Err(_) => return Err(LogError::Timeout("joiner delivery cancelled".into()).into()),
            }
        }
        let ttl = self.ttl_s();
        let mut pipe = redis::pipe();
        let mut by_topic: BTreeMap<&'static str, u64> = BTreeMap::new();
        for o in &outputs {
            pipe.set_ex(&o.marker.0, &o.marker.1, ttl).ignore();
            if let Some((member, fb_key, fid)) = &o.pending_member {
                pipe.zrem(self.k("pending"), member).ignore();
                pipe.hdel(fb_key, fid).ignore();
            }
            *by_topic.entry(o.topic.suffix()).or_default() += 1;
        }
        pipe.query_async::<()>(conn).await?;
        for (topic, n) in by_topic {
            match topic {
                "episodes" => {
                    self.stats.episodes += n;
                    metrics::counter!("hindsight_join_episodes_total").increment(n);
                }
                _ => {
                    self.stats.dead_letters += n;
                    metrics::counter!("hindsight_join_dead_letters_total").increment(n);
                }
            }
        }
        Ok(())
    }
}

/// The assistant message of a chat response, or the text of a completion as one.
fn answer_of(i: &InteractionRecord) -> Option<Value> {
    let choice = i.response.as_ref()?.get("choices")?.get(0)?;
    if let Some(m) = choice.get("message") {
        return Some(m.clone());
    }
    choice
        .get("text")
        .map(|t| json!({"role": "assistant", "content": t}))
}

/// `touched` without repeats, each turn at its last position: a batch's episodes come out in
/// the order their latest record (usually the feedback) arrived, so training order follows
/// feedback order. Sorting by id instead shuffled the turns of every batch, and batch
/// boundaries follow timing: two runs of the same traffic trained in different orders.
fn in_last_touch_order(touched: Vec<Uuid>) -> Vec<Uuid> {
    let mut seen = HashSet::new();
    let mut out: Vec<Uuid> = touched
        .into_iter()
        .rev()
        .filter(|t| seen.insert(*t))
        .collect();
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_come_out_once_in_the_order_of_their_last_touch() {
        let [a, b, c] = [1u128, 2, 3].map(Uuid::from_u128);
        // Interactions a, b, c, then feedback for c, then a: b (untouched since) first.
        assert_eq!(in_last_touch_order(vec![a, b, c, c, a]), vec![b, c, a]);
        // Ids sorted the other way round keep arrival order, not id order.
        assert_eq!(in_last_touch_order(vec![c, b, a]), vec![c, b, a]);
        assert!(in_last_touch_order(vec![]).is_empty());
    }
}
