//! The train_step benchmark, runnable without building the rest of the workspace:
//! `cargo run --release -p hindsight-learner --example train_step`. The source of truth is
//! bench/benches/train_step.rs (`cargo bench -p hindsight-bench --bench train_step`).
include!("../../bench/benches/train_step.rs");
