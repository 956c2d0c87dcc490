//! Which layout a frozen projection's product should take for a given number of rows: `x @ W^T`
//! (gemm with `W` transposed) against `(W @ x^T)^T` (gemm over `W`'s contiguous rows), on the
//! default model's projection shapes. [`hindsight_model::ops::frozen_linear`] switches between
//! the two by row count and shape; this prints the measurements behind that rule.
//!
//! ```sh
//! cargo run --release -p hindsight-model --example linear_layouts
//! ```
//! Set `RAYON_NUM_THREADS` to the cores the process will have (candle's gemm uses that many).

use std::time::Instant;

use anyhow::Result;
use hindsight_model::candle_core::{Device, Tensor};

/// Median milliseconds of `reps` runs of `f` after one warm-up.
fn median_ms(reps: usize, f: impl Fn() -> Result<Tensor>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[reps / 2])
}

fn main() -> Result<()> {
    hindsight_model::settle_cpu_threads();
    let dev = Device::Cpu;
    // SmolLM2-135M: hidden 576, MLP 1536, 3 key/value heads of 64, vocabulary 49,152.
    let shapes = [
        ("q, o", 576, 576),
        ("k, v", 192, 576),
        ("gate, up", 1536, 576),
        ("down", 576, 1536),
        ("lm head", 49_152, 576),
    ];
    println!("| projection [out, in] | rows | x @ W^T ms | (W @ x^T)^T ms | frozen_linear uses |");
    println!("| --- | ---: | ---: | ---: | --- |");
    for (name, out, inp) in shapes {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
        let reps = if out > 10_000 { 5 } else { 30 };
        for rows in [1usize, 4, 8, 16, 32, 64, 128, 256] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
            let plain = median_ms(reps, || Ok(x.matmul(&w.t()?)?))?;
            let rowwise = median_ms(reps, || Ok(w.matmul(&x.t()?)?.t()?.contiguous()?))?;
            let picked = if hindsight_model::ops::rowwise_layout(rows, out, inp) {
                "(W @ x^T)^T"
            } else {
                "x @ W^T"
            };
            println!("| {name} [{out}, {inp}] | {rows} | {plain:.3} | {rowwise:.3} | {picked} |");
        }
    }
    Ok(())
}
