// The serve_swap benchmark, runnable without building the other bench dependencies:
// `cargo run --release -p hindsight-serve --example serve_swap`.
include!("../../bench/benches/serve_swap.rs");
