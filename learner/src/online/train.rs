//! The train stage: one trainer step off the async runtime, and the metrics its report feeds.

use tracing::Instrument;

use super::OnlineError;
use crate::example::TrainExample;
use crate::trainer::{StepReport, Trainer};

/// One trainer step on `batch`, off the async runtime (it is CPU-bound); the trainer goes back
/// into its slot, and the batch comes back for the caller's bookkeeping.
pub(super) async fn train_step(
    slot: &mut Option<Trainer>,
    batch: Vec<TrainExample>,
    span: tracing::Span,
) -> Result<(Vec<TrainExample>, StepReport), OnlineError> {
    let mut tr = slot
        .take()
        .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
    let (tr, batch, result) = tokio::task::spawn_blocking(move || {
        let r = tr.step(&batch);
        (tr, batch, r)
    })
    .instrument(span)
    .await
    .map_err(|e| OnlineError::Thread(e.to_string()))?;
    *slot = Some(tr);
    Ok((batch, result?))
}

/// Feeds a step report into the learner's metrics (step outcome, loss terms, KL, gradient
/// norm, advantage and teacher statistics).
pub(super) fn record_metrics(r: &StepReport) {
    let outcome = if r.skipped.is_some() {
        "refused"
    } else {
        "applied"
    };
    metrics::counter!("hindsight_learner_steps_total", "outcome" => outcome).increment(1);
    metrics::counter!("hindsight_learner_examples_total").increment(r.examples as u64);
    metrics::counter!("hindsight_learner_tokens_total").increment(r.tokens as u64);
    metrics::gauge!("hindsight_learner_loss", "term" => "total").set(r.loss);
    for term in ["sft", "kto", "distill", "dense", "kl_penalty"] {
        if let Some(v) = r.terms.get(term) {
            metrics::gauge!("hindsight_learner_loss", "term" => term).set(*v);
        }
    }
    metrics::gauge!("hindsight_learner_kl_to_base").set(r.kl_to_base);
    metrics::gauge!("hindsight_learner_grad_norm").set(r.grad_norm);
    if let Some(v) = r.teacher_student_gap {
        metrics::gauge!("hindsight_learner_teacher_student_gap").set(v);
    }
    if let Some(v) = r.advantage_mean {
        metrics::gauge!("hindsight_learner_advantage_mean").set(v);
    }
    if let Some(v) = r.advantage_std {
        metrics::gauge!("hindsight_learner_advantage_std").set(v);
    }
    if let Some(v) = r.clip_fraction {
        metrics::gauge!("hindsight_learner_ratio_clip_fraction").set(v);
    }
    if let Some(c) = r.teacher_answers {
        // Outcome of the teacher's own answers (`distill_target = teacher`, or the experimental edit).
        let counter = |outcome: &'static str, n: usize| {
            metrics::counter!("hindsight_learner_teacher_answers_total", "outcome" => outcome)
                .increment(n as u64)
        };
        counter("changed", c.changed);
        counter("kept", c.decoded.saturating_sub(c.changed + c.fallback));
        counter("fallback", c.fallback);
        metrics::counter!("hindsight_learner_teacher_edited_fields_total")
            .increment(c.edited_fields as u64);
    }
}
