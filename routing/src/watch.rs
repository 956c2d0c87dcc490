//! The task every proxy runs to hold the routing table in memory.
//!
//! It subscribes to the change channel, loads the whole table, then applies each published
//! change by re-reading that route (a few milliseconds end to end), and re-reads the whole
//! table every `resync` in case a message was missed. When Redis goes away it keeps the last
//! table it had — requests never see an error from this — sets `hindsight_routing_table_stale`
//! to 1, logs once, and reconnects with backoff; on reconnect it reloads everything. A proxy
//! that starts while Redis is away serves its configured fallback routes (the stable versions
//! in its own config) until Redis answers. A malformed or invalid entry is counted, logged and
//! ignored: the proxy keeps that route's last good version.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util_free::Cancel;

use crate::store::{parse_route, StoreConfig};
use crate::table::{Route, RoutingTable};
use crate::RoutingError;

/// Each Redis call of the watcher gives up after this long (a hung Redis counts as away).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The proxy's view of the table: a snapshot read is a lock-free-in-practice `Arc` clone.
#[derive(Clone)]
pub struct TableHandle {
    table: Arc<RwLock<Arc<RoutingTable>>>,
    stale: Arc<AtomicBool>,
}

impl TableHandle {
    /// A handle holding `table` (fresh).
    pub fn new(table: RoutingTable) -> Self {
        Self {
            table: Arc::new(RwLock::new(Arc::new(table))),
            stale: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The current table.
    pub fn snapshot(&self) -> Arc<RoutingTable> {
        match self.table.read() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Whether the table may be out of date (Redis unreachable since the last load).
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    fn replace(&self, table: RoutingTable) {
        let table = Arc::new(table);
        match self.table.write() {
            Ok(mut t) => *t = table,
            Err(poisoned) => *poisoned.into_inner() = table,
        }
    }

    fn set_stale(&self, stale: bool) {
        let was = self.stale.swap(stale, Ordering::Relaxed);
        metrics::gauge!("hindsight_routing_table_stale").set(if stale { 1.0 } else { 0.0 });
        if stale && !was {
            tracing::warn!(
                "Routing table: Redis unreachable; serving the last table held until it returns."
            );
        } else if !stale && was {
            tracing::info!("Routing table: Redis is back; table reloaded.");
        }
    }
}

mod tokio_util_free {
    //! A tiny cancellation flag so this crate needs no tokio-util.
    use std::sync::Arc;
    use tokio::sync::watch;

    /// Cancels the watcher when dropped or when `cancel` is called.
    #[derive(Clone)]
    pub struct Cancel(pub(crate) Arc<watch::Sender<bool>>);

    impl Cancel {
        /// Stops the watcher.
        pub fn cancel(&self) {
            let _ = self.0.send(true);
        }
    }
}

/// The running watcher: its table handle, a way to stop it, and its task.
pub struct Watcher {
    /// The table it maintains.
    pub handle: TableHandle,
    /// Stops the task.
    pub cancel: Cancel,
    /// The task.
    pub task: JoinHandle<()>,
}

/// Starts the watcher for `cfg` with `fallback` routes (from the proxy's own config; any
/// route stored in Redis replaces its fallback).
pub fn spawn_watcher(
    cfg: StoreConfig,
    fallback: Vec<Route>,
    resync: Duration,
) -> Result<Watcher, RoutingError> {
    let client = redis::Client::open(cfg.redis_url.as_str())?;
    let handle = TableHandle::new(RoutingTable::new(fallback.clone()));
    // Until the first load, the table is the fallback: stale by definition.
    handle.stale.store(true, Ordering::Relaxed);
    metrics::gauge!("hindsight_routing_table_stale").set(1.0);
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let task_handle = handle.clone();
    let task = tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            let session = session(&client, &cfg, &fallback, &task_handle, resync, &mut rx);
            match session.await {
                Ok(()) => return, // cancelled
                Err(e) => {
                    task_handle.set_stale(true);
                    tracing::debug!(error = %e, "Routing watcher session ended.");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = rx.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    });
    Ok(Watcher {
        handle,
        cancel: Cancel(Arc::new(tx)),
        task,
    })
}

async fn timed<T>(
    fut: impl std::future::Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, RoutingError> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(RoutingError::Redis(redis::RedisError::from(
            std::io::Error::new(std::io::ErrorKind::TimedOut, "redis call timed out"),
        ))),
    }
}

/// One connected session: subscribe, load, then apply changes until Redis goes away (Err) or
/// the watcher is cancelled (Ok).
async fn session(
    client: &redis::Client,
    cfg: &StoreConfig,
    fallback: &[Route],
    handle: &TableHandle,
    resync: Duration,
    cancel: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<(), RoutingError> {
    let mut pubsub = timed(client.get_async_pubsub()).await?;
    timed(pubsub.subscribe(cfg.channel())).await?;
    let mut conn = timed(client.get_multiplexed_async_connection()).await?;
    // Subscribed before loading, so no change can fall between the two.
    reload_all(&mut conn, cfg, fallback, handle).await?;
    handle.set_stale(false);
    let mut messages = pubsub.on_message();
    let mut tick = tokio::time::interval(resync);
    tick.tick().await;
    loop {
        tokio::select! {
            msg = messages.next() => {
                let Some(msg) = msg else {
                    return Err(RoutingError::Redis(redis::RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "change channel closed",
                    ))));
                };
                let route: String = msg.get_payload().unwrap_or_default();
                reload_one(&mut conn, cfg, fallback, handle, &route).await?;
            }
            _ = tick.tick() => reload_all(&mut conn, cfg, fallback, handle).await?,
            _ = cancel.changed() => return Ok(()),
        }
    }
}

/// Applies one parsed entry to the routes map, keeping the last good route when it is bad.
fn apply(
    routes: &mut Vec<Route>,
    name: &str,
    parsed: Result<Route, RoutingError>,
    current: &RoutingTable,
) {
    match parsed {
        Ok(r) => {
            // Never go back in generations (a reload racing a newer change).
            let older = current
                .get(name)
                .is_some_and(|c| c.generation > r.generation);
            routes.retain(|x| x.route != name);
            match (older, current.get(name)) {
                (true, Some(c)) => routes.push((**c).clone()),
                _ => routes.push(r),
            }
        }
        Err(e) => {
            metrics::counter!("hindsight_routing_invalid_entries_total").increment(1);
            tracing::warn!(route = name, error = %e, "Routing table: ignoring a malformed entry; keeping the last good route.");
        }
    }
}

async fn reload_all(
    conn: &mut redis::aio::MultiplexedConnection,
    cfg: &StoreConfig,
    fallback: &[Route],
    handle: &TableHandle,
) -> Result<(), RoutingError> {
    let raw: Vec<(String, String)> =
        timed(redis::cmd("HGETALL").arg(cfg.table_key()).query_async(conn)).await?;
    let current = handle.snapshot();
    // Start from the fallback and the last good routes, then apply what Redis holds.
    let mut routes: Vec<Route> = fallback.to_vec();
    for r in current.routes() {
        routes.retain(|x| x.route != r.route);
        routes.push((**r).clone());
    }
    for (name, json) in raw {
        let parsed = parse_route(&name, &json);
        apply(&mut routes, &name, parsed, &current);
    }
    handle.replace(RoutingTable::new(routes));
    metrics::counter!("hindsight_routing_reloads_total").increment(1);
    Ok(())
}

async fn reload_one(
    conn: &mut redis::aio::MultiplexedConnection,
    cfg: &StoreConfig,
    fallback: &[Route],
    handle: &TableHandle,
    name: &str,
) -> Result<(), RoutingError> {
    let raw: Option<String> = timed(
        redis::cmd("HGET")
            .arg(cfg.table_key())
            .arg(name)
            .query_async(conn),
    )
    .await?;
    let Some(json) = raw else {
        return reload_all(conn, cfg, fallback, handle).await;
    };
    let current = handle.snapshot();
    let mut routes: Vec<Route> = current.routes().map(|r| (**r).clone()).collect();
    apply(&mut routes, name, parse_route(name, &json), &current);
    handle.replace(RoutingTable::new(routes));
    Ok(())
}
