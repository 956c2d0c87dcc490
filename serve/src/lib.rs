//! `hindsight serve`: an OpenAI-compatible model server over the candle model core, with per-request LoRA adapters, behaviour log-probs, guided JSON decoding and zero-downtime adapter hot-swap (vLLM's adapter API).

mod adapters;
mod engine;
mod error;
mod grammar;
mod openai;
mod sampler;
mod server;

pub use adapters::{AdapterRegistry, AdapterTable, AdapterVersion, LoadRequest};
pub use engine::{grammar_vocab, EngineConfig};
pub use error::ServeError;
pub use grammar::{compile_schema, JsonState};
pub use openai::{chat_prompt, parse_body, ChatPrompt, RawRequest, ToolMode};
pub use server::{
    app, run_serve, serve, ServeArgs, ServeConfig, ServeState, ADAPTER_HEADER, BEHAVIOUR_HEADER,
};
