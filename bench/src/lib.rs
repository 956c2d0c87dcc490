//! Benchmarks and the simulated production environment used to measure Hindsight.

pub mod env;
