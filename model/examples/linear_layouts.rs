//! Which layout a frozen projection's product should take for a given number of rows: `x @ W^T`
//! (gemm with `W` transposed) against `(W @ x^T)^T` (gemm over `W`'s contiguous rows), on the
//! default model's projection shapes, and against the product on the GGUF's own blocks (Q4_1
//! projections, a Q8_0 head: [`hindsight_model::QuantWeight`]). [`hindsight_model::ops::frozen_linear`]
//! switches between the two f32 layouts by row count and shape, and the inference paths take
//! the blocks up to `QUANT_MAX_ROWS` rows; this prints the measurements behind both rules.
//!
//! ```sh
//! cargo run --release -p hindsight-model --example linear_layouts
//! ```
//! Set `RAYON_NUM_THREADS` to the cores the process will have (candle's gemm uses that many).

use std::time::Instant;

use anyhow::Result;
use hindsight_model::candle_core::quantized::GgmlDType;
use hindsight_model::candle_core::{Device, Tensor};
use hindsight_model::QuantWeight;

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
        ("q, o", 576, 576, GgmlDType::Q4_1),
        ("k, v", 192, 576, GgmlDType::Q4_1),
        ("gate, up", 1536, 576, GgmlDType::Q4_1),
        ("down", 576, 1536, GgmlDType::Q4_1),
        ("lm head", 49_152, 576, GgmlDType::Q8_0),
    ];
    println!(
        "| projection [out, in] | rows | x @ W^T ms | (W @ x^T)^T ms | frozen_linear uses | blocks ms |"
    );
    println!("| --- | ---: | ---: | ---: | --- | ---: |");
    for (name, out, inp, dtype) in shapes {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
        let q = QuantWeight::quantize(&w, dtype)?
            .ok_or_else(|| anyhow::anyhow!("{name}: not quantizable"))?;
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
            let blocks = median_ms(reps, || Ok(q.matmul_t(&x)?))?;
            println!(
                "| {name} [{out}, {inp}] | {rows} | {plain:.3} | {rowwise:.3} | {picked} | {blocks:.3} ({dtype:?}) |"
            );
        }
    }
    Ok(())
}
