//! Benchmark drivers: the learning-curve harness over the simulated environment (`hindsight-sim`),
//! the hindsight baselines, an open-loop load generator and the mock upstream the proxy benches
//! run against.

pub mod baselines;
pub mod child;
pub mod knobs;
pub mod learning;
pub mod load;
pub mod mock_upstream;
pub mod prior_probe;
pub mod procfs;
