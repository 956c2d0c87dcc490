//! AdamW over an adapter's variables, with its moments addressable by the adapter's PEFT keys so
//! the optimizer state can be checkpointed next to the adapter and restored exactly.
//! (`candle_nn::AdamW` keeps its moments private, so a restarted learner would start with
//! cold moments and take a different trajectory.)

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{LearnerError, Result};
use hindsight_model::Adapter;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate.
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// β₁.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// β₂.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// ε.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay.
    #[serde(default)]
    pub weight_decay: f64,
}

/// The learning rate of the measured recipe (lr 1e-3 with replay 4; 3e-3 over-fitted, 5e-4
/// moved too little within 64 events: docs/experiments/).
fn default_lr() -> f64 {
    1e-3
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: default_lr(),
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    /// Checks the ranges.
    pub fn check(&self) -> Result<()> {
        let ok = self.lr.is_finite()
            && self.lr > 0.0
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps > 0.0
            && self.weight_decay >= 0.0;
        if ok {
            Ok(())
        } else {
            Err(LearnerError::InvalidArgument(format!(
                "AdamW needs lr > 0, betas in [0, 1), eps > 0, weight_decay >= 0; got {self:?}"
            )))
        }
    }
}

/// AdamW state: first and second moments per variable (by PEFT key) and the step count.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    m: HashMap<String, Tensor>,
    v: HashMap<String, Tensor>,
}

impl AdamW {
    /// Fresh state.
    pub fn new(cfg: AdamWConfig) -> Result<Self> {
        cfg.check()?;
        Ok(Self {
            cfg,
            step: 0,
            m: HashMap::new(),
            v: HashMap::new(),
        })
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Sets the learning rate (schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// One update of `adapter`'s variables from `grads`; variables without a gradient are left
    /// alone (their moments too).
    pub fn step(&mut self, adapter: &Adapter, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let data = adapter
            .varmap()
            .data()
            .lock()
            .map_err(|_| LearnerError::InvalidAdapter("poisoned var map".into()))?;
        for (key, var) in data.iter() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(var.dtype())?;
            let m = match self.m.get(key) {
                Some(m) => ((m * c.beta1)? + (&g * (1.0 - c.beta1))?)?,
                None => (&g * (1.0 - c.beta1))?,
            };
            let v = match self.v.get(key) {
                Some(v) => ((v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?,
                None => (g.sqr()? * (1.0 - c.beta2))?,
            };
            let m_hat = (&m / bc1)?;
            let v_hat = (&v / bc2)?;
            let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
            let w = var.as_tensor().detach();
            let w = if c.weight_decay > 0.0 {
                (&w * (1.0 - c.lr * c.weight_decay))?
            } else {
                w
            };
            var.set(&(w - (update * c.lr)?)?)?;
            self.m.insert(key.clone(), m);
            self.v.insert(key.clone(), v);
        }
        Ok(())
    }

    /// Writes the moments and step count to a safetensors file (`m.<key>`, `v.<key>`, `step`).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut all: HashMap<String, Tensor> = HashMap::new();
        for (k, t) in &self.m {
            all.insert(format!("m.{k}"), t.clone());
        }
        for (k, t) in &self.v {
            all.insert(format!("v.{k}"), t.clone());
        }
        let dev = candle_core::Device::Cpu;
        all.insert(
            "step".into(),
            Tensor::new(&[self.step as f64], &dev)?.to_dtype(DType::F64)?,
        );
        candle_core::safetensors::save(&all, path)?;
        Ok(())
    }

    /// Reads state written by [`AdamW::save`] onto `device`.
    pub fn load(cfg: AdamWConfig, path: &Path, device: &candle_core::Device) -> Result<Self> {
        cfg.check()?;
        let all = candle_core::safetensors::load(path, device)?;
        let mut opt = Self::new(cfg)?;
        for (k, t) in all {
            if k == "step" {
                let s: Vec<f64> = t.to_dtype(DType::F64)?.to_vec1()?;
                opt.step = s.first().copied().unwrap_or(0.0) as u64;
            } else if let Some(key) = k.strip_prefix("m.") {
                opt.m.insert(key.to_string(), t);
            } else if let Some(key) = k.strip_prefix("v.") {
                opt.v.insert(key.to_string(), t);
            } else {
                return Err(LearnerError::InvalidArgument(format!(
                    "unexpected tensor {k} in optimizer state {}",
                    path.display()
                )));
            }
        }
        Ok(opt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use hindsight_model::testing::max_abs_diff;
    use hindsight_model::{Architecture, ModelConfig};
    use hindsight_model::{LoraConfig, LoraInit, LoraTarget};

    fn tiny_cfg() -> ModelConfig {
        ModelConfig::tiny(Architecture::Llama)
    }

    fn adapter(seed: u64) -> Adapter {
        let lora = LoraConfig {
            targets: vec![LoraTarget::Q, LoraTarget::V],
            ..LoraConfig::default()
        };
        Adapter::new(
            "a",
            lora,
            &tiny_cfg(),
            LoraInit::RandomB(0.1),
            seed,
            &Device::Cpu,
        )
        .unwrap()
    }

    /// Loss Σ w² over every variable: its gradient is 2w.
    fn sq_grads(a: &Adapter) -> GradStore {
        let mut total: Option<Tensor> = None;
        for v in a.vars() {
            let s = v.as_tensor().sqr().unwrap().sum_all().unwrap();
            total = Some(match total {
                Some(t) => (t + s).unwrap(),
                None => s,
            });
        }
        total.unwrap().backward().unwrap()
    }

    #[test]
    fn first_step_moves_every_weight_by_lr_against_its_gradient_sign() {
        let a = adapter(1);
        // Copies: `tensors()` shares storage with the variables, which are updated in place.
        let before: HashMap<String, Tensor> = a
            .tensors()
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.copy().unwrap()))
            .collect();
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.01,
            ..Default::default()
        })
        .unwrap();
        opt.step(&a, &sq_grads(&a)).unwrap();
        for (k, t) in a.tensors().unwrap() {
            let b: Vec<f32> = before[&k].flatten_all().unwrap().to_vec1().unwrap();
            let n: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            for (x, y) in b.iter().zip(&n) {
                if x.abs() > 1e-6 {
                    // Adam's first step is lr·sign(g) (up to ε).
                    assert!((x - y - 0.01 * x.signum()).abs() < 1e-4, "{k}: {x} -> {y}");
                }
            }
        }
    }

    #[test]
    fn saved_state_resumes_the_same_trajectory() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.01,
            ..Default::default()
        };
        let (a, b) = (adapter(7), adapter(7));
        let mut oa = AdamW::new(cfg).unwrap();
        let mut ob = AdamW::new(cfg).unwrap();
        for _ in 0..3 {
            oa.step(&a, &sq_grads(&a)).unwrap();
            ob.step(&b, &sq_grads(&b)).unwrap();
        }
        let path = dir.path().join("opt.safetensors");
        ob.save(&path).unwrap();
        let mut ob = AdamW::load(cfg, &path, &Device::Cpu).unwrap();
        assert_eq!(ob.steps(), 3);
        for _ in 0..3 {
            oa.step(&a, &sq_grads(&a)).unwrap();
            ob.step(&b, &sq_grads(&b)).unwrap();
        }
        let (ta, tb) = (a.tensors().unwrap(), b.tensors().unwrap());
        for (k, t) in ta {
            let d = max_abs_diff(&t, &tb[&k]).unwrap();
            assert_eq!(d, 0.0, "{k} diverged after restoring the optimizer");
        }
        // A fresh optimizer would not have produced the same weights.
        let c = adapter(7);
        let mut oc = AdamW::new(cfg).unwrap();
        for _ in 0..3 {
            oc.step(&c, &sq_grads(&c)).unwrap();
        }
        let mut oc2 = AdamW::new(cfg).unwrap();
        for _ in 0..3 {
            oc2.step(&c, &sq_grads(&c)).unwrap();
        }
        let any_diff = c
            .tensors()
            .unwrap()
            .iter()
            .any(|(k, t)| max_abs_diff(t, &a.tensors().unwrap()[k]).unwrap() > 0.0);
        assert!(
            any_diff,
            "cold moments must change the trajectory (test would be vacuous)"
        );
    }

    #[test]
    fn bad_hyper_parameters_are_refused() {
        assert!(AdamW::new(AdamWConfig {
            lr: 0.0,
            ..Default::default()
        })
        .is_err());
        assert!(AdamW::new(AdamWConfig {
            beta2: 1.0,
            ..Default::default()
        })
        .is_err());
    }
}
