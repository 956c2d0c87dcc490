//! `hindsight serve`: an OpenAI-compatible model server over the candle model core, with per-request LoRA adapters, behaviour log-probs, guided JSON decoding and zero-downtime adapter hot-swap (vLLM's adapter API).

mod adapters;
mod config;
mod engine;
mod error;
mod openai;
mod sampler;
mod server;

pub use adapters::{AdapterRegistry, AdapterTable, AdapterVersion, LoadRequest};
pub use config::{RawServeSection, ServeArgs, ServeConfig};
pub use engine::EngineConfig;
pub use error::ServeError;
/// Guided decoding lives in the model core (the learner decodes the teacher's answers with it).
pub use hindsight_model::grammar;
pub use hindsight_model::grammar::{compile_schema, grammar_vocab, JsonState};
pub use openai::{chat_prompt, parse_body, ChatPrompt, RawRequest, ToolMode};
pub use server::{app, run_serve, serve, ServeState, ADAPTER_HEADER, BEHAVIOUR_HEADER};
