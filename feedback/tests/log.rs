//! The record log against the real broker: delivery with keys and ids, spill while the broker is
//! absent, replay in order (also after a restart from the spill directory), overflow and drops,
//! and a broker that refuses or stalls noticed before records wait in memory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hindsight_feedback::{LogConfig, RecordLog, Topic, TopicReader, ValidatedLogConfig};
use uuid::Uuid;

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A port nothing listens on.
fn dead_brokers() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("127.0.0.1:{port}")
}

fn config(brokers: String, prefix: &str, spill: &std::path::Path) -> LogConfig {
    LogConfig {
        brokers,
        topic_prefix: prefix.to_string(),
        spill_dir: spill.to_path_buf(),
        message_timeout_ms: 2_000,
        probe_interval_ms: 200,
        ..LogConfig::default()
    }
}

fn prefix() -> String {
    format!("test-log-{}", Uuid::now_v7().simple())
}

/// Reads until `want` distinct ids arrived (or 90 s pass); returns them in arrival order.
async fn read_ids(
    cfg: &ValidatedLogConfig,
    topic: Topic,
    want: usize,
) -> Vec<(Uuid, Option<String>, Bytes)> {
    let reader = TopicReader::new(cfg, &format!("g-{}", Uuid::now_v7()), &[topic]).unwrap();
    let mut seen = HashMap::new();
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(90);
    while seen.len() < want && Instant::now() < until {
        if let Some(rec) = reader.recv_timeout(Duration::from_secs(2)).await.unwrap() {
            let id = rec.id.expect("every record carries the id header");
            if seen.insert(id, ()).is_none() {
                out.push((id, rec.key.clone(), rec.payload.clone()));
            }
        }
    }
    out
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_every_record_with_its_key_and_id() {
    let spill = tempfile::tempdir().unwrap();
    let cfg = config(brokers(), &prefix(), spill.path())
        .validate()
        .unwrap();
    let (log, handle) = RecordLog::start(cfg.clone()).await.unwrap();
    let mut sent = HashMap::new();
    for i in 0..500 {
        let id = Uuid::now_v7();
        let key = format!("episode-{}", i % 7);
        let payload = Bytes::from(format!("{{\"n\":{i}}}"));
        sent.insert(id, (key.clone(), payload.clone()));
        handle.submit(Topic::Interactions, key, id, payload);
    }
    let got = read_ids(&cfg, Topic::Interactions, 500).await;
    assert_eq!(got.len(), 500);
    for (id, key, payload) in got {
        let (k, p) = sent.get(&id).expect("an id we sent");
        assert_eq!(key.as_deref(), Some(k.as_str()));
        assert_eq!(&payload, p);
    }
    let report = log.shutdown(Duration::from_secs(10)).await;
    assert!(report.complete);
    assert_eq!(report.delivered_records, 500);
    assert_eq!(report.dropped_records, 0);
    assert_eq!(handle.stats().spilled_records, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spills_while_broker_absent_and_replays_in_order_after_restart() {
    let spill = tempfile::tempdir().unwrap();
    let prefix = prefix();
    let ids: Vec<Uuid> = (0..300).map(|_| Uuid::now_v7()).collect();

    // First run: nothing listens on the broker port.
    let dead = config(dead_brokers(), &prefix, spill.path())
        .validate()
        .unwrap();
    let (log, handle) = RecordLog::start(dead).await.unwrap();
    for (i, id) in ids[..200].iter().enumerate() {
        handle.submit(
            Topic::Feedback,
            "k".into(),
            *id,
            Bytes::from(format!("{i}")),
        );
    }
    wait_for("200 spilled records", || {
        handle.stats().spilled_records == 200
    })
    .await;
    let report = log.shutdown(Duration::from_secs(2)).await;
    assert_eq!(report.left_in_spill, 200);
    assert_eq!(report.delivered_records, 0);
    assert!(!report.complete);

    // Second run, same spill directory, broker present: the spill replays first, in order, and
    // records submitted meanwhile queue behind it.
    let live = config(brokers(), &prefix, spill.path()).validate().unwrap();
    let (log, handle) = RecordLog::start(live.clone()).await.unwrap();
    for (i, id) in ids[200..].iter().enumerate() {
        handle.submit(
            Topic::Feedback,
            "k".into(),
            *id,
            Bytes::from(format!("{}", 200 + i)),
        );
    }
    let got = read_ids(&live, Topic::Feedback, 300).await;
    let got_ids: Vec<Uuid> = got.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(got_ids, ids, "replayed in submission order, nothing lost");
    wait_for("spill drained", || {
        handle.stats().spill_pending_records == 0
    })
    .await;
    let stats = handle.stats();
    assert!(stats.replayed_records >= 200, "{stats:?}");
    assert_eq!(stats.spilled_bytes, 0, "delivered segments are deleted");
    let report = log.shutdown(Duration::from_secs(10)).await;
    assert!(report.complete);
    assert_eq!(report.dropped_records, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_spill_drops_are_counted() {
    let spill = tempfile::tempdir().unwrap();
    let mut raw = config(dead_brokers(), &prefix(), spill.path());
    raw.spill_max_bytes = 8192;
    let cfg = raw.validate().unwrap();
    let (log, handle) = RecordLog::start(cfg).await.unwrap();
    let payload = Bytes::from(vec![b'x'; 200]);
    for _ in 0..100 {
        handle.submit(
            Topic::Interactions,
            "k".into(),
            Uuid::now_v7(),
            payload.clone(),
        );
    }
    wait_for("every record spilled or dropped", || {
        let s = handle.stats();
        s.spilled_records + s.dropped_records == 100
    })
    .await;
    let s = handle.stats();
    assert!(s.dropped_records > 0, "{s:?}");
    assert!(s.spilled_records > 0, "{s:?}");
    assert!(s.spilled_bytes <= 8192, "{s:?}");
    let report = log.shutdown(Duration::from_secs(1)).await;
    assert_eq!(report.dropped_records, s.dropped_records);
    assert_eq!(report.left_in_spill, s.spilled_records);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_overflow_spills_and_still_delivers_everything() {
    let spill = tempfile::tempdir().unwrap();
    let mut raw = config(brokers(), &prefix(), spill.path());
    raw.queue_capacity = 4;
    let cfg = raw.validate().unwrap();
    let (log, handle) = RecordLog::start(cfg.clone()).await.unwrap();
    let ids: Vec<Uuid> = (0..2000).map(|_| Uuid::now_v7()).collect();
    for id in &ids {
        handle.submit(
            Topic::Episodes,
            id.to_string(),
            *id,
            Bytes::from_static(b"{}"),
        );
    }
    assert!(
        handle.stats().spilled_records > 0,
        "a 4-slot queue must overflow"
    );
    let got = read_ids(&cfg, Topic::Episodes, ids.len()).await;
    assert_eq!(got.len(), ids.len());
    for (id, key, _) in &got {
        assert_eq!(key.as_deref(), Some(id.to_string().as_str()));
    }
    let report = log.shutdown(Duration::from_secs(10)).await;
    assert!(report.complete, "{report:?}");
    assert_eq!(report.dropped_records, 0);
}

/// Submits one record; returns whether it was on disk (in the spill) when `submit` returned.
fn spilled_on_submit(handle: &hindsight_feedback::LogHandle, i: usize) -> bool {
    let before = handle.stats().spilled_records;
    handle.submit(
        Topic::Interactions,
        format!("k{i}"),
        Uuid::now_v7(),
        Bytes::from(format!("{{\"n\":{i}}}")),
    );
    handle.stats().spilled_records == before + 1
}

/// A broker that refuses connections after the log started (topics taken as existing, so
/// records go to the producer, as with a broker that was up at start): librdkafka reports every
/// broker down at once, and from then on nothing waits for Kafka in memory — the first record
/// is copied to the spill long before its 30 s message timeout, and every later one is on disk
/// when `submit` returns. (Before, all of them waited the message timeout in memory, and a
/// crash in that window lost them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_broker_sends_records_to_the_spill_before_submit_returns() {
    let spill = tempfile::tempdir().unwrap();
    let mut raw = config(dead_brokers(), &prefix(), spill.path());
    raw.create_topics = false;
    raw.message_timeout_ms = 30_000;
    let cfg = raw.validate().unwrap();
    let (log, handle) = RecordLog::start(cfg).await.unwrap();
    let started = Instant::now();
    spilled_on_submit(&handle, 0);
    wait_for("the first record in the spill", || {
        handle.stats().spill_pending_records == 1
    })
    .await;
    let noticed = started.elapsed();
    assert!(
        noticed < Duration::from_secs(5),
        "a refused connection took {noticed:?} to notice"
    );
    assert!(handle.stats().broker_unreachable);
    for i in 1..=300 {
        assert!(
            spilled_on_submit(&handle, i),
            "record {i} was not on disk when submit returned: {:?}",
            handle.stats()
        );
    }
    let s = handle.stats();
    assert_eq!(
        (s.spill_pending_records, s.dropped_records),
        (301, 0),
        "{s:?}"
    );
    println!("refused broker noticed after {noticed:?}");
    let report = log.shutdown(Duration::from_millis(200)).await;
    assert_eq!(report.left_in_spill, 301, "{report:?}");
}

/// A broker that accepts connections and never answers: no error reaches librdkafka for a
/// minute, so the log notices by the age of the oldest unacknowledged record
/// (`spill_after_ms`), copies everything waiting into the spill and spills from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_noticed_within_spill_after_ms() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            held.push(sock);
        }
    });
    let spill = tempfile::tempdir().unwrap();
    let mut raw = config(addr.to_string(), &prefix(), spill.path());
    raw.create_topics = false;
    raw.message_timeout_ms = 30_000;
    raw.spill_after_ms = 500;
    let cfg = raw.validate().unwrap();
    let (log, handle) = RecordLog::start(cfg).await.unwrap();
    let started = Instant::now();
    for i in 0..50 {
        assert!(
            !spilled_on_submit(&handle, i),
            "spilled before any sign of trouble"
        );
    }
    wait_for("the waiting records in the spill", || {
        handle.stats().spill_pending_records == 50
    })
    .await;
    let noticed = started.elapsed();
    assert!(
        noticed >= Duration::from_millis(500) && noticed < Duration::from_secs(5),
        "noticed after {noticed:?}"
    );
    assert!(handle.stats().broker_unreachable);
    assert!(spilled_on_submit(&handle, 50));
    println!("silent broker noticed after {noticed:?}");
    let report = log.shutdown(Duration::from_millis(200)).await;
    assert_eq!(
        (report.left_in_spill, report.dropped_records),
        (51, 0),
        "{report:?}"
    );
    holder.abort();
}

/// The learner's reader on the episodes topic of `cfg` (10 s broker timeout).
fn assigned(
    cfg: &ValidatedLogConfig,
    group: &str,
    start: &hindsight_feedback::Positions,
) -> TopicReader {
    TopicReader::assigned(
        cfg,
        group,
        &[Topic::Episodes],
        start,
        Duration::from_secs(10),
    )
    .unwrap()
}

/// The assigned reader (the learner's): every partition, starting where the caller's positions
/// say; partitions it names nothing for start at the group's committed offset, else the
/// earliest; it reads at once, with no group rebalance, even right after another reader of the
/// same group went away without leaving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assigned_reader_starts_from_given_positions_then_committed_then_earliest() {
    let spill = tempfile::tempdir().unwrap();
    let mut raw = config(brokers(), &prefix(), spill.path());
    raw.topic_partitions = 2;
    let cfg = raw.validate().unwrap();
    let (log, handle) = RecordLog::start(cfg.clone()).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..40 {
        let id = Uuid::now_v7();
        ids.push(id);
        handle.submit(
            Topic::Episodes,
            format!("episode-{i}"),
            id,
            Bytes::from_static(b"{}"),
        );
    }
    let report = log.shutdown(Duration::from_secs(10)).await;
    assert!(report.complete);
    // Every record, with its partition and offset (the reference).
    let group = format!("g-{}", Uuid::now_v7());
    let all = {
        let r = assigned(&cfg, &group, &Default::default());
        let mut got = Vec::new();
        while got.len() < 40 {
            let rec = r
                .recv_timeout(Duration::from_secs(20))
                .await
                .unwrap()
                .expect("the assigned reader reads every partition from the earliest");
            got.push((rec.partition, rec.offset, rec.id.unwrap()));
        }
        assert!(
            r.recv_timeout(Duration::from_millis(500))
                .await
                .unwrap()
                .is_none(),
            "nothing twice"
        );
        got
    };
    let ids_seen: std::collections::HashSet<Uuid> = all.iter().map(|x| x.2).collect();
    assert_eq!(ids_seen.len(), 40);
    let parts: std::collections::BTreeSet<i32> = all.iter().map(|x| x.0).collect();
    assert_eq!(parts.len(), 2, "records on both partitions: {parts:?}");
    let topic = cfg.topics().get(Topic::Episodes).to_string();
    let count = |p: i32| all.iter().filter(|x| x.0 == p).count() as i64;
    // Commit partition 1 at 2 through an assigned reader of the group (no member is active).
    {
        let r = assigned(&cfg, &group, &Default::default());
        let mut p = hindsight_feedback::Positions::new();
        p.insert((topic.clone(), 1), 2);
        r.commit_offsets(&p).unwrap();
    }
    // Partition 0 from the given position 3, partition 1 from the committed 2.
    let mut start = hindsight_feedback::Positions::new();
    start.insert((topic.clone(), 0), 3);
    let r = assigned(&cfg, &group, &start);
    let want = (count(0) - 3) + (count(1) - 2);
    let mut got = Vec::new();
    while (got.len() as i64) < want {
        let rec = r
            .recv_timeout(Duration::from_secs(20))
            .await
            .unwrap()
            .expect("records after the start positions");
        got.push((rec.partition, rec.offset));
    }
    assert!(r
        .recv_timeout(Duration::from_millis(500))
        .await
        .unwrap()
        .is_none());
    assert!(
        got.iter()
            .all(|(p, o)| (*p == 0 && *o >= 3) || (*p == 1 && *o >= 2)),
        "{got:?}"
    );
}
