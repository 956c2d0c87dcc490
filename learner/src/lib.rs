//! Training: examples from joined episodes, the hindsight teacher's prompt, objectives
//! (self-distillation, dense reward, KTO, SFT), the trainer, the optimizer, and the online loop
//! that consumes `hindsight.episodes`, checkpoints exactly once and hands candidates to the
//! control plane's eval gate.

mod error;

pub mod checkpoint;
pub mod example;
pub mod objectives;
pub mod online;
pub mod optim;
pub mod teacher_prompt;
pub mod trainer;

pub use error::{LearnerError, Result};
