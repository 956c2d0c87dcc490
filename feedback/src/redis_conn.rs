//! A lazily (re)connecting Redis connection: start-up never fails because Redis is away; each
//! use tries to connect with a short timeout and callers turn failure into their own error.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Mutex;

/// Shared lazily connected Redis handle.
pub(crate) struct LazyRedis {
    client: redis::Client,
    conn: Mutex<Option<ConnectionManager>>,
}

impl LazyRedis {
    pub fn new(url: &str) -> redis::RedisResult<LazyRedis> {
        Ok(LazyRedis {
            client: redis::Client::open(url)?,
            conn: Mutex::new(None),
        })
    }

    /// A connection (cheap clone of the manager), connecting first if needed.
    pub async fn get(&self) -> redis::RedisResult<ConnectionManager> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_secs(5))
            .set_number_of_retries(2);
        let c = ConnectionManager::new_with_config(self.client.clone(), cfg).await?;
        *guard = Some(c.clone());
        Ok(c)
    }
}
