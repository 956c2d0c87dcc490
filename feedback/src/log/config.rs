//! The log's configuration: raw TOML, validated once; topic names; topic creation.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::types::RDKafkaErrorCode;
use serde::Deserialize;

use super::LogError;
use crate::records::Topic;

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
    /// How long a record may wait for Kafka's acknowledgement before the broker counts as
    /// unreachable: everything waiting is copied to the spill and new records are written there
    /// before `submit` returns, until a probe finds the broker back. It bounds what a crash
    /// during a silent broker stall can lose (a refused connection is noticed at once).
    #[serde(default = "default_spill_after_ms")]
    pub spill_after_ms: u64,
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
fn default_spill_after_ms() -> u64 {
    1_000
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
            spill_after_ms: default_spill_after_ms(),
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
        if self.spill_after_ms < 10 || self.spill_after_ms >= self.message_timeout_ms {
            return Err(bad(
                "spill_after_ms",
                "must be at least 10 and below message_timeout_ms",
            ));
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

    /// The spill replay's producer: one request in flight per connection, so a retried request
    /// cannot land after the ones sent behind it and the spill reaches Kafka in the order it was
    /// written. Live traffic keeps pipelining (`producer_config`); replay sends whole batches, so
    /// one request at a time costs it little.
    pub(crate) fn replay_producer_config(&self) -> ClientConfig {
        let mut cc = self.producer_config();
        cc.set("max.in.flight.requests.per.connection", "1");
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
