//! The simulated production environment: customer-support tickets resolved into a JSON
//! decision under hidden business rules, read-only tools with injected failures, and a simulated
//! user who sends feedback through Hindsight's webhook.

mod error;
mod evalset;
mod prompt;
mod rng;
mod run;
mod sop;
mod tools;
mod user;
mod webhook;
mod wording;
mod world;

pub use error::EnvError;
pub use evalset::{eval_item, eval_item_under, eval_items, eval_items_under, rules_of};
pub use prompt::{
    messages, response_format, system_prompt, tools, user_message, PromptOptions, Records, Variant,
};
pub use rng::Rng;
pub use run::{run_env, EnvRunConfig, EnvRunSummary, EpisodeOutcome, FeedbackConfig};
pub use sop::{
    resolve, rules_text, Decision, Resolution, Rule, Sop, ALL_RULES, DEPARTMENTS, PRIORITIES,
    REFUNDS, RETENTION_AFTER_DAYS,
};
pub use tools::{lookup, ToolBox};
pub use user::{critique, react, rule_phrase, value_phrase, CritiqueStyle, Reaction, UserConfig};
pub use webhook::{answer_layout, feedback_events, sign, FeedbackSender, Target, BATCH_PATH};
pub use world::{Customer, IssueKind, Order, Split, Ticket, Tier, World};
