//! Canary rollouts of adapter versions: the operations on a route ([`ops`]), the online
//! metrics per arm ([`metrics`]), the anytime-valid statistics ([`stats`]), the controller
//! that decides with them ([`controller`]) and its admin API with the operator's page
//! ([`admin`]; the page's learning curves come from [`learning`], its live feedback from
//! [`recent`]). The routing table itself (types, Redis store, assignment) is the
//! `hindsight-routing` crate, which the proxy shares without pulling in the rest of the
//! control plane.

pub mod admin;
pub mod commands;
pub mod config;
pub mod controller;
pub mod learning;
pub mod lineage;
pub mod metrics;
pub mod ops;
pub mod queue;
pub mod recent;
pub mod stats;

pub use config::{CandidatePolicy, DriftPolicy, RolloutConfig, RolloutFile};
pub use controller::{decide, Controller, Decision, StageBase};
pub use ops::{execute, Op, Request};
pub use recent::RecentFeedback;
