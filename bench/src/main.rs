//! `hindsight-bench`: benchmark drivers and the simulated production environment.
fn main() {}
