//! The record log: a non-blocking, no-loss writer from Hindsight's hot paths into Kafka.
//!
//! `LogHandle::submit` puts a record on a bounded channel and returns; a writer task drains it
//! into an idempotent rdkafka producer. When the broker is slow or away (delivery errors, full
//! producer queue, message timeouts) records go to the on-disk [`Spill`](crate::spill) and are
//! replayed in order once a probe finds the broker back. While anything is spilled, new records
//! go to the spill too, so the spill drains in arrival order. If the channel is full, `submit`
//! appends to the spill itself. Only when the spill is full is a record dropped, and then it is
//! counted and logged with its id.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use crate::records::Topic;
use crate::spill::{Spill, SpillRecord};

/// Header carrying the record id on every Kafka message.
pub const ID_HEADER: &str = "hindsight-id";

/// librdkafka options set from typed fields; `client_options` may not repeat them.
const TYPED_CLIENT_KEYS: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "linger.ms",
    "queue.buffering.max.ms",
];

/// Errors of the record log and the Kafka helpers.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A configuration value is invalid.
    #[error("invalid log config `{key}`: {reason}")]
    Config {
        /// The offending key.
        key: String,
        /// Why it is invalid.
        reason: String,
    },
    /// Kafka client error.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// Topic creation failed.
    #[error("creating topic `{topic}` failed: {reason}")]
    CreateTopic {
        /// The topic.
        topic: String,
        /// Broker's answer.
        reason: String,
    },
    /// The spill directory could not be opened.
    #[error("spill: {0}")]
    Spill(String),
    /// A record could not be decoded.
    #[error("decoding record at {topic}/{partition}@{offset}: {reason}")]
    Decode {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
        /// What was wrong.
        reason: String,
    },
    /// Timed out waiting for Kafka.
    #[error("timed out: {0}")]
    Timeout(String),
}

/// Where and how records are written (raw, as read from TOML).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// Kafka bootstrap servers, comma separated.
    #[serde(default = "default_brokers")]
    pub brokers: String,
    /// Topic name prefix: topics are `<prefix>.interactions`, `.feedback`, `.episodes`, `.deadletter`.
    #[serde(default = "default_topic_prefix")]
    pub topic_prefix: String,
    /// Raw librdkafka options (e.g. `security.protocol`); keys set by typed fields are refused.
    #[serde(default)]
    pub client_options: BTreeMap<String, String>,
    /// Directory of the on-disk spill.
    #[serde(default = "default_spill_dir")]
    pub spill_dir: PathBuf,
    /// Most bytes the spill may occupy; beyond it records are dropped (and counted).
    #[serde(default = "default_spill_max_bytes")]
    pub spill_max_bytes: u64,
    /// Size of one spill segment file.
    #[serde(default = "default_spill_segment_bytes")]
    pub spill_segment_bytes: u64,
    /// How often appended spill records are fsynced (0 = after every append batch).
    #[serde(default = "default_spill_fsync_interval_ms")]
    pub spill_fsync_interval_ms: u64,
    /// Capacity of the in-memory channel between `submit` and the writer.
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
    /// How long librdkafka may try to deliver a message before it is spilled.
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Producer batching delay.
    #[serde(default = "default_linger_ms")]
    pub linger_ms: u64,
    /// How often the writer probes an absent broker and retries the spill.
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
    /// Records replayed from the spill per batch.
    #[serde(default = "default_replay_batch_records")]
    pub replay_batch_records: usize,
    /// Whether to create missing topics at start.
    #[serde(default = "default_true")]
    pub create_topics: bool,
    /// Partitions of created topics.
    #[serde(default = "default_topic_partitions")]
    pub topic_partitions: i32,
    /// Replication factor of created topics.
    #[serde(default = "default_topic_replication")]
    pub topic_replication: i32,
    /// Kafka's idempotent producer (`enable.idempotence`). Off by default: the local broker
    /// (tansu 0.6, SQLite engine) panics in its idempotent-producer check under concurrent
    /// load (seen twice here; the broker then stops answering). Nothing depends on it: every
    /// record carries a deterministic `hindsight-id` and every consumer deduplicates, so
    /// at-least-once delivery loses nothing and doubles nothing. Turn it on for Apache Kafka.
    #[serde(default)]
    pub idempotent_producer: bool,
}

fn default_brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}
fn default_topic_prefix() -> String {
    "hindsight".into()
}
fn default_spill_dir() -> PathBuf {
    PathBuf::from("data/spill")
}
fn default_spill_max_bytes() -> u64 {
    1 << 30
}
fn default_spill_segment_bytes() -> u64 {
    16 << 20
}
fn default_spill_fsync_interval_ms() -> u64 {
    200
}
fn default_queue_capacity() -> usize {
    65_536
}
fn default_message_timeout_ms() -> u64 {
    10_000
}
fn default_linger_ms() -> u64 {
    5
}
fn default_probe_interval_ms() -> u64 {
    1_000
}
fn default_replay_batch_records() -> usize {
    1_000
}
fn default_true() -> bool {
    true
}
fn default_topic_partitions() -> i32 {
    1
}
fn default_topic_replication() -> i32 {
    1
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            brokers: default_brokers(),
            topic_prefix: default_topic_prefix(),
            client_options: BTreeMap::new(),
            spill_dir: default_spill_dir(),
            spill_max_bytes: default_spill_max_bytes(),
            spill_segment_bytes: default_spill_segment_bytes(),
            spill_fsync_interval_ms: default_spill_fsync_interval_ms(),
            queue_capacity: default_queue_capacity(),
            message_timeout_ms: default_message_timeout_ms(),
            linger_ms: default_linger_ms(),
            probe_interval_ms: default_probe_interval_ms(),
            replay_batch_records: default_replay_batch_records(),
            create_topics: true,
            idempotent_producer: false,
            topic_partitions: default_topic_partitions(),
            topic_replication: default_topic_replication(),
        }
    }
}

fn bad(key: &str, reason: impl Into<String>) -> LogError {
    LogError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

impl LogConfig {
    /// Checks every value once; the result is what the log runs on.
    pub fn validate(self) -> Result<ValidatedLogConfig, LogError> {
        if self.brokers.trim().is_empty() {
            return Err(bad("brokers", "must name at least one broker"));
        }
        if self.topic_prefix.is_empty()
            || !self
                .topic_prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(bad(
                "topic_prefix",
                "must be non-empty and use only [A-Za-z0-9._-]",
            ));
        }
        for key in self.client_options.keys() {
            if TYPED_CLIENT_KEYS.contains(&key.as_str()) {
                return Err(bad(
                    &format!("client_options.{key}"),
                    "is set by a typed option of the log config; set that instead",
                ));
            }
        }
        if self.spill_dir.as_os_str().is_empty() {
            return Err(bad("spill_dir", "must not be empty"));
        }
        if self.spill_max_bytes < 4096 {
            return Err(bad("spill_max_bytes", "must be at least 4096"));
        }
        if self.spill_segment_bytes < 4096 {
            return Err(bad("spill_segment_bytes", "must be at least 4096"));
        }
        if self.queue_capacity == 0 {
            return Err(bad("queue_capacity", "must be at least 1"));
        }
        if self.message_timeout_ms < 100 {
            return Err(bad("message_timeout_ms", "must be at least 100"));
        }
        if self.probe_interval_ms == 0 {
            return Err(bad("probe_interval_ms", "must be at least 1"));
        }
        if self.replay_batch_records == 0 {
            return Err(bad("replay_batch_records", "must be at least 1"));
        }
        if self.topic_partitions < 1 {
            return Err(bad("topic_partitions", "must be at least 1"));
        }
        if self.topic_replication < 1 {
            return Err(bad("topic_replication", "must be at least 1"));
        }
        let topics = TopicNames::new(&self.topic_prefix);
        Ok(ValidatedLogConfig { raw: self, topics })
    }
}

/// The full topic names under a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicNames {
    names: [String; Topic::ALL.len()],
}

impl TopicNames {
    /// Names under `prefix`.
    pub fn new(prefix: &str) -> TopicNames {
        TopicNames {
            names: Topic::ALL.map(|t| t.name_with_prefix(prefix)),
        }
    }

    /// The name of `topic`.
    pub fn get(&self, topic: Topic) -> &str {
        &self.names[topic.as_u8() as usize]
    }

    /// Every topic's name, in [`Topic::ALL`] order.
    pub fn all(&self) -> &[String] {
        &self.names
    }
}

/// A checked [`LogConfig`].
#[derive(Debug, Clone)]
pub struct ValidatedLogConfig {
    raw: LogConfig,
    topics: TopicNames,
}

impl ValidatedLogConfig {
    /// The config as given.
    pub fn raw(&self) -> &LogConfig {
        &self.raw
    }

    /// Topic names.
    pub fn topics(&self) -> &TopicNames {
        &self.topics
    }

    /// A librdkafka client config with brokers and the pass-through options (no producer settings).
    pub fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.raw.brokers);
        for (k, v) in &self.raw.client_options {
            cc.set(k, v);
        }
        cc
    }

    pub(crate) fn producer_config(&self) -> ClientConfig {
        let mut cc = self.client_config();
        cc.set(
            "enable.idempotence",
            if self.raw.idempotent_producer {
                "true"
            } else {
                "false"
            },
        )
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            self.raw.message_timeout_ms.to_string(),
        )
        .set("linger.ms", self.raw.linger_ms.to_string())
        .set("compression.type", "lz4");
        cc
    }
}

/// Creates the given topics if missing ("already exists" counts as success).
pub async fn ensure_topics(
    client: &ClientConfig,
    names: &[String],
    partitions: i32,
    replication: i32,
    timeout: Duration,
) -> Result<(), LogError> {
    let admin: AdminClient<DefaultClientContext> = client.create()?;
    let new: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let opts = AdminOptions::new()
        .request_timeout(Some(timeout))
        .operation_timeout(Some(timeout));
    let results = tokio::time::timeout(
        timeout + Duration::from_secs(1),
        admin.create_topics(&new, &opts),
    )
    .await
    .map_err(|_| LogError::Timeout("creating topics".into()))??;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(LogError::CreateTopic {
                    topic,
                    reason: code.to_string(),
                })
            }
        }
    }
    Ok(())
}

/// A snapshot of the log's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Records waiting in the in-memory channel.
    pub queue_depth: u64,
    /// Bytes the spill occupies on disk.
    pub spilled_bytes: u64,
    /// Records waiting in the spill.
    pub spill_pending_records: u64,
    /// Records written to the spill, ever.
    pub spilled_records: u64,
    /// Records delivered from the spill, ever.
    pub replayed_records: u64,
    /// Records lost because even the spill was full (or failed), ever.
    pub dropped_records: u64,
    /// Records acknowledged by Kafka (directly or replayed), ever.
    pub delivered_records: u64,
    /// Corrupt or torn spill frames skipped.
    pub corrupt_records: u64,
}

/// What shutdown managed to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Records acknowledged by Kafka over the log's lifetime.
    pub delivered_records: u64,
    /// Records left in the spill for the next start.
    pub left_in_spill: u64,
    /// Records dropped over the log's lifetime.
    pub dropped_records: u64,
    /// Whether everything reached Kafka before the deadline.
    pub complete: bool,
}

struct LogRecord {
    topic: Topic,
    key: String,
    id: Uuid,
    payload: Bytes,
}

impl LogRecord {
    fn into_spill(self) -> SpillRecord {
        SpillRecord {
            topic: self.topic,
            id: self.id,
            key: self.key,
            payload: self.payload,
        }
    }
}

#[derive(Default)]
struct Counters {
    spilled: AtomicU64,
    replayed: AtomicU64,
    dropped: AtomicU64,
    delivered: AtomicU64,
}

struct Shared {
    tx: mpsc::Sender<LogRecord>,
    spill: Mutex<Spill>,
    spill_pending: AtomicU64,
    spill_bytes: AtomicU64,
    spill_corrupt: AtomicU64,
    counters: Counters,
}

impl Shared {
    fn lock_spill(&self) -> std::sync::MutexGuard<'_, Spill> {
        // A panic while holding the lock cannot leave the spill inconsistent (appends truncate
        // partial frames), so a poisoned lock is safe to reuse.
        self.spill.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refresh_spill_gauges(&self, spill: &Spill) {
        self.spill_pending
            .store(spill.pending_records(), Ordering::Relaxed);
        self.spill_bytes
            .store(spill.disk_bytes(), Ordering::Relaxed);
        self.spill_corrupt
            .store(spill.corrupt_records(), Ordering::Relaxed);
        metrics::gauge!("hindsight_log_spill_bytes").set(spill.disk_bytes() as f64);
        metrics::gauge!("hindsight_log_spill_pending_records").set(spill.pending_records() as f64);
    }

    /// Appends to the spill, or drops (counted, logged) when that fails.
    fn spill_one(&self, rec: LogRecord) {
        let topic = rec.topic;
        let id = rec.id;
        let mut spill = self.lock_spill();
        match spill.append(&rec.into_spill()) {
            Ok(_) => {
                self.counters.spilled.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("hindsight_log_spilled_records_total", "topic" => topic.suffix())
                    .increment(1);
                debug!(%id, topic = topic.suffix(), "Record spilled to disk.");
            }
            Err(e) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("hindsight_log_dropped_records_total", "topic" => topic.suffix())
                    .increment(1);
                error!(%id, topic = topic.suffix(), error = %e, "Record dropped: spill unavailable.");
            }
        }
        self.refresh_spill_gauges(&spill);
    }
}

/// Cheap, cloneable handle used on hot paths to submit records.
#[derive(Clone)]
pub struct LogHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LogHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogHandle")
            .field("stats", &self.stats())
            .finish()
    }
}

impl LogHandle {
    /// Queues a record for Kafka. Never blocks and never fails: when the queue is full (or the
    /// log is shut down) the record goes to the disk spill; only a full spill drops it (counted).
    pub fn submit(&self, topic: Topic, key: String, id: Uuid, payload: Bytes) {
        let rec = LogRecord {
            topic,
            key,
            id,
            payload,
        };
        match self.shared.tx.try_send(rec) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(rec))
            | Err(mpsc::error::TrySendError::Closed(rec)) => self.shared.spill_one(rec),
        }
    }

    /// Serializes `value` to JSON and submits it; a value that cannot be serialized is dropped
    /// and counted.
    pub fn submit_json<T: serde::Serialize>(&self, topic: Topic, key: String, id: Uuid, value: &T) {
        match serde_json::to_vec(value) {
            Ok(v) => self.submit(topic, key, id, Bytes::from(v)),
            Err(e) => {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("hindsight_log_dropped_records_total", "topic" => topic.suffix())
                    .increment(1);
                error!(%id, error = %e, "Record dropped: not serializable.");
            }
        }
    }

    /// Current counters.
    pub fn stats(&self) -> LogStats {
        let s = &self.shared;
        LogStats {
            queue_depth: (s.tx.max_capacity() - s.tx.capacity()) as u64,
            spilled_bytes: s.spill_bytes.load(Ordering::Relaxed),
            spill_pending_records: s.spill_pending.load(Ordering::Relaxed),
            spilled_records: s.counters.spilled.load(Ordering::Relaxed),
            replayed_records: s.counters.replayed.load(Ordering::Relaxed),
            dropped_records: s.counters.dropped.load(Ordering::Relaxed),
            delivered_records: s.counters.delivered.load(Ordering::Relaxed),
            corrupt_records: s.spill_corrupt.load(Ordering::Relaxed),
        }
    }
}

/// Owns the writer task; `shutdown` flushes it.
pub struct RecordLog {
    handle: LogHandle,
    stop: watch::Sender<Option<Instant>>,
    task: JoinHandle<FlushReport>,
}

impl std::fmt::Debug for RecordLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordLog")
            .field("handle", &self.handle)
            .finish()
    }
}

impl RecordLog {
    /// Opens the spill (replaying what a previous run left there), creates the producer and
    /// starts the writer. Does not fail when the broker is down: records spill until it is back.
    pub async fn start(cfg: ValidatedLogConfig) -> Result<(RecordLog, LogHandle), LogError> {
        let raw = cfg.raw();
        let dir = raw.spill_dir.clone();
        let (max, seg) = (raw.spill_max_bytes, raw.spill_segment_bytes);
        let spill = tokio::task::spawn_blocking(move || Spill::open(&dir, max, seg))
            .await
            .map_err(|e| LogError::Spill(e.to_string()))?
            .map_err(|e| LogError::Spill(e.to_string()))?;
        if spill.pending_records() > 0 {
            info!(
                records = spill.pending_records(),
                bytes = spill.disk_bytes(),
                "Spill from an earlier run found; it will be replayed."
            );
        }
        let producer: FutureProducer = cfg.producer_config().create()?;
        let (tx, rx) = mpsc::channel(raw.queue_capacity);
        let shared = Arc::new(Shared {
            tx,
            spill: Mutex::new(spill),
            spill_pending: AtomicU64::new(0),
            spill_bytes: AtomicU64::new(0),
            spill_corrupt: AtomicU64::new(0),
            counters: Counters::default(),
        });
        {
            let spill = shared.lock_spill();
            shared.refresh_spill_gauges(&spill);
        }
        let mut topics_ready = !raw.create_topics;
        if raw.create_topics {
            match ensure_topics(
                &cfg.client_config(),
                cfg.topics().all(),
                raw.topic_partitions,
                raw.topic_replication,
                Duration::from_secs(5),
            )
            .await
            {
                Ok(()) => topics_ready = true,
                Err(e) => {
                    warn!(error = %e, "Topics not created yet; records spill until the broker answers.")
                }
            }
        }
        let (stop, stop_rx) = watch::channel(None);
        let writer = Writer {
            cfg: cfg.clone(),
            shared: shared.clone(),
            producer,
            inflight: FuturesUnordered::new(),
            inflight_records: HashMap::new(),
            next_seq: 0,
            topics_ready,
            last_probe: None,
            replay_now: true,
            last_sync: Instant::now(),
        };
        let task = tokio::spawn(writer.run(rx, stop_rx));
        let handle = LogHandle { shared };
        Ok((
            RecordLog {
                handle: handle.clone(),
                stop,
                task,
            },
            handle,
        ))
    }

    /// A new handle.
    pub fn handle(&self) -> LogHandle {
        self.handle.clone()
    }

    /// Stops the writer: drains the queue to Kafka until `deadline`, spills what is left, fsyncs.
    pub async fn shutdown(self, deadline: Duration) -> FlushReport {
        let until = Instant::now() + deadline;
        let _ = self.stop.send(Some(until));
        match self.task.await {
            Ok(report) => report,
            Err(e) => {
                error!(error = %e, "Log writer task failed.");
                let stats = self.handle.stats();
                FlushReport {
                    delivered_records: stats.delivered_records,
                    left_in_spill: stats.spill_pending_records,
                    dropped_records: stats.dropped_records,
                    complete: false,
                }
            }
        }
    }
}

type DeliveryOutcome = (u64, Result<(), String>);
type InflightDelivery =
    std::pin::Pin<Box<dyn std::future::Future<Output = DeliveryOutcome> + Send + Sync>>;

struct Writer {
    cfg: ValidatedLogConfig,
    shared: Arc<Shared>,
    producer: FutureProducer,
    inflight: FuturesUnordered<InflightDelivery>,
    inflight_records: HashMap<u64, LogRecord>,
    next_seq: u64,
    topics_ready: bool,
    last_probe: Option<Instant>,
    replay_now: bool,
    last_sync: Instant,
}

fn id_headers(id: &Uuid) -> OwnedHeaders {
    let mut buf = Uuid::encode_buffer();
    let s = id.hyphenated().encode_lower(&mut buf);
    OwnedHeaders::new().insert(Header {
        key: ID_HEADER,
        value: Some(s.as_bytes()),
    })
}

impl Writer {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<LogRecord>,
        mut stop: watch::Receiver<Option<Instant>>,
    ) -> FlushReport {
        let probe_every = Duration::from_millis(self.cfg.raw().probe_interval_ms);
        let mut tick = tokio::time::interval(probe_every.min(Duration::from_millis(200)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let until = loop {
            let spill_pending = self.shared.spill_pending.load(Ordering::Relaxed) > 0;
            let replay_ready = spill_pending && self.replay_now;
            tokio::select! {
                biased;
                changed = stop.changed() => {
                    let until = if changed.is_ok() { *stop.borrow() } else { None };
                    break until.unwrap_or_else(Instant::now);
                }
                Some(outcome) = self.inflight.next(), if !self.inflight.is_empty() => {
                    self.on_delivery(outcome);
                }
                () = std::future::ready(()), if replay_ready => {
                    self.replay_once(None).await;
                }
                rec = rx.recv() => match rec {
                    Some(rec) => self.dispatch(rec),
                    None => break Instant::now(),
                },
                _ = tick.tick() => {
                    self.housekeeping(&rx, probe_every);
                    if spill_pending || !self.topics_ready {
                        let due = self.last_probe.is_none_or(|t| t.elapsed() >= probe_every);
                        if due {
                            self.last_probe = Some(Instant::now());
                            self.replay_once(None).await;
                        }
                    }
                }
            }
        };
        self.flush(rx, until).await
    }

    fn housekeeping(&mut self, rx: &mpsc::Receiver<LogRecord>, _probe_every: Duration) {
        let depth = rx.len();
        metrics::gauge!("hindsight_log_queue_depth_records").set(depth as f64);
        let fsync_every = Duration::from_millis(self.cfg.raw().spill_fsync_interval_ms);
        if self.last_sync.elapsed() >= fsync_every {
            self.sync_spill();
        }
    }

    fn sync_spill(&mut self) {
        self.last_sync = Instant::now();
        let mut spill = self.shared.lock_spill();
        if let Err(e) = spill.sync() {
            error!(error = %e, "Spill fsync failed.");
        }
    }

    /// Sends a record directly, unless the spill holds older records (order) or topics are not ready.
    fn dispatch(&mut self, rec: LogRecord) {
        if !self.topics_ready || self.shared.spill_pending.load(Ordering::Relaxed) > 0 {
            self.shared.spill_one(rec);
            if self.cfg.raw().spill_fsync_interval_ms == 0 {
                self.sync_spill();
            }
            return;
        }
        let topic_name = self.cfg.topics().get(rec.topic).to_string();
        let sent = self.producer.send_result(
            FutureRecord::to(&topic_name)
                .key(rec.key.as_bytes())
                .payload(rec.payload.as_ref())
                .headers(id_headers(&rec.id)),
        );
        match sent {
            Ok(fut) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.inflight_records.insert(seq, rec);
                self.inflight.push(Box::pin(async move {
                    let r = match fut.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((e, _))) => Err(e.to_string()),
                        Err(_) => Err("producer dropped the delivery".to_string()),
                    };
                    (seq, r)
                }));
            }
            Err((e, _)) => {
                warn!(id = %rec.id, error = %e, "Producer refused record; spilling.");
                self.shared.spill_one(rec);
                self.replay_now = false;
            }
        }
    }

    fn on_delivery(&mut self, (seq, result): DeliveryOutcome) {
        let Some(rec) = self.inflight_records.remove(&seq) else {
            return;
        };
        match result {
            Ok(()) => {
                self.shared
                    .counters
                    .delivered
                    .fetch_add(1, Ordering::Relaxed);
                metrics::counter!("hindsight_log_delivered_records_total", "topic" => rec.topic.suffix())
                    .increment(1);
            }
            Err(e) => {
                warn!(id = %rec.id, error = %e, "Delivery failed; spilling.");
                self.shared.spill_one(rec);
                self.replay_now = false;
            }
        }
    }

    /// Replays one batch from the spill. Returns true when the batch reached Kafka.
    async fn replay_once(&mut self, deadline: Option<Instant>) -> bool {
        // An idempotent producer can enter a fatal state (e.g. after sequence gaps); only a new
        // producer recovers. Records in flight on the old one were or will be spilled.
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            warn!(?code, %reason, "Kafka producer hit a fatal error; recreating it.");
            match self.cfg.producer_config().create::<FutureProducer>() {
                Ok(p) => self.producer = p,
                Err(e) => {
                    error!(error = %e, "Recreating the Kafka producer failed.");
                    self.replay_now = false;
                    return false;
                }
            }
        }
        if !self.topics_ready {
            if !self.probe_broker().await {
                self.replay_now = false;
                return false;
            }
            let raw = self.cfg.raw();
            match ensure_topics(
                &self.cfg.client_config(),
                self.cfg.topics().all(),
                raw.topic_partitions,
                raw.topic_replication,
                Duration::from_secs(5),
            )
            .await
            {
                Ok(()) => {
                    info!("Topics ready.");
                    self.topics_ready = true;
                }
                Err(e) => {
                    warn!(error = %e, "Topics still not created.");
                    self.replay_now = false;
                    return false;
                }
            }
        }
        if !self.replay_now && !self.probe_broker().await {
            return false;
        }
        let batch_max = self.cfg.raw().replay_batch_records;
        let peeked = {
            let mut spill = self.shared.lock_spill();
            let r = spill.peek(batch_max);
            self.shared.refresh_spill_gauges(&spill);
            r
        };
        let (batch, to) = match peeked {
            Ok(b) => b,
            Err(e) => {
                error!(error = %e, "Reading the spill failed.");
                self.replay_now = false;
                return false;
            }
        };
        let mut futs = Vec::with_capacity(batch.len());
        for rec in &batch {
            let topic_name = self.cfg.topics().get(rec.topic);
            match self.producer.send_result(
                FutureRecord::to(topic_name)
                    .key(rec.key.as_bytes())
                    .payload(rec.payload.as_ref())
                    .headers(id_headers(&rec.id)),
            ) {
                Ok(f) => futs.push(f),
                Err((e, _)) => {
                    warn!(error = %e, "Replay refused by the producer; will retry.");
                    self.replay_now = false;
                    return false;
                }
            }
        }
        let wait = futures::future::join_all(futs);
        let results = match deadline {
            Some(d) => {
                match tokio::time::timeout(d.saturating_duration_since(Instant::now()), wait).await
                {
                    Ok(r) => r,
                    Err(_) => {
                        self.replay_now = false;
                        return false;
                    }
                }
            }
            None => wait.await,
        };
        let failed = results.iter().filter(|r| !matches!(r, Ok(Ok(_)))).count();
        if failed > 0 {
            warn!(
                failed,
                batch = batch.len(),
                "Spill replay failed; will retry."
            );
            self.replay_now = false;
            return false;
        }
        let n = batch.len() as u64;
        {
            let mut spill = self.shared.lock_spill();
            if let Err(e) = spill.commit(to, n) {
                error!(error = %e, "Advancing the spill cursor failed.");
            }
            self.shared.refresh_spill_gauges(&spill);
        }
        if n > 0 {
            self.shared
                .counters
                .replayed
                .fetch_add(n, Ordering::Relaxed);
            self.shared
                .counters
                .delivered
                .fetch_add(n, Ordering::Relaxed);
            metrics::counter!("hindsight_log_replayed_records_total").increment(n);
            metrics::counter!("hindsight_log_delivered_records_total", "topic" => "replay")
                .increment(n);
            debug!(records = n, "Spill batch replayed.");
        }
        self.replay_now = true;
        true
    }

    /// Asks the broker for metadata; true when it answers.
    async fn probe_broker(&self) -> bool {
        let producer = self.producer.clone();
        let ok = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Duration::from_secs(2))
                .is_ok()
        })
        .await
        .unwrap_or(false);
        if !ok {
            debug!("Broker probe failed.");
        }
        ok
    }

    async fn flush(mut self, mut rx: mpsc::Receiver<LogRecord>, until: Instant) -> FlushReport {
        rx.close();
        while let Ok(rec) = rx.try_recv() {
            self.dispatch(rec);
        }
        // Wait for in-flight deliveries until the deadline.
        while !self.inflight.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.inflight.next()).await {
                Ok(Some(outcome)) => self.on_delivery(outcome),
                Ok(None) => break,
                Err(_) => break,
            }
        }
        // Whatever is still in flight goes to the spill (it may also arrive: consumers dedupe by id).
        let leftover: Vec<u64> = self.inflight_records.keys().copied().collect();
        for seq in leftover {
            if let Some(rec) = self.inflight_records.remove(&seq) {
                self.shared.spill_one(rec);
            }
        }
        // Replay the spill while time remains and the broker answers.
        self.replay_now = true;
        while self.shared.spill_pending.load(Ordering::Relaxed) > 0 && Instant::now() < until {
            if !self.replay_once(Some(until)).await {
                break;
            }
        }
        self.sync_spill();
        let stats = LogHandle {
            shared: self.shared.clone(),
        }
        .stats();
        let report = FlushReport {
            delivered_records: stats.delivered_records,
            left_in_spill: stats.spill_pending_records,
            dropped_records: stats.dropped_records,
            complete: stats.spill_pending_records == 0,
        };
        info!(
            delivered = report.delivered_records,
            left_in_spill = report.left_in_spill,
            dropped = report.dropped_records,
            "Record log flushed."
        );
        report
    }
}

#[cfg(test)]
mod tests;
