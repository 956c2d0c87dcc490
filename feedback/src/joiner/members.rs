//! Which joiner reads which partitions: a membership table in Redis, not Kafka's group
//! protocol.
//!
//! Each joiner heartbeats into a sorted set (`<redis_key_prefix>members`, scored by Redis'
//! own clock, so machines' clocks do not matter) and reads back the members seen within
//! `member_timeout_ms`. Every member sorts that list the same way and takes the partitions
//! whose position in each topic's partition list falls on its own index modulo the member
//! count, from the consumer group's committed offsets. A member that stops heartbeating (a
//! SIGKILL, a partition from Redis) drops out after the timeout and the others take its
//! partitions at their next heartbeat; one that joins takes its share the same way; one that
//! stops cleanly leaves at once.
//!
//! Why not the broker's group protocol: the local broker (tansu 0.6.0) drops a member whose
//! session expired without re-forming the group, so the survivors keep their old assignment and
//! the dead member's partitions are read by nobody (tests/joiners.rs found it). Redis is
//! already the joiner's state, and two members briefly reading one partition — the moment
//! between one taking a partition and the other seeing the new member list — is safe: applying a
//! record is idempotent and every recompute and emission runs under the target's lease
//! (leases.rs), so the overlap costs repeated work, not wrong or duplicated records.

use std::time::Duration;

use redis::aio::ConnectionManager;
use tracing::{info, warn};

use crate::reader::TopicReader;
use crate::redis_conn::LazyRedis;
use crate::FeedbackError;

/// Heartbeats `ARGV[1]` at Redis' clock, forgets members silent for `ARGV[2]` ms, returns
/// the rest.
const BEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local timeout = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - timeout)
redis.call('PEXPIRE', KEYS[1], timeout * 10)
return redis.call('ZRANGE', KEYS[1], 0, -1)
";

/// One joiner's entry in the membership table.
#[derive(Debug, Clone)]
pub(crate) struct Membership {
    key: String,
    me: String,
    timeout: Duration,
}

impl Membership {
    pub(crate) fn new(key: String, me: String, timeout: Duration) -> Membership {
        Membership { key, me, timeout }
    }

    /// How often to heartbeat: five beats per timeout, so one slow beat is not a departure.
    pub(crate) fn interval(&self) -> Duration {
        self.timeout / 5
    }

    /// Heartbeats and returns the live members, sorted.
    pub(crate) async fn beat(
        &self,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<String>, FeedbackError> {
        let mut live: Vec<String> = redis::Script::new(BEAT)
            .key(&self.key)
            .arg(&self.me)
            .arg(self.timeout.as_millis() as u64)
            .invoke_async(conn)
            .await?;
        live.sort();
        Ok(live)
    }

    /// Leaves the table (a clean stop): the others take the partitions at their next beat.
    pub(crate) async fn leave(&self, conn: &mut ConnectionManager) -> Result<(), FeedbackError> {
        let _: () = redis::cmd("ZREM")
            .arg(&self.key)
            .arg(&self.me)
            .query_async(conn)
            .await?;
        Ok(())
    }

    /// This member's share of `topics` (each with its partition ids) among `live` members.
    /// Partition ids at the same position in each topic go to the same member, so a turn's
    /// interaction and feedback records, when keyed alike, meet in one joiner.
    pub(crate) fn share(
        &self,
        live: &[String],
        topics: &[(String, Vec<i32>)],
    ) -> Vec<(String, i32)> {
        share_of(&self.me, live, topics)
    }
}

fn share_of(me: &str, live: &[String], topics: &[(String, Vec<i32>)]) -> Vec<(String, i32)> {
    let Some(index) = live.iter().position(|m| m == me) else {
        // Not in the table (Redis lost it, or it was forgotten): read nothing until the next
        // beat puts it back, rather than everything.
        return vec![];
    };
    let n = live.len();
    topics
        .iter()
        .flat_map(|(topic, ids)| {
            ids.iter()
                .enumerate()
                .filter(move |(pos, _)| pos % n == index)
                .map(move |(_, p)| (topic.clone(), *p))
        })
        .collect()
}

/// Aborts the task when dropped (the joiner's heartbeat ends with the joiner).
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Heartbeats into the membership table on its own connection (a batch waiting on a lease
/// must not look like a dead member) and publishes the live members after each beat.
pub(crate) async fn heartbeat(
    redis: LazyRedis,
    membership: Membership,
    live: tokio::sync::watch::Sender<Option<Vec<String>>>,
) {
    loop {
        let beat = match redis.get().await {
            Ok(mut conn) => membership.beat(&mut conn).await,
            Err(e) => Err(e.into()),
        };
        match beat {
            Ok(members) => {
                metrics::gauge!("hindsight_join_members").set(members.len() as f64);
                live.send_replace(Some(members));
            }
            Err(e) => warn!(error = %e, "Joiner heartbeat failed; keeping its partitions."),
        }
        tokio::time::sleep(membership.interval()).await;
    }
}

/// Re-reads the topics' partition lists and assigns this joiner its share among `members`
/// when that changed; returns what it owns afterwards.
pub(crate) fn take_share(
    reader: &TopicReader,
    membership: &Membership,
    members: &Option<Vec<String>>,
    topic_names: &[String],
    owned: Vec<(String, i32)>,
) -> Vec<(String, i32)> {
    let Some(members) = members else {
        return owned;
    };
    let timeout = Duration::from_secs(5);
    let mut topics = Vec::with_capacity(topic_names.len());
    for name in topic_names {
        match reader.partitions_of(name, timeout) {
            Ok(ids) => topics.push((name.clone(), ids)),
            Err(e) => {
                warn!(error = %e, topic = %name, "Listing partitions failed; keeping the current ones.");
                return owned;
            }
        }
    }
    let want = membership.share(members, &topics);
    if want == owned {
        return owned;
    }
    match reader.assign_partitions(&want, timeout) {
        Ok(()) => {
            info!(
                members = members.len(),
                partitions = want.len(),
                "Joiner partitions changed."
            );
            metrics::gauge!("hindsight_join_partitions").set(want.len() as f64);
            want
        }
        Err(e) => {
            warn!(error = %e, "Assigning partitions failed; retrying at the next heartbeat.");
            owned
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_split_every_partition_once_and_leave_none_out() {
        let topics = vec![
            ("i".to_string(), (0..6).collect::<Vec<i32>>()),
            ("f".to_string(), (0..6).collect::<Vec<i32>>()),
        ];
        for n in 1..=7usize {
            let live: Vec<String> = (0..n).map(|k| format!("m{k}")).collect();
            let mut all: Vec<(String, i32)> = live
                .iter()
                .flat_map(|m| share_of(m, &live, &topics))
                .collect();
            all.sort();
            let mut want: Vec<(String, i32)> = topics
                .iter()
                .flat_map(|(t, ids)| ids.iter().map(move |p| (t.clone(), *p)))
                .collect();
            want.sort();
            assert_eq!(all, want, "{n} members");
        }
        // The same partition number of both topics goes to one member.
        let live = vec!["a".to_string(), "b".to_string(), "c".to_string()];
        assert_eq!(
            share_of("b", &live, &topics),
            vec![
                ("i".to_string(), 1),
                ("i".to_string(), 4),
                ("f".to_string(), 1),
                ("f".to_string(), 4)
            ]
        );
        assert!(share_of("x", &live, &topics).is_empty());
    }
}
