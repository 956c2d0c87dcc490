//! The start-up stage: the model, the registry, and the trainer and loop state restored from
//! the latest checkpoint.

use std::sync::Arc;

use hindsight_control::registry::{sha256_file, Registry};
use hindsight_feedback::now_ms;
use hindsight_model::grammar::grammar_vocab;
use hindsight_model::{Adapter, ModelBundle};
use tracing::info;

use super::{LearnerSetup, OnlineError};
use crate::checkpoint::{CheckpointStore, LoopState};
use crate::trainer::{DistillTarget, TeacherDecoding, Trainer};

/// What the loop starts from: the model's tokenizer and template, the registry, and the
/// trainer and loop state restored from the latest checkpoint (else from the live adapter,
/// else fresh).
pub(super) struct Resumed {
    pub(super) tokenizer: tokenizers::Tokenizer,
    pub(super) template: hindsight_model::ChatTemplate,
    pub(super) end_of_turn: u32,
    pub(super) registry: Option<Registry>,
    pub(super) base_sha: String,
    pub(super) store: CheckpointStore,
    pub(super) state: LoopState,
    pub(super) trainer: Trainer,
}

/// The start-up stage: loads the model, connects the registry, builds the trainer and restores
/// the latest checkpoint into it.
pub(super) async fn resume(setup: &LearnerSetup) -> Result<Resumed, OnlineError> {
    let cfg = &setup.learner;
    // The model, loaded once, in the configured dtype on the configured device (never the
    // quantized inference copies).
    let model_path = cfg.model_path.clone();
    let (device_spec, dtype) = (cfg.device, cfg.dtype.dtype());
    let bundle = tokio::task::spawn_blocking(move || {
        ModelBundle::load(&model_path, dtype, &device_spec.open()?)
    })
    .await
    .map_err(|e| OnlineError::Thread(e.to_string()))??;
    let end_of_turn = bundle
        .end_of_turn()
        .ok_or_else(|| OnlineError::Config("the model has no end-of-turn token".into()))?;
    let template = bundle.chat_template.ok_or_else(|| {
        OnlineError::Config(format!(
            "{} carries no chat template; the learner must render prompts exactly as served",
            cfg.model_path.display()
        ))
    })?;
    let tokenizer = bundle.tokenizer.clone();
    let model_cfg = bundle.config.clone();
    let model = Arc::new(bundle.model);

    let registry = match &setup.registry {
        Some(r) => Some(Registry::connect(r.clone()).await?),
        None => None,
    };
    let base_sha = {
        let p = cfg.model_path.clone();
        tokio::task::spawn_blocking(move || {
            if p.is_file() {
                sha256_file(&p)
            } else {
                sha256_file(&p.join("config.json"))
            }
        })
        .await
        .map_err(|e| OnlineError::Thread(e.to_string()))??
    };

    // The trainer: from the latest checkpoint, else from the live adapter, else fresh.
    let live = match &registry {
        Some(r) => r.live(&cfg.adapter_name).await?,
        None => None,
    };
    let mut trainer = match &live {
        Some(entry) => {
            let adapter = Adapter::load_peft(
                &entry.path,
                cfg.adapter_name.clone(),
                &model_cfg,
                model.device(),
            )?;
            Trainer::with_policy(model.clone(), cfg.trainer.clone(), adapter)?
        }
        None => Trainer::new(model.clone(), cfg.trainer.clone(), &cfg.adapter_name)?,
    };
    if cfg.trainer.target() != DistillTarget::Logged || cfg.trainer.objectives.dense > 0.0 {
        // The teacher decodes its own answers under the logged requests' grammars, and the
        // dense term follows them to compare the policy with the logged behaviour.
        trainer.set_decoding(TeacherDecoding {
            vocab: Arc::new(grammar_vocab(&tokenizer, model_cfg.vocab_size)),
            end_of_turn,
            tokenizer: Some(Arc::new(tokenizer.clone())),
        });
    }
    let store = CheckpointStore::open(&cfg.checkpoint_dir, cfg.keep_checkpoints)?;
    let mut state = match store.restore(&mut trainer)? {
        Some(s) => {
            info!(
                seq = s.seq,
                batches = s.batches,
                examples = s.examples,
                "Resumed from checkpoint."
            );
            s
        }
        None => LoopState {
            candidate_at_ms: now_ms(),
            live_version: live.as_ref().map(|e| e.version),
            ..Default::default()
        },
    };
    if let Some(entry) = &live {
        state.live_version = Some(state.live_version.unwrap_or(0).max(entry.version));
    }
    Ok(Resumed {
        tokenizer,
        template,
        end_of_turn,
        registry,
        base_sha,
        store,
        state,
        trainer,
    })
}
