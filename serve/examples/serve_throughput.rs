// The serve_throughput benchmark, runnable without building the other bench dependencies:
// `cargo run --release -p hindsight-serve --example serve_throughput`.
include!("../../bench/benches/serve_throughput.rs");
