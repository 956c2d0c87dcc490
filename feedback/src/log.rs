//! The record log: a non-blocking, no-loss writer from Hindsight's hot paths into Kafka.
//!
//! `LogHandle::submit` puts a record on a bounded channel and returns; a writer task
//! ([`writer`]) drains it into an rdkafka producer. When the broker is slow or away the records
//! go to the on-disk [`Spill`](crate::spill) and are replayed in order once a probe finds the
//! broker back. What a crash can lose is bounded by how fast the log notices trouble:
//! - the broker is *known to be unreachable* (librdkafka reports every broker down, a delivery
//!   failed, or a record waited `spill_after_ms` for its acknowledgement): from then on `submit`
//!   appends to the spill itself, before it returns, and the writer copies what it had handed
//!   to the producer into the spill too. A SIGKILLed process loses nothing it submitted (the
//!   spill is written straight to the file; a machine crash can lose the last
//!   `spill_fsync_interval_ms`). A probe every `probe_interval_ms` brings it back.
//! - the broker is healthy: a record lives only in memory until Kafka acknowledges it (the
//!   channel, `linger_ms`, one produce round trip); a crash loses those few milliseconds.
//!
//! While anything is spilled, new records go to the spill too, so the spill drains in arrival
//! order. If the channel is full, `submit` appends to the spill itself. Only when the spill is
//! full is a record dropped, and then it is counted and logged with its id.

mod config;
mod writer;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::error::KafkaError;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

pub use config::{ensure_topics, LogConfig, TopicNames, ValidatedLogConfig};

use crate::records::Topic;
use crate::spill::{Spill, SpillRecord};
use writer::Writer;

/// Header carrying the record id on every Kafka message.
pub const ID_HEADER: &str = "hindsight-id";

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
    /// Whether the broker is known to be unreachable (records go to the spill first).
    pub broker_unreachable: bool,
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

#[derive(Clone)]
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
    /// Whether the broker is known to be unreachable: set by the producer's error callback
    /// (every broker down) and by the writer (a failed delivery, an acknowledgement later than
    /// `spill_after_ms`); cleared by the writer once a probe and a replay succeed. While set,
    /// `submit` writes to the spill itself.
    broker_down: Arc<AtomicBool>,
    /// `spill_fsync_interval_ms = 0`: every append is fsynced before `spill_one` returns.
    sync_every_append: bool,
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
                if self.sync_every_append {
                    if let Err(e) = spill.sync() {
                        error!(%id, error = %e, "Spill fsync failed.");
                    }
                }
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
    /// Queues a record for Kafka. Never blocks on the network and never fails: when the broker
    /// is known to be unreachable, the queue is full or the log is shut down, the record is
    /// appended to the disk spill before this returns; only a full spill drops it (counted).
    pub fn submit(&self, topic: Topic, key: String, id: Uuid, payload: Bytes) {
        let rec = LogRecord {
            topic,
            key,
            id,
            payload,
        };
        if self.shared.broker_down.load(Ordering::Relaxed) {
            self.shared.spill_one(rec);
            return;
        }
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
            broker_unreachable: s.broker_down.load(Ordering::Relaxed),
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
        let (tx, rx) = mpsc::channel(raw.queue_capacity);
        let shared = Arc::new(Shared {
            tx,
            spill: Mutex::new(spill),
            spill_pending: AtomicU64::new(0),
            spill_bytes: AtomicU64::new(0),
            spill_corrupt: AtomicU64::new(0),
            counters: Counters::default(),
            broker_down: Arc::new(AtomicBool::new(false)),
            sync_every_append: raw.spill_fsync_interval_ms == 0,
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
        let writer = Writer::new(cfg.clone(), shared.clone(), topics_ready)?;
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

#[cfg(test)]
mod tests;
