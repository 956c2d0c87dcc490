//! Reader over Hindsight topics, as a consumer-group member ([`TopicReader::new`]) or as the
//! single owner of every partition starting from its own positions ([`TopicReader::assigned`]).
//! Returns records with their offsets and commits positions only when the caller says the
//! records are processed.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::log::{LogError, ValidatedLogConfig, ID_HEADER};
use crate::records::Topic;

/// One record read from Kafka.
#[derive(Debug, Clone)]
pub struct RawRecord {
    /// Topic name.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset within the partition.
    pub offset: i64,
    /// Message key as text (lossy UTF-8).
    pub key: Option<String>,
    /// The `hindsight-id` header, when present and valid.
    pub id: Option<Uuid>,
    /// Message payload.
    pub payload: Bytes,
    /// Broker/producer timestamp in ms.
    pub timestamp_ms: Option<i64>,
}

impl RawRecord {
    /// Deserializes the JSON payload.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, LogError> {
        serde_json::from_slice(&self.payload).map_err(|e| LogError::Decode {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            reason: e.to_string(),
        })
    }
}

/// A consumer-group reader. Offsets are committed only through [`TopicReader::commit`] /
/// [`TopicReader::commit_offsets`] (auto-commit is off), so a crash re-reads unprocessed records.
pub struct TopicReader {
    consumer: StreamConsumer,
}

impl std::fmt::Debug for TopicReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopicReader").finish_non_exhaustive()
    }
}

/// Next positions to commit, per (topic, partition).
pub type Positions = BTreeMap<(String, i32), i64>;

impl TopicReader {
    /// Joins consumer group `group_id` on the given Hindsight topics, reading from the earliest
    /// uncommitted offset.
    pub fn new(
        cfg: &ValidatedLogConfig,
        group_id: &str,
        topics: &[Topic],
    ) -> Result<TopicReader, LogError> {
        let names: Vec<String> = topics
            .iter()
            .map(|t| cfg.topics().get(*t).to_string())
            .collect();
        Self::with_client(cfg.client_config(), group_id, &names)
    }

    /// Like [`TopicReader::new`] with an explicit client config and topic names.
    pub fn with_client(
        mut client: ClientConfig,
        group_id: &str,
        topics: &[String],
    ) -> Result<TopicReader, LogError> {
        Self::configure(&mut client, group_id);
        let consumer: StreamConsumer = client.create()?;
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&refs)?;
        Ok(TopicReader { consumer })
    }

    /// Reads **every** partition of `topics` without joining the consumer group's rebalancing:
    /// the caller owns the topics and says where each partition starts (`start`, e.g. from its
    /// own durable checkpoint). Partitions missing from `start` begin at the group's committed
    /// offset, else at the earliest. Commits still go to `group_id`, for lag monitoring and for
    /// a later reader in group mode.
    ///
    /// This is for a single owner whose checkpoint is the source of truth (the learner): it
    /// never waits for a rebalance, so a restart right after a crash reads at once instead of
    /// waiting out the dead member's session (a broker may hand the new member an empty
    /// assignment until then).
    pub fn assigned(
        cfg: &ValidatedLogConfig,
        group_id: &str,
        topics: &[Topic],
        start: &Positions,
        timeout: Duration,
    ) -> Result<TopicReader, LogError> {
        let names: Vec<String> = topics
            .iter()
            .map(|t| cfg.topics().get(*t).to_string())
            .collect();
        let mut client = cfg.client_config();
        Self::configure(&mut client, group_id);
        let consumer: StreamConsumer = client.create()?;
        let mut tpl = TopicPartitionList::new();
        let mut unknown = TopicPartitionList::new();
        for name in &names {
            let md = consumer.fetch_metadata(Some(name), timeout)?;
            let partitions: Vec<i32> = md
                .topics()
                .iter()
                .filter(|t| t.name() == name && t.error().is_none())
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect();
            if partitions.is_empty() {
                return Err(LogError::CreateTopic {
                    topic: name.clone(),
                    reason: "the broker lists no partitions for it".into(),
                });
            }
            for p in partitions {
                match start.get(&(name.clone(), p)) {
                    Some(off) => {
                        tpl.add_partition_offset(name, p, Offset::Offset(*off))?;
                    }
                    None => {
                        unknown.add_partition(name, p);
                    }
                }
            }
        }
        if unknown.count() > 0 {
            let committed = consumer.committed_offsets(unknown, timeout)?;
            for e in committed.elements() {
                let off = match e.offset() {
                    Offset::Offset(o) if o >= 0 => Offset::Offset(o),
                    _ => Offset::Beginning,
                };
                tpl.add_partition_offset(e.topic(), e.partition(), off)?;
            }
        }
        consumer.assign(&tpl)?;
        Ok(TopicReader { consumer })
    }

    /// A reader that reads nothing until [`TopicReader::assign_partitions`] gives it
    /// partitions: for owners that divide the partitions among themselves (the joiners, see
    /// feedback/src/joiner/members.rs). Commits go to `group_id`.
    pub fn manual(cfg: &ValidatedLogConfig, group_id: &str) -> Result<TopicReader, LogError> {
        let mut client = cfg.client_config();
        Self::configure(&mut client, group_id);
        Ok(TopicReader {
            consumer: client.create()?,
        })
    }

    /// The partition ids of `topic` as the broker lists them now (blocking: call it between
    /// batches).
    pub fn partitions_of(&self, topic: &str, timeout: Duration) -> Result<Vec<i32>, LogError> {
        let md = self.consumer.fetch_metadata(Some(topic), timeout)?;
        let mut ids: Vec<i32> = md
            .topics()
            .iter()
            .filter(|t| t.name() == topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        ids.sort_unstable();
        Ok(ids)
    }

    /// Reads exactly `partitions` from now on, each from the group's committed offset (else
    /// the earliest). Records fetched for partitions dropped here are not returned any more.
    pub fn assign_partitions(
        &self,
        partitions: &[(String, i32)],
        timeout: Duration,
    ) -> Result<(), LogError> {
        let mut wanted = TopicPartitionList::new();
        for (topic, p) in partitions {
            wanted.add_partition(topic, *p);
        }
        let mut tpl = TopicPartitionList::new();
        if wanted.count() > 0 {
            let committed = self.consumer.committed_offsets(wanted, timeout)?;
            for e in committed.elements() {
                let off = match e.offset() {
                    Offset::Offset(o) if o >= 0 => Offset::Offset(o),
                    _ => Offset::Beginning,
                };
                tpl.add_partition_offset(e.topic(), e.partition(), off)?;
            }
        }
        self.consumer.assign(&tpl)?;
        Ok(())
    }

    fn configure(client: &mut ClientConfig, group_id: &str) {
        client
            .set("group.id", group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            .set("enable.partition.eof", "false");
        read_uncommitted(client);
        // A subscription to a topic the broker does not list yet (just created, or a broker
        // that is slow to publish it) is only retried at the next metadata refresh, 5 minutes
        // by default.
        if client.get("max.partition.fetch.bytes").is_none() {
            client.set("max.partition.fetch.bytes", "65536");
        }
        if client.get("topic.metadata.refresh.interval.ms").is_none() {
            client.set("topic.metadata.refresh.interval.ms", "5000");
        }
    }

    /// Waits for the next record. Transient broker errors (broker away, timeouts, group
    /// coordinator moving, topic not created yet) are logged and waited out; librdkafka
    /// reconnects by itself.
    pub async fn recv(&self) -> Result<RawRecord, LogError> {
        let msg = loop {
            match self.consumer.recv().await {
                Ok(m) => break m,
                Err(KafkaError::MessageConsumption(code)) if transient(code) => {
                    tracing::debug!(?code, "Transient consumer error; waiting.");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(KafkaError::PartitionEOF(_)) => {}
                Err(e) => return Err(e.into()),
            }
        };
        let id = record_id(&msg);
        Ok(RawRecord {
            topic: msg.topic().to_string(),
            partition: msg.partition(),
            offset: msg.offset(),
            key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            id,
            payload: Bytes::copy_from_slice(msg.payload().unwrap_or_default()),
            timestamp_ms: msg.timestamp().to_millis(),
        })
    }

    /// Waits up to `timeout` for the next record.
    pub async fn recv_timeout(&self, timeout: Duration) -> Result<Option<RawRecord>, LogError> {
        match tokio::time::timeout(timeout, self.recv()).await {
            Ok(r) => r.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Commits the position after `rec` (synchronously).
    pub fn commit(&self, rec: &RawRecord) -> Result<(), LogError> {
        let mut p = Positions::new();
        p.insert((rec.topic.clone(), rec.partition), rec.offset + 1);
        self.commit_offsets(&p)
    }

    /// Commits next positions (offset of the next record to read) synchronously.
    pub fn commit_offsets(&self, positions: &Positions) -> Result<(), LogError> {
        if positions.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in positions {
            tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
        }
        self.consumer.commit(&tpl, CommitMode::Sync)?;
        Ok(())
    }
}

/// A saved read position (the next offset to read on one partition), checked against the
/// topic as the broker holds it now: a checkpoint that outlives its topic (the broker emptied,
/// the topic deleted and created again) must not skip the new topic's records as "already
/// read".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PositionCheck {
    /// The record before the position is the one the position was saved after.
    Same,
    /// Nothing to compare: the position is 0, the record before it was removed by retention,
    /// or it was saved without the record's id.
    Unverifiable,
    /// The partition ends before the position: it was emptied or replaced.
    BeyondEnd {
        /// The partition's end (next offset to be written).
        end: i64,
    },
    /// The record before the position has another id: the topic was replaced.
    Replaced {
        /// The id saved with the position.
        expected: Uuid,
        /// The id found there now (`None`: a record without Hindsight's id header).
        found: Option<Uuid>,
    },
}

impl PositionCheck {
    /// Whether the position no longer refers to this topic's records.
    pub fn is_stale(&self) -> bool {
        matches!(self, Self::BeyondEnd { .. } | Self::Replaced { .. })
    }
}

/// Consumers read at `read_uncommitted` unless `client_options` say otherwise. Hindsight writes
/// no transactions, so both levels see the same records; the local broker (tansu 0.6 on
/// PostgreSQL 15) fails every `ListOffsets` at `read_committed` (its query needs PostgreSQL 16),
/// which broke watermark and end-offset lookups.
fn read_uncommitted(client: &mut ClientConfig) {
    if client.get("isolation.level").is_none() {
        client.set("isolation.level", "read_uncommitted");
    }
}

/// The end of every partition of `topics`: the offset the next record written there will get
/// (its high watermark). A reader that has read up to these has read everything written before
/// the call. Blocking (one metadata and one watermark query per partition): call it off the
/// async workers.
pub fn end_offsets(
    client: &ClientConfig,
    topics: &[String],
    timeout: Duration,
) -> Result<Positions, LogError> {
    let mut client = client.clone();
    client
        .set("group.id", "hindsight-end-offsets")
        .set("enable.auto.commit", "false");
    read_uncommitted(&mut client);
    let consumer: BaseConsumer = client.create()?;
    let mut ends = Positions::new();
    for name in topics {
        let md = consumer.fetch_metadata(Some(name), timeout)?;
        for t in md.topics().iter().filter(|t| t.name() == name) {
            for p in t.partitions() {
                let (_, high) = consumer.fetch_watermarks(name, p.id(), timeout)?;
                ends.insert((name.clone(), p.id()), high);
            }
        }
    }
    Ok(ends)
}

/// Checks a saved position (`next` = the next offset to read, `last_id` = the `hindsight-id` of
/// the record at `next - 1` when it was read) against `topic`/`partition` now. Blocking (one
/// watermark query and at most one fetch): call it at start-up, off the async workers.
pub fn check_position(
    client: &ClientConfig,
    topic: &str,
    partition: i32,
    next: i64,
    last_id: Option<Uuid>,
    timeout: Duration,
) -> Result<PositionCheck, LogError> {
    if next <= 0 {
        return Ok(PositionCheck::Unverifiable);
    }
    let mut client = client.clone();
    client
        .set("group.id", "hindsight-position-check")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    read_uncommitted(&mut client);
    let consumer: BaseConsumer = client.create()?;
    let (low, high) = consumer.fetch_watermarks(topic, partition, timeout)?;
    if high < next {
        return Ok(PositionCheck::BeyondEnd { end: high });
    }
    let Some(expected) = last_id else {
        return Ok(PositionCheck::Unverifiable);
    };
    if next - 1 < low {
        return Ok(PositionCheck::Unverifiable);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(next - 1))?;
    consumer.assign(&tpl)?;
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        let Some(msg) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let msg = match msg {
            Ok(m) => m,
            Err(KafkaError::MessageConsumption(code)) if transient(code) => continue,
            Err(e) => return Err(e.into()),
        };
        if msg.partition() != partition || msg.offset() != next - 1 {
            continue;
        }
        let found = record_id(&msg);
        return Ok(if found == Some(expected) {
            PositionCheck::Same
        } else {
            PositionCheck::Replaced { expected, found }
        });
    }
    Err(LogError::Timeout(format!(
        "reading {topic}/{partition}@{} to check a saved position",
        next - 1
    )))
}

/// The record's `hindsight-id` header, when present and a UUID.
fn record_id<M: Message>(msg: &M) -> Option<Uuid> {
    msg.headers().and_then(|h| {
        h.iter()
            .find(|hd| hd.key == ID_HEADER)
            .and_then(|hd| hd.value)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| Uuid::parse_str(s).ok())
    })
}

fn transient(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::OperationTimedOut
            | C::RequestTimedOut
            | C::NetworkException
            | C::CoordinatorLoadInProgress
            | C::CoordinatorNotAvailable
            | C::NotCoordinator
            | C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::Resolve
    )
}
