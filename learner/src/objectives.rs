//! The learning objectives, each a pure function of tensors so it can be tested on its own
//! (values against direct formulas, gradients against finite differences).
//!
//! Every function takes the student's quantities as tracked tensors (gradients flow into the
//! LoRA weights through them) and the teacher's, the base model's and the logged behaviour's as
//! plain data. Losses are returned per token (`[n]`) or per sequence (scalar) so the trainer
//! decides how to weight and average them. Only ops with a backward pass are used (no
//! `candle_nn::ops::softmax_last_dim`, no `sigmoid` fast path): see model/README.md.

use candle_core::{DType, Tensor, D};
use serde::{Deserialize, Serialize};

use crate::error::{LearnerError, Result};

/// Divergence between the teacher's and the student's next-token distributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Divergence {
    /// KL(teacher ‖ student): mass-covering; the student raises every token the teacher likes.
    /// The default: it beat reverse KL on the simulated tickets (docs/experiments/).
    #[default]
    ForwardKl,
    /// KL(student ‖ teacher): mode-seeking, as in on-policy distillation.
    ReverseKl,
    /// Jensen–Shannon: symmetric and bounded by ln 2 per token.
    Jsd,
}

/// Log-softmax over the last dimension with differentiable ops (the max is a constant shift).
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Log-probability of `tokens` (`[n]` u32) under `logits` (`[n, V]`): `[n]`, differentiable.
pub fn token_logprobs(logits: &Tensor, tokens: &Tensor) -> Result<Tensor> {
    let lp = log_softmax(logits)?;
    Ok(lp.gather(&tokens.unsqueeze(1)?, 1)?.squeeze(1)?)
}

/// Which tokens one position's probability is normalised over.
#[derive(Debug, Clone, PartialEq)]
pub enum Support {
    /// The whole vocabulary.
    Vocab,
    /// These tokens (the logged one first): the tokens a grammar allowed, or a nucleus.
    Among(Vec<u32>),
}

/// `[n]` log-probabilities of `tokens` under `softmax(logits / temperature)` restricted to each
/// position's support (`[n, V]` logits, differentiable): the distribution a sampler draws from
/// at that temperature under a grammar or nucleus. A position whose support holds only its
/// token has log-prob 0 and no gradient (the choice was forced).
pub fn sampled_logprobs(
    logits: &Tensor,
    tokens: &[u32],
    supports: &[Support],
    temperature: f64,
) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if tokens.len() != n || supports.len() != n || temperature.is_nan() || temperature <= 0.0 {
        return Err(LearnerError::InvalidArgument(format!(
            "sampled_logprobs: {n} positions, {} tokens, {} supports, temperature {temperature}",
            tokens.len(),
            supports.len()
        )));
    }
    let dev = logits.device();
    let scaled = (logits / temperature)?;
    let ids = Tensor::from_vec(tokens.to_vec(), n, dev)?;
    let width = supports
        .iter()
        .map(|s| match s {
            Support::Vocab => 0,
            Support::Among(c) => c.len(),
        })
        .max()
        .unwrap_or(0);
    if width == 0 {
        return token_logprobs(&scaled, &ids);
    }
    // Restricted rows: gather the support (logged token in column 0, padded with it), mask the
    // padding out, normalise over the row.
    let (mut idx, mut pad, mut among) = (Vec::new(), Vec::new(), Vec::new());
    for (t, s) in supports.iter().enumerate() {
        let (cands, is_among): (&[u32], bool) = match s {
            Support::Among(c) if c.first() == Some(&tokens[t]) => (c, true),
            Support::Among(_) => {
                return Err(LearnerError::InvalidArgument(format!(
                    "sampled_logprobs: position {t}'s support does not start with its token"
                )))
            }
            Support::Vocab => (&[], false),
        };
        for k in 0..width {
            idx.push(cands.get(k).copied().unwrap_or(tokens[t]));
            pad.push(if k == 0 || k < cands.len() {
                0f32
            } else {
                -1e9
            });
        }
        among.push(if is_among { 1f32 } else { 0.0 });
    }
    let idx = Tensor::from_vec(idx, (n, width), dev)?;
    let pad = Tensor::from_vec(pad, (n, width), dev)?.to_dtype(logits.dtype())?;
    let rows = (scaled.gather(&idx, 1)? + pad)?;
    let restricted = log_softmax(&rows)?.narrow(1, 0, 1)?.squeeze(1)?;
    if among.iter().all(|m| *m == 1.0) {
        return Ok(restricted);
    }
    let full = token_logprobs(&scaled, &ids)?;
    let m = Tensor::from_vec(among, n, dev)?.to_dtype(logits.dtype())?;
    let rest = m.affine(-1.0, 1.0)?;
    Ok(((restricted * &m)? + (full * rest)?)?)
}

/// Indices `[n, k]` (u32) of the `k` largest entries of each row of `logits` `[n, V]`.
pub fn top_k_indices(logits: &Tensor, k: usize) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if k == 0 || k > v {
        return Err(LearnerError::InvalidArgument(format!(
            "top_k must be in 1..={v}, got {k}"
        )));
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut out = Vec::with_capacity(n * k);
    for row in rows {
        let mut idx: Vec<u32> = (0..v as u32).collect();
        if k < v {
            idx.select_nth_unstable_by(k - 1, |a, b| row[*b as usize].total_cmp(&row[*a as usize]));
        }
        idx.truncate(k);
        out.extend(idx);
    }
    Ok(Tensor::from_vec(out, (n, k), logits.device())?)
}

/// The distribution over `k` chosen tokens plus one tail bucket holding the rest of the mass,
/// as log-probabilities `[n, k + 1]`.
fn bucketed_logprobs(logp: &Tensor, idx: &Tensor) -> Result<Tensor> {
    let top = logp.gather(idx, 1)?;
    let covered = top.exp()?.sum_keepdim(D::Minus1)?;
    // 1 - covered, floored so the log stays finite when the top-k holds all the mass.
    let tail = covered.affine(-1.0, 1.0)?.maximum(1e-12)?.log()?;
    Ok(Tensor::cat(&[&top, &tail], 1)?)
}

/// Per-token self-distillation loss `[n]`: the divergence between the teacher's and the
/// student's next-token distributions at each logged answer position, computed on the teacher's
/// `top_k` tokens plus a tail bucket (so the teacher needs to ship only k + 1 numbers per
/// token). `student_logits` is tracked; `teacher_logits` is treated as a constant.
pub fn distill_loss(
    student_logits: &Tensor,
    teacher_logits: &Tensor,
    top_k: usize,
    divergence: Divergence,
) -> Result<Tensor> {
    if student_logits.dims() != teacher_logits.dims() {
        return Err(LearnerError::InvalidArgument(format!(
            "student logits {:?} and teacher logits {:?} differ in shape",
            student_logits.dims(),
            teacher_logits.dims()
        )));
    }
    let teacher = teacher_logits.detach();
    let idx = top_k_indices(&teacher, top_k)?;
    let t = bucketed_logprobs(&log_softmax(&teacher)?, &idx)?;
    let s = bucketed_logprobs(&log_softmax(student_logits)?, &idx)?;
    let kl = |p_log: &Tensor, q_log: &Tensor| -> Result<Tensor> {
        // KL(p ‖ q) = Σ p (log p − log q)
        Ok((p_log.exp()? * (p_log - q_log)?)?.sum(D::Minus1)?)
    };
    match divergence {
        Divergence::ForwardKl => kl(&t, &s),
        Divergence::ReverseKl => kl(&s, &t),
        Divergence::Jsd => {
            let m_log = ((t.exp()? + s.exp()?)? * 0.5)?.maximum(1e-30)?.log()?;
            Ok(((kl(&t, &m_log)? + kl(&s, &m_log)?)? * 0.5)?)
        }
    }
}

/// What the clipped policy-gradient surrogate measured.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PgStats {
    /// Share of tokens whose importance ratio was outside `[1 − ε, 1 + ε]`.
    pub clip_fraction: f64,
    /// Mean importance ratio.
    pub mean_ratio: f64,
}

/// Per-token clipped policy-gradient loss `[n]` (PPO's surrogate, negated):
/// `−min(r·A, clip(r, 1 − ε, 1 + ε)·A)` with `r = π(y_t)/μ(y_t)` against the logged behaviour
/// log-probs `μ`. Without behaviour log-probs, `r = exp(lp − stopgrad(lp))` (= 1, gradient of
/// `lp`): plain REINFORCE on the dense advantages.
pub fn pg_loss(
    student_logprobs: &Tensor,
    behaviour_logprobs: Option<&Tensor>,
    advantages: &Tensor,
    ratio_clip: f64,
) -> Result<(Tensor, PgStats)> {
    let reference = match behaviour_logprobs {
        Some(b) => b.detach(),
        None => student_logprobs.detach(),
    };
    let ratio = (student_logprobs - &reference)?.exp()?;
    let adv = advantages.detach();
    let clipped = ratio.clamp(1.0 - ratio_clip, 1.0 + ratio_clip)?;
    let surrogate = (&ratio * &adv)?.minimum(&(&clipped * &adv)?)?;
    let r: Vec<f32> = ratio.detach().to_dtype(DType::F32)?.to_vec1()?;
    let n = r.len().max(1) as f64;
    let stats = PgStats {
        clip_fraction: r
            .iter()
            .filter(|x| (**x as f64 - 1.0).abs() > ratio_clip)
            .count() as f64
            / n,
        mean_ratio: r.iter().map(|x| *x as f64).sum::<f64>() / n,
    };
    Ok((surrogate.neg()?, stats))
}

/// Per-token dense advantages `[n]` (plain numbers): the teacher/student log-probability gap
/// on each logged token, clipped to `±gap_clip`, plus the sequence's scalar advantage (feedback
/// minus its running baseline), the same for every token.
pub fn dense_advantages(
    teacher_logprobs: &[f32],
    student_logprobs: &[f32],
    scalar_advantage: f64,
    gap_clip: f64,
) -> Vec<f32> {
    teacher_logprobs
        .iter()
        .zip(student_logprobs)
        .map(|(t, s)| {
            let gap = (*t as f64 - *s as f64).clamp(-gap_clip, gap_clip);
            (gap + scalar_advantage) as f32
        })
        .collect()
}

/// KTO hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KtoConfig {
    /// Temperature of the implied reward (β).
    #[serde(default = "default_kto_beta")]
    pub beta: f64,
    /// Weight of desirable (thumbs-up) examples.
    #[serde(default = "one")]
    pub desirable_weight: f64,
    /// Weight of undesirable (thumbs-down) examples.
    #[serde(default = "one")]
    pub undesirable_weight: f64,
}

fn default_kto_beta() -> f64 {
    0.1
}
fn one() -> f64 {
    1.0
}

impl Default for KtoConfig {
    fn default() -> Self {
        Self {
            beta: default_kto_beta(),
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

/// KTO loss (scalar) for one unpaired thumbs example: with the implied reward
/// `r = log π(y|x) − log π_ref(y|x)` (summed over the answer) and the reference point `z_ref`
/// (an estimate of KL(π ‖ π_ref), kept by the trainer, a constant here),
/// desirable: `λ_D (1 − σ(β (r − z_ref)))`, undesirable: `λ_U (1 − σ(β (z_ref − r)))`.
pub fn kto_loss(
    policy_seq_logprob: &Tensor,
    reference_seq_logprob: f64,
    desirable: bool,
    z_ref: f64,
    cfg: &KtoConfig,
) -> Result<Tensor> {
    let r = (policy_seq_logprob - reference_seq_logprob)?;
    let (x, weight) = if desirable {
        ((r - z_ref)? * cfg.beta, cfg.desirable_weight)
    } else {
        ((r.neg()? + z_ref)? * cfg.beta, cfg.undesirable_weight)
    };
    // 1 − σ(x) = σ(−x) = 1 / (1 + e^x)
    let loss = (x?.exp()? + 1.0)?.recip()?;
    Ok((loss * weight)?)
}

/// KL(π ‖ π_base) per logged token `[n]` with the non-negative "k3" estimator
/// `(ρ − 1) − log ρ`, `ρ = π_base(y_t)/π(y_t)`: unbiased when `y ~ π`, differentiable in `π`.
pub fn kl_to_base(student_logprobs: &Tensor, base_logprobs: &Tensor) -> Result<Tensor> {
    let log_rho = (base_logprobs.detach() - student_logprobs)?;
    Ok(((log_rho.exp()? - 1.0)? - log_rho)?)
}

/// Exact KL(π ‖ π_base) at each position `[n]`, summed over the vocabulary:
/// `Σ_v π(v) (log π(v) − log π_base(v))` from the policy's logits `[n, V]` (differentiable) and
/// the base model's logits `[n, V]` (a constant). Unlike the one-sample [`kl_to_base`] estimator
/// it stays bounded when the policy moves probability away from the logged token, which is what
/// distillation and negative feedback do on purpose: there `ρ = π_base(y)/π(y)` grows without
/// bound and the k3 penalty swamped the objective it was guarding (measured: 568 nats/token).
pub fn kl_exact(policy_logits: &Tensor, base_logits: &Tensor) -> Result<Tensor> {
    let lp = log_softmax(policy_logits)?;
    let lb = log_softmax(&base_logits.detach())?;
    Ok((lp.exp()? * (&lp - lb)?)?.sum(D::Minus1)?)
}

/// Mean over the rows of a per-token loss, as a scalar tensor (0 for no rows).
pub fn mean(per_token: &Tensor) -> Result<Tensor> {
    let n = per_token.elem_count();
    if n == 0 {
        return Ok(Tensor::zeros((), per_token.dtype(), per_token.device())?);
    }
    Ok((per_token.sum_all()? / n as f64)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn t2(rows: &[&[f64]]) -> Tensor {
        let n = rows.len();
        let v = rows[0].len();
        let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (n, v), &Device::Cpu).unwrap()
    }

    fn scalar(t: &Tensor) -> f64 {
        t.to_dtype(DType::F64)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// Central finite differences of `f` at `x` against candle's gradient, in f64.
    fn grad_check(x: &[f64], shape: (usize, usize), f: impl Fn(&Tensor) -> Tensor) {
        let var =
            Var::from_tensor(&Tensor::from_vec(x.to_vec(), shape, &Device::Cpu).unwrap()).unwrap();
        let loss = f(var.as_tensor()).sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<f64> = grads
            .get(var.as_tensor())
            .expect("gradient reaches the input")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let h = 1e-6;
        for i in 0..x.len() {
            let mut p = x.to_vec();
            p[i] += h;
            let mut m = x.to_vec();
            m[i] -= h;
            let fp = scalar(&f(&Tensor::from_vec(p, shape, &Device::Cpu).unwrap()));
            let fm = scalar(&f(&Tensor::from_vec(m, shape, &Device::Cpu).unwrap()));
            let num = (fp - fm) / (2.0 * h);
            assert!(
                (num - g[i]).abs() < 1e-5 * (1.0 + num.abs()),
                "d/dx[{i}]: finite difference {num}, backward {}",
                g[i]
            );
        }
    }

    /// Against the definition: softmax of logits / T over each row's support, in f64; and
    /// candle's gradient against finite differences (the dense term back-propagates through it).
    #[test]
    fn sampled_logprobs_renormalise_over_the_support_at_the_temperature() {
        let rows = [&S[..3], &S[3..]];
        let tokens = [2u32, 0];
        let supports = [Support::Among(vec![2, 0]), Support::Vocab];
        let t = 0.7;
        let got: Vec<f64> = sampled_logprobs(&t2(&rows), &tokens, &supports, t)
            .unwrap()
            .to_vec1()
            .unwrap();
        let want0 = S[2] / t - ((S[2] / t).exp() + (S[0] / t).exp()).ln();
        let want1 = S[3] / t - S[3..].iter().map(|x| (x / t).exp()).sum::<f64>().ln();
        assert!((got[0] - want0).abs() < 1e-9, "{got:?} vs {want0}");
        assert!((got[1] - want1).abs() < 1e-9, "{got:?} vs {want1}");
        // A forced choice (support of one) is certain.
        let forced = sampled_logprobs(
            &t2(&rows),
            &tokens,
            &[Support::Among(vec![2]), Support::Among(vec![0, 1, 2])],
            t,
        )
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
        assert_eq!(forced[0], 0.0);
        assert!(sampled_logprobs(
            &t2(&rows),
            &tokens,
            &[Support::Among(vec![0, 2]), Support::Vocab],
            t
        )
        .is_err());
        grad_check(&S, (2, 3), |x| {
            sampled_logprobs(x, &tokens, &supports, t).unwrap()
        });
        grad_check(&S, (2, 3), |x| {
            sampled_logprobs(
                x,
                &[1, 2],
                &[Support::Among(vec![1, 2, 0]), Support::Among(vec![2, 1])],
                1.3,
            )
            .unwrap()
        });
    }

    fn full_kl(p: &[f64], q: &[f64]) -> f64 {
        let lse = |x: &[f64]| {
            let m = x.iter().cloned().fold(f64::MIN, f64::max);
            m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
        };
        let (lp, lq) = (lse(p), lse(q));
        p.iter()
            .zip(q)
            .map(|(a, b)| (a - lp).exp() * ((a - lp) - (b - lq)))
            .sum()
    }

    const S: [f64; 6] = [0.3, -1.2, 2.0, 0.1, -0.4, 1.1];
    const T: [f64; 6] = [1.3, 0.2, -0.5, 0.7, 0.0, -2.0];

    #[test]
    fn distillation_with_full_top_k_equals_the_exact_divergences() {
        let s = t2(&[&S[..3], &S[3..]]);
        let t = t2(&[&T[..3], &T[3..]]);
        let fwd = distill_loss(&s, &t, 3, Divergence::ForwardKl).unwrap();
        let rev = distill_loss(&s, &t, 3, Divergence::ReverseKl).unwrap();
        let f: Vec<f64> = fwd.to_vec1().unwrap();
        let r: Vec<f64> = rev.to_vec1().unwrap();
        for row in 0..2 {
            let (sr, tr) = (&S[row * 3..row * 3 + 3], &T[row * 3..row * 3 + 3]);
            assert!(
                (f[row] - full_kl(tr, sr)).abs() < 1e-6,
                "forward KL row {row}"
            );
            assert!(
                (r[row] - full_kl(sr, tr)).abs() < 1e-6,
                "reverse KL row {row}"
            );
        }
    }

    #[test]
    fn divergences_vanish_when_student_equals_teacher_and_are_positive_otherwise() {
        let s = t2(&[&S[..3], &S[3..]]);
        let t = t2(&[&T[..3], &T[3..]]);
        for div in [
            Divergence::ForwardKl,
            Divergence::ReverseKl,
            Divergence::Jsd,
        ] {
            for k in [1, 2, 3] {
                let same = distill_loss(&s, &s, k, div).unwrap();
                assert!(scalar(&same).abs() < 1e-9, "{div:?} k={k} of equal rows");
                let diff: Vec<f64> = distill_loss(&s, &t, k, div).unwrap().to_vec1().unwrap();
                assert!(diff.iter().all(|d| *d > 0.0), "{div:?} k={k}: {diff:?}");
            }
            let jsd: Vec<f64> = distill_loss(&s, &t, 3, Divergence::Jsd)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(jsd.iter().all(|d| *d <= 2f64.ln() + 1e-12));
        }
    }

    #[test]
    fn top_k_picks_the_largest_logits() {
        let t = t2(&[&[0.1, 5.0, -1.0, 3.0], &[2.0, 1.0, 0.0, -1.0]]);
        let idx: Vec<Vec<u32>> = top_k_indices(&t, 2).unwrap().to_vec2().unwrap();
        let mut a = idx[0].clone();
        a.sort();
        assert_eq!(a, vec![1, 3]);
        let mut b = idx[1].clone();
        b.sort();
        assert_eq!(b, vec![0, 1]);
        assert!(top_k_indices(&t, 0).is_err());
        assert!(top_k_indices(&t, 5).is_err());
    }

    #[test]
    fn distillation_gradients_match_finite_differences() {
        let teacher = t2(&[&T[..3], &T[3..]]);
        for div in [
            Divergence::ForwardKl,
            Divergence::ReverseKl,
            Divergence::Jsd,
        ] {
            for k in [1, 2] {
                grad_check(&S, (2, 3), |s| distill_loss(s, &teacher, k, div).unwrap());
            }
        }
    }

    #[test]
    fn distillation_sends_no_gradient_to_the_teacher() {
        let s = Var::from_tensor(&t2(&[&S[..3]])).unwrap();
        let t = Var::from_tensor(&t2(&[&T[..3]])).unwrap();
        let loss = distill_loss(s.as_tensor(), t.as_tensor(), 2, Divergence::ForwardKl)
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap();
        assert!(g.get(s.as_tensor()).is_some());
        assert!(g.get(t.as_tensor()).is_none());
    }

    #[test]
    fn policy_gradient_surrogate_values_and_gradients() {
        let tokens = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let adv = Tensor::new(&[1.5f64, -0.5], &Device::Cpu).unwrap();
        let behaviour = Tensor::new(&[-0.9f64, -1.7], &Device::Cpu).unwrap();
        // Off-policy: the surrogate's gradient through the log-softmax.
        grad_check(&S, (2, 3), |s| {
            let lp = token_logprobs(s, &tokens).unwrap();
            pg_loss(&lp, Some(&behaviour), &adv, 0.2).unwrap().0
        });
        // On-policy the value is constant but the gradient is REINFORCE's, −Σ A ∇log π.
        let grad_of = |f: &dyn Fn(&Tensor) -> Tensor| -> Vec<f64> {
            let v = Var::from_tensor(&t2(&[&S[..3], &S[3..]])).unwrap();
            let g = f(v.as_tensor()).sum_all().unwrap().backward().unwrap();
            g.get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let on_policy = grad_of(&|s| {
            let lp = token_logprobs(s, &tokens).unwrap();
            pg_loss(&lp, None, &adv, 0.2).unwrap().0
        });
        let reinforce = grad_of(&|s| {
            (token_logprobs(s, &tokens).unwrap() * &adv)
                .unwrap()
                .neg()
                .unwrap()
        });
        for (a, b) in on_policy.iter().zip(&reinforce) {
            assert!((a - b).abs() < 1e-12, "{on_policy:?} vs {reinforce:?}");
        }
        // On-policy: the loss value is −A per token, and nothing is clipped.
        let s = t2(&[&S[..3], &S[3..]]);
        let lp = token_logprobs(&s, &tokens).unwrap();
        let (loss, stats) = pg_loss(&lp, None, &adv, 0.2).unwrap();
        let l: Vec<f64> = loss.to_vec1().unwrap();
        assert!((l[0] + 1.5).abs() < 1e-12 && (l[1] - 0.5).abs() < 1e-12);
        assert_eq!(stats.clip_fraction, 0.0);
        // A ratio far above 1 + ε with a positive advantage is clipped: no gradient.
        let v = Var::from_tensor(&Tensor::new(&[0.0f64], &Device::Cpu).unwrap()).unwrap();
        let far = Tensor::new(&[-3.0f64], &Device::Cpu).unwrap();
        let one_adv = Tensor::new(&[1.0f64], &Device::Cpu).unwrap();
        let (l, st) = pg_loss(v.as_tensor(), Some(&far), &one_adv, 0.2).unwrap();
        assert_eq!(st.clip_fraction, 1.0);
        let g = l.sum_all().unwrap().backward().unwrap();
        let gv = g.get(v.as_tensor()).map(scalar).unwrap_or(0.0);
        assert_eq!(gv, 0.0, "clipped tokens get no gradient");
    }

    #[test]
    fn dense_advantages_clip_the_gap_and_add_the_scalar() {
        let a = dense_advantages(&[-0.1, -5.0, -1.0], &[-2.0, -0.5, -1.0], 0.25, 1.0);
        assert_eq!(a, vec![1.25, -0.75, 0.25]);
    }

    #[test]
    fn kto_pushes_desirable_up_and_undesirable_down() {
        let cfg = KtoConfig::default();
        for desirable in [true, false] {
            let v = Var::from_tensor(&Tensor::new(&[-4.0f64], &Device::Cpu).unwrap()).unwrap();
            let seq = v.as_tensor().sum_all().unwrap();
            let loss = kto_loss(&seq, -4.5, desirable, 0.1, &cfg).unwrap();
            let val = scalar(&loss);
            // r = 0.5, z = 0.1: desirable 1 − σ(0.04), undesirable 1 − σ(−0.04).
            let want = if desirable {
                1.0 - 1.0 / (1.0 + (-0.04f64).exp())
            } else {
                1.0 - 1.0 / (1.0 + (0.04f64).exp())
            };
            assert!((val - want).abs() < 1e-12, "{val} vs {want}");
            let g = scalar(loss.backward().unwrap().get(v.as_tensor()).unwrap());
            // Descending the loss raises log π for desirable answers and lowers it otherwise.
            assert_eq!(g < 0.0, desirable, "gradient {g}");
        }
        grad_check(&S, (2, 3), |s| {
            let lp = token_logprobs(s, &Tensor::new(&[1u32, 2], &Device::Cpu).unwrap()).unwrap();
            kto_loss(&lp.sum_all().unwrap(), -3.0, false, 0.2, &cfg).unwrap()
        });
    }

    #[test]
    fn kl_to_base_is_zero_at_base_non_negative_and_differentiable() {
        let base = Tensor::new(&[-1.0f64, -2.0, -0.5], &Device::Cpu).unwrap();
        assert!(scalar(&kl_to_base(&base, &base).unwrap()).abs() < 1e-12);
        let other = Tensor::new(&[-0.2f64, -3.0, -0.5], &Device::Cpu).unwrap();
        let k: Vec<f64> = kl_to_base(&other, &base).unwrap().to_vec1().unwrap();
        assert!(k.iter().all(|x| *x >= 0.0));
        let tokens = Tensor::new(&[0u32, 2], &Device::Cpu).unwrap();
        let base2 = Tensor::new(&[-1.0f64, -2.0], &Device::Cpu).unwrap();
        grad_check(&S, (2, 3), |s| {
            kl_to_base(&token_logprobs(s, &tokens).unwrap(), &base2).unwrap()
        });
    }

    #[test]
    fn exact_kl_matches_the_definition_vanishes_at_base_and_has_a_checked_gradient() {
        let base = t2(&[&[0.3, -1.0, 2.0], &[0.0, 0.5, -0.5]]);
        let k0: Vec<f64> = kl_exact(&base, &base).unwrap().to_vec1().unwrap();
        assert!(k0.iter().all(|x| x.abs() < 1e-12), "{k0:?}");
        let pol = t2(&[&[2.0, -1.0, 0.0], &[0.0, 0.5, 3.0]]);
        let k: Vec<f64> = kl_exact(&pol, &base).unwrap().to_vec1().unwrap();
        let p: Vec<Vec<f64>> = log_softmax(&pol).unwrap().exp().unwrap().to_vec2().unwrap();
        let lb: Vec<Vec<f64>> = log_softmax(&base).unwrap().to_vec2().unwrap();
        for r in 0..2 {
            let want: f64 = (0..3).map(|v| p[r][v] * (p[r][v].ln() - lb[r][v])).sum();
            assert!((k[r] - want).abs() < 1e-12, "{} vs {want}", k[r]);
            assert!(k[r] > 0.0);
        }
        // Bounded where the sampled-token estimator explodes: the policy drops the logged token.
        let logged = Tensor::new(&[0u32], &Device::Cpu).unwrap();
        let b1 = t2(&[&[7.0, 0.0, 0.0]]);
        let p1 = t2(&[&[-7.0, 0.0, 0.0]]);
        let k3 = scalar(
            &kl_to_base(
                &token_logprobs(&p1, &logged).unwrap(),
                &token_logprobs(&b1, &logged).unwrap(),
            )
            .unwrap(),
        );
        let exact = scalar(&kl_exact(&p1, &b1).unwrap());
        assert!(k3 > 1000.0 && exact < 10.0, "k3 {k3}, exact {exact}");
        let b = t2(&[&[0.1, 0.2, 0.3], &[1.0, -1.0, 0.0]]);
        grad_check(&S, (2, 3), |s| kl_exact(s, &b).unwrap());
    }

    #[test]
    fn log_softmax_matches_the_definition() {
        let s = t2(&[&S[..3]]);
        let lp: Vec<Vec<f64>> = log_softmax(&s).unwrap().to_vec2().unwrap();
        let z: f64 = S[..3].iter().map(|x| x.exp()).sum();
        for (i, x) in S[..3].iter().enumerate() {
            assert!((lp[0][i] - (x - z.ln())).abs() < 1e-12);
        }
    }
}
