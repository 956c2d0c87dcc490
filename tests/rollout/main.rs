//! Canary rollouts end to end on real parts: `hindsight proxy` processes, a real Redis (a
//! private `redis-server` per test, so it can be SIGKILLed without disturbing other tests), the
//! real Kafka-protocol broker for the interaction log, and a mock upstream (outside the system)
//! whose two versions behave differently.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod controller;
mod routing;
#[path = "../support/mod.rs"]
mod support;
mod vllm;
