//! A likelihood probe of learning beyond the prior.
//!
//! Greedy exact match on 20 held-out tickets moves in 5-point steps, and a student that learns
//! only the most common decision scores what the constant answer scores (bench/README.md, the
//! learning-curve harness). This probe is continuous and separates the two: on the tickets whose
//! correct decision is *not* the constant answer, it averages
//! `log p(correct | prompt) − log p(constant | prompt)` under a model (base or adapter). Learning
//! the prior alone moves it down (the constant answer gets likelier everywhere); it rises only if
//! the model tells tickets apart in the direction of the rules.
//!
//! Prompts are rendered as `hindsight serve` renders them (chat template and tool block); the
//! two answers are the decisions in the layout the served answers have (see
//! [`answer_layout`]) plus the end-of-turn token.

use std::path::Path;

use anyhow::Context;
use hindsight_eval::EvalSet;
use hindsight_learner::objectives::token_logprobs;
use hindsight_model::candle_core::{DType, Device, Tensor};
use hindsight_model::{
    encode, prompt_tools, Adapter, AdapterSelection, BatchLayout, KvCache, ModelBundle,
};
use serde_json::Value;

use hindsight_sim::answer_layout;

/// One probed ticket: its prompt and the two answers compared.
#[derive(Debug, Clone)]
struct ProbeItem {
    prompt: Vec<u32>,
    correct: Vec<u32>,
    constant: Vec<u32>,
}

/// The probe over a held-out set and, optionally, the trained tickets.
#[derive(Debug)]
pub struct PriorProbe {
    bundle: ModelBundle,
    held_out: Vec<ProbeItem>,
    trained: Vec<ProbeItem>,
}

/// The probe's figures for one model (`None`: nothing probed).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PriorMargins {
    /// Mean margin over the held-out tickets whose decision is not the constant answer.
    pub held_out: Option<f64>,
    /// The same over the trained tickets probed.
    pub trained: Option<f64>,
}

impl PriorProbe {
    /// Loads the model (f32, CPU) and tokenizes the items of `held_out` and `trained` whose
    /// expected decision differs from `constant`.
    pub fn new(
        model_path: &Path,
        held_out: &EvalSet,
        trained: Option<&EvalSet>,
        constant: &Value,
    ) -> anyhow::Result<Self> {
        let bundle = ModelBundle::load(model_path, DType::F32, &Device::Cpu)?;
        let held = items(&bundle, held_out, constant)?;
        let trained = match trained {
            Some(set) => items(&bundle, set, constant)?,
            None => Vec::new(),
        };
        Ok(Self {
            bundle,
            held_out: held,
            trained,
        })
    }

    /// Tickets probed: (held-out, trained).
    pub fn sizes(&self) -> (usize, usize) {
        (self.held_out.len(), self.trained.len())
    }

    /// The margins under the PEFT adapter in `adapter_dir`, or under the base model.
    pub fn margins(&self, adapter_dir: Option<&Path>) -> anyhow::Result<PriorMargins> {
        let adapter = match adapter_dir {
            Some(dir) => Some(
                Adapter::load_peft(dir, "probe", &self.bundle.config, &Device::Cpu)
                    .with_context(|| format!("loading the adapter in {}", dir.display()))?,
            ),
            None => None,
        };
        let selection = match &adapter {
            Some(a) => AdapterSelection::All(a),
            None => AdapterSelection::None,
        };
        Ok(PriorMargins {
            held_out: self.mean_margin(&self.held_out, &selection)?,
            trained: self.mean_margin(&self.trained, &selection)?,
        })
    }

    fn mean_margin(
        &self,
        items: &[ProbeItem],
        selection: &AdapterSelection,
    ) -> anyhow::Result<Option<f64>> {
        if items.is_empty() {
            return Ok(None);
        }
        let mut sum = 0.0;
        for item in items {
            sum += self.margin(item, selection)?;
        }
        Ok(Some(sum / items.len() as f64))
    }

    /// `log p(correct) − log p(constant)` for one ticket: the prompt (all but its last token)
    /// runs once into a KV cache that both answers continue from.
    fn margin(&self, item: &ProbeItem, selection: &AdapterSelection) -> anyhow::Result<f64> {
        let model = &self.bundle.model;
        let dev = model.device();
        let p = item.prompt.len();
        anyhow::ensure!(p >= 2, "a probe prompt needs at least two tokens");
        let head = p - 1;
        let mut cache = KvCache::new();
        let input = Tensor::from_slice(&item.prompt[..head], (1, head), dev)?;
        model.hidden(
            &input,
            &BatchLayout::dense(1, head, 0),
            Some(&mut cache),
            selection,
            false,
        )?;
        let answer_lp = |answer: &[u32]| -> anyhow::Result<f64> {
            let n = answer.len();
            let mut cache = cache.clone();
            let ids: Vec<u32> = std::iter::once(item.prompt[head])
                .chain(answer[..n - 1].iter().copied())
                .collect();
            let input = Tensor::from_vec(ids, (1, n), dev)?;
            let logits = model
                .forward(
                    &input,
                    &BatchLayout::dense(1, n, head),
                    Some(&mut cache),
                    selection,
                )?
                .squeeze(0)?;
            let targets = Tensor::from_slice(answer, n, dev)?;
            Ok(token_logprobs(&logits, &targets)?
                .sum_all()?
                .to_scalar::<f32>()? as f64)
        };
        Ok(answer_lp(&item.correct)? - answer_lp(&item.constant)?)
    }
}

/// Tokenized items of `set` whose expected decision is not `constant`.
fn items(bundle: &ModelBundle, set: &EvalSet, constant: &Value) -> anyhow::Result<Vec<ProbeItem>> {
    let template = bundle
        .chat_template
        .as_ref()
        .context("the model carries no chat template")?;
    let end = bundle
        .end_of_turn()
        .context("the model has no end-of-turn token")?;
    let answer = |v: &Value| -> anyhow::Result<Vec<u32>> {
        let mut ids = encode(&bundle.tokenizer, &answer_layout(v))?;
        ids.push(end);
        Ok(ids)
    };
    let constant_ids = answer(constant)?;
    set.items
        .iter()
        .filter(|item| item.expected != *constant)
        .map(|item| {
            let tools = item.tools.clone().map(Value::Array);
            let text = template
                .render_chat(&item.messages, &prompt_tools(tools.as_ref(), None))
                .map_err(|e| anyhow::anyhow!("rendering {}: {e}", item.id))?;
            Ok(ProbeItem {
                prompt: encode(&bundle.tokenizer, &text)?,
                correct: answer(&item.expected)?,
                constant: constant_ids.clone(),
            })
        })
        .collect()
}
