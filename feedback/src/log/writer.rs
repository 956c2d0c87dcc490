//! The writer task: channel → producer, spill on trouble, replay when the broker is back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer, ProducerContext, PurgeConfig};
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use super::config::ensure_topics;
use super::{FlushReport, LogError, LogHandle, LogRecord, Shared, ValidatedLogConfig, ID_HEADER};

type DeliveryOutcome = (u64, Result<(), String>);
type InflightDelivery =
    std::pin::Pin<Box<dyn std::future::Future<Output = DeliveryOutcome> + Send + Sync>>;

/// The producer's context: librdkafka tells it at once when every broker connection is down
/// (a refused or reset connection), long before a message times out.
struct BrokerWatch {
    broker_down: Arc<AtomicBool>,
}

impl ClientContext for BrokerWatch {
    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error, KafkaError::Global(RDKafkaErrorCode::AllBrokersDown)) {
            if !self.broker_down.swap(true, Ordering::Relaxed) {
                warn!(%reason, "Every Kafka broker is down; records go to the spill first.");
            }
        } else {
            // librdkafka logs these itself (connection failures repeat on every retry).
            debug!(error = %error, %reason, "librdkafka error.");
        }
    }
}

impl ProducerContext for BrokerWatch {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

type LogProducer = FutureProducer<BrokerWatch>;

fn create_producer(
    cfg: &ValidatedLogConfig,
    broker_down: &Arc<AtomicBool>,
) -> Result<LogProducer, KafkaError> {
    cfg.producer_config().create_with_context(BrokerWatch {
        broker_down: broker_down.clone(),
    })
}

fn create_replay_producer(
    cfg: &ValidatedLogConfig,
    broker_down: &Arc<AtomicBool>,
) -> Result<LogProducer, KafkaError> {
    cfg.replay_producer_config()
        .create_with_context(BrokerWatch {
            broker_down: broker_down.clone(),
        })
}

/// A record handed to the producer and not yet acknowledged.
struct Inflight {
    rec: LogRecord,
    sent: Instant,
    /// Whether a copy is already in the spill (the broker went down while it was in flight).
    spilled: bool,
}

pub(super) struct Writer {
    cfg: ValidatedLogConfig,
    shared: Arc<Shared>,
    producer: LogProducer,
    /// Sends the spill (see `replay_producer_config`); made at the first replay, so a process
    /// whose broker never fails runs one Kafka client, not two.
    replay_producer: Option<LogProducer>,
    inflight: FuturesUnordered<InflightDelivery>,
    /// By send order: the first entry is the oldest unacknowledged record.
    inflight_records: BTreeMap<u64, Inflight>,
    next_seq: u64,
    /// Every record in flight with a smaller sequence number has a copy in the spill.
    spilled_below: u64,
    topics_ready: bool,
    last_probe: Option<Instant>,
    replay_now: bool,
    last_sync: Instant,
    /// Dispatch to acknowledgement: how long a record lived only in memory, which is what a
    /// crash with a healthy broker can lose.
    ack_seconds: metrics::Histogram,
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
    pub(super) fn new(
        cfg: ValidatedLogConfig,
        shared: Arc<Shared>,
        topics_ready: bool,
    ) -> Result<Writer, LogError> {
        let producer = create_producer(&cfg, &shared.broker_down)?;
        Ok(Writer {
            cfg,
            shared,
            producer,
            replay_producer: None,
            inflight: FuturesUnordered::new(),
            inflight_records: BTreeMap::new(),
            next_seq: 0,
            spilled_below: 0,
            topics_ready,
            last_probe: None,
            replay_now: true,
            last_sync: Instant::now(),
            ack_seconds: metrics::histogram!("hindsight_log_ack_seconds"),
        })
    }

    pub(super) async fn run(
        mut self,
        mut rx: mpsc::Receiver<LogRecord>,
        mut stop: watch::Receiver<Option<Instant>>,
    ) -> FlushReport {
        let probe_every = Duration::from_millis(self.cfg.raw().probe_interval_ms);
        let mut tick = tokio::time::interval(probe_every.min(Duration::from_millis(200)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let until = loop {
            let spill_pending = self.shared.spill_pending.load(Ordering::Relaxed) > 0;
            let broker_down = self.shared.broker_down.load(Ordering::Relaxed);
            let replay_ready = spill_pending && self.replay_now && !broker_down;
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
                    self.housekeeping(&rx);
                    if spill_pending || !self.topics_ready || broker_down {
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

    fn housekeeping(&mut self, rx: &mpsc::Receiver<LogRecord>) {
        let depth = rx.len();
        metrics::gauge!("hindsight_log_queue_depth_records").set(depth as f64);
        self.watch_broker();
        let down = self.shared.broker_down.load(Ordering::Relaxed);
        metrics::gauge!("hindsight_log_broker_unreachable").set(if down { 1.0 } else { 0.0 });
        let fsync_every = Duration::from_millis(self.cfg.raw().spill_fsync_interval_ms);
        if self.last_sync.elapsed() >= fsync_every {
            self.sync_spill();
        }
    }

    /// Notices a broker that stopped acknowledging (a record older than `spill_after_ms` in
    /// flight) and, while the broker is down, makes sure nothing waits for it only in memory.
    fn watch_broker(&mut self) {
        if !self.shared.broker_down.load(Ordering::Relaxed) {
            let spill_after = Duration::from_millis(self.cfg.raw().spill_after_ms);
            let Some((_, oldest)) = self.inflight_records.first_key_value() else {
                return;
            };
            let waited = oldest.sent.elapsed();
            if waited < spill_after {
                return;
            }
            warn!(
                waited_ms = waited.as_millis() as u64,
                in_flight = self.inflight_records.len(),
                "Kafka has not acknowledged a record within spill_after_ms; treating the broker as unreachable."
            );
            self.shared.broker_down.store(true, Ordering::Relaxed);
        }
        self.spill_inflight();
    }

    /// Copies every record handed to the producer and not yet acknowledged into the spill, and
    /// purges librdkafka's queue of them (their failed deliveries are then ignored). Records
    /// already on the wire cannot be purged safely; if they do arrive, the replayed copy is a
    /// duplicate that consumers drop by id.
    fn spill_inflight(&mut self) {
        let mut copied = 0u64;
        for f in self
            .inflight_records
            .range_mut(self.spilled_below..)
            .map(|(_, f)| f)
            .filter(|f| !f.spilled)
        {
            self.shared.spill_one(f.rec.clone());
            f.spilled = true;
            copied += 1;
        }
        self.spilled_below = self.next_seq;
        if copied > 0 {
            self.producer.purge(PurgeConfig::default().queue());
            self.replay_now = false;
            info!(
                records = copied,
                "Records waiting for Kafka copied to the spill."
            );
        }
    }

    fn sync_spill(&mut self) {
        self.last_sync = Instant::now();
        let mut spill = self.shared.lock_spill();
        if let Err(e) = spill.sync() {
            error!(error = %e, "Spill fsync failed.");
        }
    }

    /// Sends a record directly, unless the spill holds older records (order), the broker is
    /// known to be down, or topics are not ready.
    fn dispatch(&mut self, rec: LogRecord) {
        let broker_down = self.shared.broker_down.load(Ordering::Relaxed);
        if !self.topics_ready
            || broker_down
            || self.shared.spill_pending.load(Ordering::Relaxed) > 0
        {
            if broker_down {
                // The records sent before this one and still unacknowledged go to the spill
                // first, so the spill keeps submission order (the broker's watcher may have
                // flagged the outage before the writer's tick copied them).
                self.spill_inflight();
            }
            self.shared.spill_one(rec);
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
                self.inflight_records.insert(
                    seq,
                    Inflight {
                        rec,
                        sent: Instant::now(),
                        spilled: false,
                    },
                );
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
                self.spill_inflight();
                self.shared.spill_one(rec);
                self.shared.broker_down.store(true, Ordering::Relaxed);
                self.replay_now = false;
            }
        }
    }

    fn on_delivery(&mut self, (seq, result): DeliveryOutcome) {
        let Some(Inflight { rec, sent, spilled }) = self.inflight_records.remove(&seq) else {
            return;
        };
        match result {
            // A record whose copy is in the spill may still arrive; the replay then repeats it
            // and consumers drop the repeat by id.
            Ok(()) => {
                if !spilled {
                    self.ack_seconds.record(sent.elapsed());
                }
                self.shared
                    .counters
                    .delivered
                    .fetch_add(1, Ordering::Relaxed);
                metrics::counter!("hindsight_log_delivered_records_total", "topic" => rec.topic.suffix())
                    .increment(1);
            }
            // Purged (or failed) after its copy went to the spill: nothing left to do.
            Err(_) if spilled => {}
            Err(e) => {
                warn!(id = %rec.id, error = %e, "Delivery failed; spilling, and the broker counts as unreachable.");
                self.shared.spill_one(rec);
                self.shared.broker_down.store(true, Ordering::Relaxed);
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
            match create_producer(&self.cfg, &self.shared.broker_down) {
                Ok(p) => self.producer = p,
                Err(e) => {
                    error!(error = %e, "Recreating the Kafka producer failed.");
                    self.replay_now = false;
                    return false;
                }
            }
        }
        if let Some(p) = &self.replay_producer {
            if let Some((code, reason)) = p.client().fatal_error() {
                warn!(?code, %reason, "Kafka replay producer hit a fatal error; recreating it.");
                self.replay_producer = None;
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
        let must_probe = !self.replay_now || self.shared.broker_down.load(Ordering::Relaxed);
        if must_probe && !self.probe_broker().await {
            self.replay_now = false;
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
        let replay_producer = match self.replay_producer.take() {
            Some(p) => p,
            None => match create_replay_producer(&self.cfg, &self.shared.broker_down) {
                Ok(p) => p,
                Err(e) => {
                    error!(error = %e, "Creating the Kafka replay producer failed.");
                    self.replay_now = false;
                    return false;
                }
            },
        };
        let replay_producer = &*self.replay_producer.insert(replay_producer);
        let mut futs = Vec::with_capacity(batch.len());
        for rec in &batch {
            let topic_name = self.cfg.topics().get(rec.topic);
            match replay_producer.send_result(
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
        if self.shared.broker_down.swap(false, Ordering::Relaxed) {
            info!("Kafka answers again; records go to the broker (after the spill drains).");
        }
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
        for f in std::mem::take(&mut self.inflight_records).into_values() {
            if !f.spilled {
                self.shared.spill_one(f.rec);
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
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::AtomicU64;
    use std::sync::Mutex;

    use bytes::Bytes;

    use super::*;
    use crate::log::{Counters, LogConfig};
    use crate::records::Topic;
    use crate::spill::Spill;

    /// The outage race the log test hit under load: librdkafka flags every broker down (the
    /// producer's context sets `broker_down`) before the writer's tick copies the records it
    /// had in flight. The next record diverted to the spill must not overtake them.
    #[tokio::test]
    async fn records_in_flight_enter_the_spill_ahead_of_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LogConfig {
            brokers: "127.0.0.1:1".into(),
            spill_dir: dir.path().to_path_buf(),
            create_topics: false,
            ..LogConfig::default()
        }
        .validate()
        .unwrap();
        let (tx, _rx) = mpsc::channel(16);
        let shared = Arc::new(Shared {
            tx,
            spill: Mutex::new(Spill::open(dir.path(), 1 << 20, 1 << 16).unwrap()),
            spill_pending: AtomicU64::new(0),
            spill_bytes: AtomicU64::new(0),
            spill_corrupt: AtomicU64::new(0),
            counters: Counters::default(),
            broker_down: Arc::new(AtomicBool::new(false)),
            sync_every_append: false,
        });
        let mut writer = Writer::new(cfg.clone(), shared.clone(), true).unwrap();
        // librdkafka's own thread would flag the refused address down at a moment of its
        // choosing (after the first record on a fast machine); the test flips the flag itself.
        // (Dropping the first producer joins its polling thread: no callback comes after.)
        writer.producer = create_producer(&cfg, &Arc::new(AtomicBool::new(false))).unwrap();
        shared.broker_down.store(false, Ordering::Relaxed);
        let ids: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
        let record = |id: Uuid| LogRecord {
            topic: Topic::Feedback,
            key: "k".into(),
            id,
            payload: Bytes::from_static(b"{}"),
        };
        for id in &ids[..6] {
            writer.dispatch(record(*id));
        }
        assert_eq!(writer.inflight_records.len(), 6, "sent to the producer");
        shared.broker_down.store(true, Ordering::Relaxed);
        for id in &ids[6..] {
            writer.dispatch(record(*id));
        }
        let (spilled, _) = shared.lock_spill().peek(100).unwrap();
        let spilled: Vec<Uuid> = spilled.iter().map(|r| r.id).collect();
        assert_eq!(spilled, ids, "the spill keeps submission order");
        // The tick's copy afterwards adds nothing twice.
        writer.spill_inflight();
        assert_eq!(shared.lock_spill().pending_records(), 10);
    }
}
