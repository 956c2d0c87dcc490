//! Frozen weights kept in their GGUF blocks (Q4_1, Q8_0) for the inference paths, multiplied
//! by f32 activations as they are.
//!
//! Decoding on a CPU reads every weight once per step, so its speed is the bytes read: 540 MB a
//! token for the default model in f32, 96 MB in its GGUF's own blocks (Q4_1 projections, a Q8_0
//! embedding that is also the LM head). candle's quantized matmul also quantizes the
//! *activations* to 8 bits, which moved greedy answers (model/README.md); this kernel keeps them
//! in f32 and dequantizes each weight exactly as the loader does (`d * q + m`), so its products
//! equal the f32 model's up to the order of the additions. The training paths never use it:
//! callers take it only for inputs that track no gradient.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// Elements per block in both formats.
const BLOCK: usize = 32;

/// Block products (weight blocks x input rows) below which a product stays on the calling
/// thread: waking the pool costs more (`linear_layouts` example, k/v projections at one row).
const SERIAL_BLOCKS: usize = 8_192;

/// How the blocks of a [`QuantWeight`] are laid out (ggml's `block_q4_1` and `block_q8_0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 20 bytes: scale `d` and minimum `m` (f16), then 16 bytes whose low nibbles are elements
    /// 0..16 and high nibbles elements 16..32; element = `d * q + m`.
    Q4_1,
    /// 34 bytes: scale `d` (f16), then 32 signed bytes; element = `d * q`.
    Q8_0,
}

impl QuantKind {
    fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_1 => 20,
            QuantKind::Q8_0 => 34,
        }
    }
}

/// A matrix `[rows, cols]` (a projection's `[out, in]`) in quantized blocks, row by row.
/// Clones share the blocks (models are cloned per adapter set).
#[derive(Debug, Clone)]
pub struct QuantWeight {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    data: Arc<[u8]>,
}

impl QuantWeight {
    /// The blocks of a 2-D GGUF tensor, or `None` for a format this kernel does not read
    /// (f32, f16, the k-quants) or a row that does not split into whole blocks.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let kind = match q.dtype() {
            GgmlDType::Q4_1 => QuantKind::Q4_1,
            GgmlDType::Q8_0 => QuantKind::Q8_0,
            _ => return Ok(None),
        };
        let (rows, cols) = match q.shape().dims() {
            [r, c] => (*r, *c),
            _ => return Ok(None),
        };
        if cols % BLOCK != 0 {
            return Ok(None);
        }
        let data = q.data()?.into_owned();
        if data.len() != rows * (cols / BLOCK) * kind.block_bytes() {
            return Err(ModelError::InvalidModel(format!(
                "a {kind:?} tensor of shape [{rows}, {cols}] holds {} bytes",
                data.len()
            )));
        }
        Ok(Some(Self {
            kind,
            rows,
            cols,
            data: data.into(),
        }))
    }

    /// `w` quantized to `dtype` (candle's quantizer), or `None` as for [`Self::from_qtensor`].
    pub fn quantize(w: &Tensor, dtype: GgmlDType) -> Result<Option<Self>> {
        if w.rank() != 2 || w.dim(1)? % dtype.block_size() != 0 {
            return Ok(None);
        }
        let q = QTensor::quantize(&w.to_dtype(DType::F32)?.to_device(&Device::Cpu)?, dtype)?;
        Self::from_qtensor(&q)
    }

    /// The block format.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.kind.block_bytes()
    }

    /// The same matrix with its rows reordered: row `i` of the result is row `order[i]`.
    pub fn rows_in_order(&self, order: &[usize]) -> Result<Self> {
        if order.len() != self.rows || order.iter().any(|&i| i >= self.rows) {
            return Err(ModelError::InvalidModel(format!(
                "a row order of {} entries for a matrix of {} rows",
                order.len(),
                self.rows
            )));
        }
        let rb = self.row_bytes();
        let mut data = Vec::with_capacity(self.data.len());
        for &i in order {
            data.extend_from_slice(&self.data[i * rb..(i + 1) * rb]);
        }
        Ok(Self {
            data: data.into(),
            ..*self
        })
    }

    /// The f32 matrix (for tests and checks): what the loader's dequantization gives.
    pub fn dequantize(&self) -> Result<Tensor> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols).enumerate() {
            let bytes = &self.data[r * self.row_bytes()..(r + 1) * self.row_bytes()];
            for (blk, vals) in bytes
                .chunks(self.kind.block_bytes())
                .zip(row.chunks_mut(BLOCK))
            {
                dequantize_block(self.kind, blk, vals);
            }
        }
        Ok(Tensor::from_vec(out, (self.rows, self.cols), &Device::Cpu)?)
    }

    /// `x @ self^T` for `x` of shape `[n, cols]` (f32, CPU): `[n, rows]`. Work is split over
    /// output rows on the CPU pool; each block is unpacked once for all `n` input rows.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let (n, cols) = x.dims2()?;
        if cols != self.cols {
            return Err(ModelError::InvalidModel(format!(
                "x has {cols} columns, the quantized weight {}",
                self.cols
            )));
        }
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let blocks = self.cols / BLOCK;
        // Each input row's block sums (Q4_1's minimum multiplies them).
        let sums: Vec<f32> = xs.chunks(BLOCK).map(|c| c.iter().sum()).collect();
        let mut out_t = vec![0f32; self.rows * n];
        let rb = self.row_bytes();
        // One chunk of output rows per thread (each task costs a wake-up, most of a one-row
        // product's time for the smaller projections); a product below `SERIAL_BLOCKS` (k and v
        // for one row: ~3,500 blocks, ~10 µs) runs on the calling thread.
        let threads = if self.rows * blocks * n < SERIAL_BLOCKS {
            1
        } else {
            rayon::current_num_threads().max(1)
        };
        let per_task = self.rows.div_ceil(threads).max(1);
        let task = |(task, out): (usize, &mut [f32])| {
            let first = task * per_task;
            for (i, y) in out.chunks_mut(n).enumerate() {
                let r = first + i;
                let row = &self.data[r * rb..(r + 1) * rb];
                dot_rows(self.kind, row, blocks, &xs, &sums, y);
            }
        };
        if threads == 1 {
            task((0, &mut out_t));
        } else {
            out_t
                .par_chunks_mut(per_task * n)
                .enumerate()
                .for_each(task);
        }
        // `[rows, n]` → `[n, rows]`.
        let mut out = vec![0f32; n * self.rows];
        for (r, ys) in out_t.chunks(n).enumerate() {
            for (k, y) in ys.iter().enumerate() {
                out[k * self.rows + r] = *y;
            }
        }
        Ok(Tensor::from_vec(out, (n, self.rows), x.device())?)
    }
}

// Where the model's inference paths take the blocks.

/// Input rows up to which the quantized kernel beats the f32 product (decode steps; a
/// prompt's prefill multiplies hundreds of rows, where gemm's f32 kernels are faster). Measured
/// with `cargo run --release -p hindsight-model --example linear_layouts`.
pub(crate) const QUANT_MAX_ROWS: usize = 16;

/// Whether `x` (`[..., in]`) may take the quantized kernel: a CPU tensor that tracks no
/// gradient (the kernel has no backward) with at most [`QUANT_MAX_ROWS`] rows.
pub(crate) fn quantized_rows(x: &Tensor) -> bool {
    let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
    !x.track_op() && x.device().is_cpu() && rows <= QUANT_MAX_ROWS
}

/// `x @ q^T` for `x` of shape `[..., in]`, in `x`'s dtype.
pub(crate) fn quantized_product(q: &QuantWeight, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let inp = dims.last().copied().unwrap_or(1);
    let y = q.matmul_t(&x.reshape(((), inp))?)?;
    let mut out = dims.to_vec();
    if let Some(last) = out.last_mut() {
        *last = q.dims().0;
    }
    Ok(y.reshape(out)?.to_dtype(x.dtype())?)
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One block's 32 values, as the loader's dequantization computes them.
fn dequantize_block(kind: QuantKind, blk: &[u8], out: &mut [f32]) {
    match kind {
        QuantKind::Q4_1 => {
            let (d, m) = (half_at(blk, 0), half_at(blk, 2));
            for j in 0..16 {
                out[j] = f32::from(blk[4 + j] & 0x0f) * d + m;
                out[j + 16] = f32::from(blk[4 + j] >> 4) * d + m;
            }
        }
        QuantKind::Q8_0 => {
            let d = half_at(blk, 0);
            for j in 0..BLOCK {
                out[j] = f32::from(blk[2 + j] as i8) * d;
            }
        }
    }
}

/// `y[k] = dot(weight row, x row k)` for every input row `k` (`x` is `[n, blocks * 32]`,
/// `sums` its per-block sums).
fn dot_rows(kind: QuantKind, row: &[u8], blocks: usize, x: &[f32], sums: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); the slices' lengths are what
            // the kernel reads (`row`: `blocks` blocks, `x`: `y.len()` rows of `blocks * 32`).
            unsafe { avx2::dot_rows(kind, row, blocks, x, sums, y) };
            return;
        }
    }
    dot_rows_scalar(kind, row, blocks, x, sums, y);
}

/// The portable kernel (and the reference the SIMD one is tested against).
fn dot_rows_scalar(
    kind: QuantKind,
    row: &[u8],
    blocks: usize,
    x: &[f32],
    sums: &[f32],
    y: &mut [f32],
) {
    let bb = kind.block_bytes();
    let cols = blocks * BLOCK;
    y.fill(0.0);
    let mut q = [0f32; BLOCK];
    for b in 0..blocks {
        let blk = &row[b * bb..(b + 1) * bb];
        let (d, m) = match kind {
            QuantKind::Q4_1 => {
                for j in 0..16 {
                    q[j] = f32::from(blk[4 + j] & 0x0f);
                    q[j + 16] = f32::from(blk[4 + j] >> 4);
                }
                (half_at(blk, 0), half_at(blk, 2))
            }
            QuantKind::Q8_0 => {
                for j in 0..BLOCK {
                    q[j] = f32::from(blk[2 + j] as i8);
                }
                (half_at(blk, 0), 0.0)
            }
        };
        for (k, yk) in y.iter_mut().enumerate() {
            let xb = &x[k * cols + b * BLOCK..k * cols + (b + 1) * BLOCK];
            let s: f32 = q.iter().zip(xb).map(|(a, b)| a * b).sum();
            *yk += d * s + m * sums[k * blocks + b];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{QuantKind, BLOCK};

    /// Horizontal sum of 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The low 8 bytes of `v`, unsigned, as 8 f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn u8x8(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    }

    /// One block at `blk`: its 32 weights (without scale) as 4 x 8 f32, its scale `d`
    /// broadcast, and its minimum `m` (0 for Q8_0).
    ///
    /// Safety: `blk` points to one whole block of `kind`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(kind: QuantKind, blk: *const u8) -> ([__m256; 4], __m256, f32) {
        // SAFETY: the caller's contract: the block's bytes are readable.
        unsafe {
            // The block starts with f16 `d` (and `m` for Q4_1): both converted at once.
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
            let d = _mm256_broadcastss_ps(dm);
            match kind {
                QuantKind::Q4_1 => {
                    let qs = _mm_loadu_si128(blk.add(4) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
                    let q = [
                        u8x8(lo),
                        u8x8(_mm_srli_si128::<8>(lo)),
                        u8x8(hi),
                        u8x8(_mm_srli_si128::<8>(hi)),
                    ];
                    (q, d, _mm_cvtss_f32(_mm_movehdup_ps(dm)))
                }
                QuantKind::Q8_0 => {
                    let i8x8 = |at: usize| {
                        let v = _mm_loadl_epi64(blk.add(at) as *const __m128i);
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
                    };
                    ([i8x8(2), i8x8(10), i8x8(18), i8x8(26)], d, 0.0)
                }
            }
        }
    }

    /// [`super::dot_rows_scalar`] with AVX2, FMA and F16C. Safety: the CPU has all three;
    /// `row` holds `blocks` blocks of `kind`; `x` holds `y.len()` rows of `blocks * 32` values
    /// and `sums` `y.len() * blocks`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows(
        kind: QuantKind,
        row: &[u8],
        blocks: usize,
        x: &[f32],
        sums: &[f32],
        y: &mut [f32],
    ) {
        let n = y.len();
        let cols = blocks * BLOCK;
        debug_assert!(
            row.len() >= blocks * kind.block_bytes()
                && x.len() >= n * cols
                && sums.len() >= n * blocks
        );
        // Input rows in groups of 4 whose accumulators stay in registers; each block is
        // unpacked once per group.
        let mut k = 0;
        // SAFETY: the caller's contract; each group reads rows `k..k + R` of `x` and `sums`.
        unsafe {
            let (xp, sp) = (x.as_ptr(), sums.as_ptr());
            while k + 4 <= n {
                let g = group::<4>(
                    kind,
                    row.as_ptr(),
                    blocks,
                    xp.add(k * cols),
                    sp.add(k * blocks),
                );
                y[k..k + 4].copy_from_slice(&g);
                k += 4;
            }
            let (xp, sp) = (xp.add(k * cols), sp.add(k * blocks));
            match n - k {
                3 => y[k..].copy_from_slice(&group::<3>(kind, row.as_ptr(), blocks, xp, sp)),
                2 => y[k..].copy_from_slice(&group::<2>(kind, row.as_ptr(), blocks, xp, sp)),
                1 => y[k..].copy_from_slice(&group::<1>(kind, row.as_ptr(), blocks, xp, sp)),
                _ => {}
            }
        }
    }

    /// The dot products of one weight row (`blocks` blocks at `row`) with `R` input rows of
    /// `blocks * 32` values at `x` (block sums at `sums`). Safety: all of it is readable.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const R: usize>(
        kind: QuantKind,
        row: *const u8,
        blocks: usize,
        x: *const f32,
        sums: *const f32,
    ) -> [f32; R] {
        let bb = kind.block_bytes();
        let cols = blocks * BLOCK;
        let mut acc = [_mm256_setzero_ps(); R];
        let mut rest = [0f32; R];
        // SAFETY: the caller's contract.
        unsafe {
            for b in 0..blocks {
                let (q, d, m) = block(kind, row.add(b * bb));
                for i in 0..R {
                    let xp = x.add(i * cols + b * BLOCK);
                    let s0 = _mm256_fmadd_ps(
                        q[1],
                        _mm256_loadu_ps(xp.add(8)),
                        _mm256_mul_ps(q[0], _mm256_loadu_ps(xp)),
                    );
                    let s1 = _mm256_fmadd_ps(
                        q[3],
                        _mm256_loadu_ps(xp.add(24)),
                        _mm256_mul_ps(q[2], _mm256_loadu_ps(xp.add(16))),
                    );
                    acc[i] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), d, acc[i]);
                    rest[i] += m * *sums.add(i * blocks + b);
                }
            }
        }
        let mut out = [0f32; R];
        for i in 0..R {
            out[i] = hsum(acc[i]) + rest[i];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    /// Random blocks of `kind` (finite scales), `[rows, cols]`.
    fn random_weight(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> QuantWeight {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let bb = kind.block_bytes();
        let mut data = vec![0u8; rows * cols / BLOCK * bb];
        for blk in data.chunks_mut(bb) {
            let d = f16::from_f32((next() % 1000) as f32 / 20_000.0 + 1e-4);
            blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
            let start = match kind {
                QuantKind::Q4_1 => {
                    let m = f16::from_f32(-((next() % 1000) as f32) / 5_000.0);
                    blk[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
                    4
                }
                QuantKind::Q8_0 => 2,
            };
            for b in &mut blk[start..] {
                *b = next() as u8;
            }
        }
        QuantWeight {
            kind,
            rows,
            cols,
            data: data.into(),
        }
    }

    fn check(kind: QuantKind, rows: usize, cols: usize, n: usize, seed: u64) {
        let w = random_weight(kind, rows, cols, seed);
        let x = Tensor::randn(0f32, 1.0, (n, cols), &Device::Cpu).unwrap();
        let got = w.matmul_t(&x).unwrap();
        let want = x.matmul(&w.dequantize().unwrap().t().unwrap()).unwrap();
        assert_eq!(got.dims(), &[n, rows]);
        let scale = crate::testing::max_abs_diff(&want, &want.zeros_like().unwrap()).unwrap();
        let err = crate::testing::max_abs_diff(&got, &want).unwrap();
        assert!(
            err <= 1e-5 * scale.max(1.0),
            "{kind:?} [{rows}, {cols}] x {n}: {err} (scale {scale})"
        );
        // The portable kernel agrees with the dispatched one.
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let sums: Vec<f32> = xs.chunks(BLOCK).map(|c| c.iter().sum()).collect();
        let got = got.to_vec2::<f32>().unwrap();
        for (r, row) in w.data.chunks(w.row_bytes()).enumerate() {
            let mut y = vec![0f32; n];
            dot_rows_scalar(kind, row, cols / BLOCK, &xs, &sums, &mut y);
            for (yk, gk) in y.iter().zip(&got) {
                assert!((yk - gk[r]).abs() <= 1e-5 * scale.max(1.0));
            }
        }
    }

    /// Both formats, one and several input rows (more than the SIMD kernel's 16 accumulators),
    /// against the f32 product of the dequantized matrix.
    #[test]
    fn the_quantized_product_equals_the_dequantized_one() {
        for kind in [QuantKind::Q4_1, QuantKind::Q8_0] {
            for n in [1, 3, 16, 17, 40] {
                check(kind, 37, 96, n, n as u64);
            }
            check(kind, 300, 64, 2, 7);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn any_shape_agrees(rows in 1usize..80, blocks in 1usize..6, n in 1usize..20, seed: u64,
                            q4 in any::<bool>()) {
            let kind = if q4 { QuantKind::Q4_1 } else { QuantKind::Q8_0 };
            check(kind, rows, blocks * BLOCK, n, seed);
        }
    }

    /// candle's quantizer round-trips through these blocks: `dequantize` equals candle's.
    #[test]
    fn blocks_read_from_candle_dequantize_as_candle_does() {
        let w = Tensor::randn(0f32, 1.0, (24, 64), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let ours = QuantWeight::from_qtensor(&q).unwrap().unwrap();
            let theirs = q.dequantize(&Device::Cpu).unwrap();
            assert_eq!(
                ours.dequantize().unwrap().to_vec2::<f32>().unwrap(),
                theirs.to_vec2::<f32>().unwrap()
            );
            let order: Vec<usize> = (0..24).rev().collect();
            let rev = ours.rows_in_order(&order).unwrap().dequantize().unwrap();
            assert_eq!(
                rev.get(0).unwrap().to_vec1::<f32>().unwrap(),
                theirs.get(23).unwrap().to_vec1::<f32>().unwrap()
            );
        }
        assert!(
            QuantWeight::from_qtensor(&QTensor::quantize(&w, GgmlDType::F32).unwrap())
                .unwrap()
                .is_none()
        );
    }
}
