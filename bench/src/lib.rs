//! Benchmarks and the simulated production environment used to measure Hindsight.

pub mod env;
pub mod learning;
pub mod load;
pub mod mock_upstream;
pub mod prior_probe;
