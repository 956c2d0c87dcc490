//! External evaluation: eval sets, scorers, pass@k and model comparison against any OpenAI-compatible endpoint.

mod cli;
mod client;
mod compare;
mod error;
mod passk;
mod runner;
mod score;
mod set;
mod token_stats;

pub use cli::{render_summary, run_eval_cli, write_report, EvalArgs, EvalReport, REPORT_SCHEMA};
pub use client::{
    message_text, CallError, ChatClient, ChatResponse, ADAPTER_HEADER, INTERACTION_HEADER,
};
pub use compare::{compare_runs, paired_diff, Comparison, PairedDiff};
pub use error::EvalError;
pub use passk::pass_at_k;
pub use runner::{
    evaluate, item_outcome, request_body, summarize, ItemOutcome, RunConfig, RunMetrics, RunReport,
    SampleOutcome, SetInfo, RUN_SCHEMA,
};
pub use score::{extract_json_answer, score_answer, values_equal, Score, Unparseable};
pub use set::{canonical_arguments, to_jsonl, EvalItem, EvalSet, ScorerKind};
pub use token_stats::{entropy_estimate, TokenStats};
