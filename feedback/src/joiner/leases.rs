//! Leases that make several joiners safe on one Redis state, whatever the partitioning.
//!
//! Interactions are keyed by episode and feedback by its target, so one turn's interaction and
//! its feedback can sit on partitions that two joiners own. Each joiner applies its records
//! to the shared state (idempotent writes) and then recomputes the turns they touched. Without
//! coordination, joiner A could read a turn before B's feedback lands, B read it after and emit
//! first, and A's older record land last: the stale record would then be the truth for that
//! turn. A batch therefore takes a lease on every target it recomputes or sweeps (`i:<turn>`
//! and `e:<episode>` for a turn, the pending feedback's target for the sweep) before reading
//! them, and holds it until its output is acknowledged by Kafka and marked done. Leases are
//! taken all at once or not at all (one Lua script), so two batches never wait on each other in
//! a cycle; a batch that finds one taken waits and tries again.
//!
//! Why that suffices: every joiner writes its records before it leases, and reads under the
//! lease. Whichever batch leases a target last reads every write that was made before it, and
//! its record is acknowledged after every record of the batches that held the lease before, so
//! the latest record per turn in the (episode-keyed) output partition reflects all applied input.
//!
//! A joiner that dies holding leases blocks those targets until the leases expire (`ttl`), which
//! the caller sets above its longest produce wait; a live joiner never produces after its lease
//! is past that margin ([`Held::may_produce_for`]). The script touches several keys, so Redis
//! Cluster would need them in one hash slot: the joiner supports one Redis (or a primary with
//! replicas), which is what it has always needed for its state.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use tracing::warn;
use uuid::Uuid;

use crate::FeedbackError;

/// Sets every key to the token for `ARGV[2]` ms if none of them exists; else sets nothing and
/// returns the 1-based index of the first key that is held.
const ACQUIRE: &str = r"
for i, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 1 then return i end
end
for _, k in ipairs(KEYS) do
  redis.call('SET', k, ARGV[1], 'PX', ARGV[2])
end
return 0
";

/// Deletes the keys still held by the token; returns how many were.
const RELEASE: &str = r"
local n = 0
for _, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
";

/// Leases held by one batch.
#[derive(Debug)]
pub(crate) struct Held {
    keys: Vec<String>,
    token: String,
    since: Instant,
    ttl: Duration,
}

impl Held {
    /// Whether a produce that may wait up to `wait` still ends inside the lease.
    pub(crate) fn may_produce_for(&self, wait: Duration) -> bool {
        self.keys.is_empty() || self.since.elapsed() + wait < self.ttl
    }
}

/// Takes a lease of `ttl` on every key, waiting while another joiner holds any of them (at
/// most `ttl` plus a little: by then a dead holder's lease has expired).
pub(crate) async fn acquire(
    conn: &mut ConnectionManager,
    keys: BTreeSet<String>,
    ttl: Duration,
) -> Result<Held, FeedbackError> {
    let keys: Vec<String> = keys.into_iter().collect();
    let token = Uuid::now_v7().to_string();
    if keys.is_empty() {
        return Ok(Held {
            keys,
            token,
            since: Instant::now(),
            ttl,
        });
    }
    let script = redis::Script::new(ACQUIRE);
    let started = Instant::now();
    let mut pause = Duration::from_millis(5);
    let mut waited = false;
    loop {
        let since = Instant::now();
        let blocked: usize = script
            .key(&keys)
            .arg(&token)
            .arg(ttl.as_millis() as u64)
            .invoke_async(conn)
            .await?;
        if blocked == 0 {
            if waited {
                metrics::histogram!("hindsight_join_lease_wait_seconds")
                    .record(started.elapsed().as_secs_f64());
            }
            return Ok(Held {
                keys,
                token,
                since,
                ttl,
            });
        }
        waited = true;
        if started.elapsed() > ttl + Duration::from_secs(5) {
            let key = keys.get(blocked - 1).cloned().unwrap_or_default();
            return Err(FeedbackError::Busy(format!(
                "lease `{key}` held by another joiner for longer than its {} ms lifetime",
                ttl.as_millis()
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Gives the leases back. A lease that expired before this (the batch outlived it) is counted
/// and logged: another joiner may have read the same target meanwhile.
pub(crate) async fn release(conn: &mut ConnectionManager, held: Held) -> Result<(), FeedbackError> {
    if held.keys.is_empty() {
        return Ok(());
    }
    let n: usize = redis::Script::new(RELEASE)
        .key(&held.keys)
        .arg(&held.token)
        .invoke_async(conn)
        .await?;
    if n < held.keys.len() {
        let lost = held.keys.len() - n;
        metrics::counter!("hindsight_join_leases_expired_total").increment(lost as u64);
        warn!(
            lost,
            held_ms = held.since.elapsed().as_millis() as u64,
            "Joiner leases expired before the batch finished."
        );
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    //! Against the real Redis (`REDIS_URL`, else 127.0.0.1:6379), each test on its own keys.
    use super::*;

    async fn conn() -> ConnectionManager {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let client = redis::Client::open(url.as_str()).unwrap();
        ConnectionManager::new(client).await.unwrap()
    }

    fn keys(tag: &str, names: &[&str]) -> BTreeSet<String> {
        names
            .iter()
            .map(|n| format!("test-lease:{tag}:{n}"))
            .collect()
    }

    #[tokio::test]
    async fn an_overlapping_batch_waits_until_the_holder_releases() {
        let tag = Uuid::now_v7().simple().to_string();
        let mut c = conn().await;
        let ttl = Duration::from_secs(30);
        let first = acquire(&mut c, keys(&tag, &["a", "b"]), ttl).await.unwrap();

        // Shares `b` only: must not get in while `first` holds it.
        let mut c2 = conn().await;
        let k2 = keys(&tag, &["b", "c"]);
        let waiter = tokio::spawn(async move { acquire(&mut c2, k2, ttl).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "took a lease another batch holds");
        // All or nothing: the waiter set none of its keys, so `c` is still free.
        let disjoint = acquire(&mut c, keys(&tag, &["c2"]), ttl).await.unwrap();
        let exists: bool = redis::cmd("EXISTS")
            .arg(format!("test-lease:{tag}:c"))
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(!exists, "a blocked acquire left one of its keys set");

        release(&mut c, first).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter gets the lease once it is released")
            .unwrap()
            .unwrap();
        release(&mut c, disjoint).await.unwrap();
    }

    #[tokio::test]
    async fn a_dead_holders_lease_expires_and_its_late_release_frees_nothing() {
        let tag = Uuid::now_v7().simple().to_string();
        let mut c = conn().await;
        let short = Duration::from_millis(300);
        // The holder "dies": it never releases in time.
        let dead = acquire(&mut c, keys(&tag, &["t"]), short).await.unwrap();
        assert!(dead.may_produce_for(Duration::from_millis(100)));
        assert!(
            !dead.may_produce_for(short),
            "a produce as long as the lease may outlive it"
        );

        let started = Instant::now();
        let next = acquire(&mut c, keys(&tag, &["t"]), Duration::from_secs(30))
            .await
            .unwrap();
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(150),
            "did not wait: {waited:?}"
        );
        assert!(
            waited < Duration::from_secs(5),
            "waited {waited:?} for a 300 ms lease"
        );

        // The old holder's release must not free the new holder's lease.
        release(&mut c, dead).await.unwrap();
        let token: Option<String> = redis::cmd("GET")
            .arg(format!("test-lease:{tag}:t"))
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(token.as_deref(), Some(next.token.as_str()));
        release(&mut c, next).await.unwrap();
    }
}
