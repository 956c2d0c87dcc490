//! The HTTP surface: shared state, the axum router and `run_serve` (configuration: config.rs).

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hindsight_model::tokenizers::Tokenizer;
use hindsight_model::{ChatTemplate, Model, ModelBundle};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::adapters::{AdapterRegistry, AdapterVersion, LoadRequest};
use crate::config::{ServeArgs, ServeConfig};
use crate::engine::{Engine, Event, FinishReason, Job, JobParams, PromptToken};
use crate::error::ServeError;
use crate::openai::{self, ChoiceOutput, RawRequest, ToolMode};
use crate::sampler::SamplingParams;

/// Response header naming the adapter version (`name@version` or `base`).
pub use hindsight_core::headers::ADAPTER as ADAPTER_HEADER;
/// Request header asking for behaviour log-probs even when the client did not ask for them.
pub use hindsight_core::headers::BEHAVIOUR as BEHAVIOUR_HEADER;

struct Inner {
    engine: Engine,
    registry: AdapterRegistry,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    base_name: String,
    model_path: String,
    max_context: usize,
    default_max_tokens: usize,
    created: u64,
}

/// Everything the handlers share.
#[derive(Clone)]
pub struct ServeState {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ServeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeState")
            .field("base_name", &self.inner.base_name)
            .finish()
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl ServeState {
    /// Builds the state around a loaded model and starts the generation worker.
    pub fn new(bundle: ModelBundle, config: &ServeConfig) -> Result<Self, ServeError> {
        let ModelBundle {
            model,
            tokenizer,
            chat_template,
            config: model_cfg,
            eos_token_ids,
        } = bundle;
        let device = model.device().clone();
        let model: Arc<Model> = Arc::new(model);
        let tokenizer = Arc::new(tokenizer);
        let engine = Engine::start(
            model.clone(),
            tokenizer.clone(),
            eos_token_ids,
            config.engine.clone(),
        )?;
        let registry = AdapterRegistry::new(
            &config.served_model_name,
            model_cfg.clone(),
            device,
            config.keep_adapter_versions,
        );
        let state = Self {
            inner: Arc::new(Inner {
                engine,
                registry,
                tokenizer,
                template: chat_template,
                base_name: config.served_model_name.clone(),
                model_path: config.model.display().to_string(),
                max_context: model_cfg.max_position_embeddings,
                default_max_tokens: config.default_max_tokens,
                created: now_s(),
            }),
        };
        for (name, path) in &config.adapters {
            state.registry().load(&LoadRequest {
                name: name.clone(),
                path: path.clone(),
                load_inplace: false,
                sha256: None,
            })?;
        }
        Ok(state)
    }

    /// Loads the model from `config.model` (blocking) and builds the state.
    pub fn load(config: &ServeConfig) -> Result<Self, ServeError> {
        let device = config.device.open()?;
        let bundle = ModelBundle::load(&config.model, config.dtype.dtype(), &device)?;
        Self::new(bundle, config)
    }

    /// The adapter table.
    pub fn registry(&self) -> &AdapterRegistry {
        &self.inner.registry
    }

    /// The base model's name.
    pub fn base_name(&self) -> &str {
        &self.inner.base_name
    }
}

/// The router: OpenAI endpoints and vLLM's adapter API.
pub fn app(state: ServeState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_adapter))
        .route("/v1/unload_lora_adapter", post(unload_adapter))
        .route("/health", get(|| async { "ok" }))
        .with_state(state)
}

/// Loads the model, then serves on `listener` until `shutdown` completes (in-flight requests
/// are drained by axum's graceful shutdown).
pub async fn run_serve(
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let started = std::time::Instant::now();
    let cfg = config.clone();
    let state = tokio::task::spawn_blocking(move || ServeState::load(&cfg))
        .await
        .map_err(|_| ServeError::Unavailable)??;
    tracing::info!(model = %config.model.display(), name = %state.base_name(), load_ms = started.elapsed().as_millis() as u64, addr = ?listener.local_addr().ok(), "Serving.");
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// What the CLI runs: validates `args`, binds `--listen` and serves until `shutdown`.
pub async fn serve(
    args: &ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let config = args.load()?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    run_serve(config, listener, shutdown).await
}

fn wants_behaviour(headers: &HeaderMap) -> bool {
    headers
        .get(BEHAVIOUR_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes"))
}

/// Resolves `model` to the adapter version the request will run on (captured once).
fn resolve_model(
    state: &ServeState,
    model: &str,
) -> Result<Option<Arc<AdapterVersion>>, ServeError> {
    if model == state.inner.base_name || model == "base" {
        return Ok(None);
    }
    state
        .inner
        .registry
        .snapshot()
        .resolve(model)
        .map(Some)
        .ok_or_else(|| ServeError::NotFound(format!("The model `{model}` does not exist.")))
}

/// A validated, queued request: the receiver of its events and what the response needs.
struct Started {
    rx: mpsc::UnboundedReceiver<Event>,
    model_tag: String,
    header: String,
    prompt_tokens: usize,
    n: usize,
    /// The scored prompt, when `prompt_logprobs` was asked for.
    prompt_scores: Option<oneshot::Receiver<Vec<PromptToken>>>,
}

impl Started {
    /// `prompt_logprobs` for the response body (`None` when not asked for).
    async fn prompt_logprobs(&mut self, tok: &Tokenizer) -> Result<Option<Value>, ServeError> {
        let Some(rx) = self.prompt_scores.take() else {
            return Ok(None);
        };
        let scored = rx.await.map_err(|_| ServeError::Unavailable)?;
        Ok(Some(openai::prompt_logprobs_body(
            &scored,
            &token_text(tok),
        )))
    }
}

fn start_job(
    state: &ServeState,
    req: &RawRequest,
    knobs: &openai::Knobs,
    prompt_text: &str,
    grammar: Option<crate::grammar::Node>,
    top_logprobs: usize,
) -> Result<Started, ServeError> {
    let adapter = resolve_model(state, &req.model)?;
    let prompt = hindsight_model::encode(&state.inner.tokenizer, prompt_text)?;
    if prompt.is_empty() {
        return Err(ServeError::invalid(
            "prompt",
            "the prompt encodes to no tokens",
        ));
    }
    let room = state.inner.max_context.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ServeError::invalid(
            "messages",
            format!(
                "the prompt has {} tokens, the model's context is {}",
                prompt.len(),
                state.inner.max_context
            ),
        ));
    }
    let max_tokens = match knobs.max_tokens {
        Some(m) if m > room => {
            return Err(ServeError::invalid(
                "max_tokens",
                format!(
                    "prompt ({} tokens) + max_tokens ({m}) exceeds the context of {}",
                    prompt.len(),
                    state.inner.max_context
                ),
            ))
        }
        Some(m) => m,
        None => state.inner.default_max_tokens.min(room),
    };
    let (model_tag, header) = match &adapter {
        Some(a) => (a.tag(), a.tag()),
        None => (state.inner.base_name.clone(), "base".to_string()),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_tokens = prompt.len();
    let (prompt_logprobs, prompt_scores) = match knobs.prompt_logprobs {
        Some(k) => {
            let (tx, rx) = oneshot::channel();
            (Some((k, tx)), Some(rx))
        }
        None => (None, None),
    };
    state.inner.engine.submit(Job {
        prompt,
        adapter,
        params: JobParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: knobs.temperature,
                top_p: knobs.top_p,
                top_logprobs,
            },
            seed: knobs.seed.unwrap_or_else(rand::random),
            n: knobs.n,
            stop: knobs.stop.clone(),
            grammar,
        },
        events: tx,
        prompt_logprobs,
    })?;
    Ok(Started {
        rx,
        model_tag,
        header,
        prompt_tokens,
        n: knobs.n,
        prompt_scores,
    })
}

/// Waits for every choice to finish.
async fn collect(started: &mut Started) -> Result<Vec<ChoiceOutput>, ServeError> {
    let mut out = vec![ChoiceOutput::default(); started.n];
    let mut open = started.n;
    while open > 0 {
        match started.rx.recv().await {
            Some(Event::Token { index, pick, delta }) => {
                if let Some(c) = out.get_mut(index) {
                    c.text.push_str(&delta);
                    c.picks.push(pick);
                }
            }
            Some(Event::Finished { index, reason, .. }) => {
                if let Some(c) = out.get_mut(index) {
                    if c.finish.is_none() {
                        open -= 1;
                    }
                    c.finish = Some(reason);
                }
            }
            None => return Err(ServeError::Unavailable),
        }
    }
    Ok(out)
}

fn token_text(tok: &Tokenizer) -> impl Fn(u32) -> String + '_ {
    move |id| tok.decode(&[id], false).unwrap_or_default()
}

fn with_adapter_header(mut resp: Response, header: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(header) {
        resp.headers_mut().insert(ADAPTER_HEADER, v);
    }
    resp
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn chat_completions(
    State(state): State<ServeState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ServeError> {
    let req = openai::parse_body(&body)?;
    let knobs = req.knobs(true)?;
    let template = state.inner.template.as_ref().ok_or_else(|| {
        ServeError::invalid(
            "messages",
            "the model has no chat template; use /v1/completions",
        )
    })?;
    let prompt = openai::chat_prompt(&req, template)?;
    let behaviour = knobs.logprobs || wants_behaviour(&headers);
    let mut started = start_job(
        &state,
        &req,
        &knobs,
        &prompt.text,
        prompt.grammar.clone(),
        knobs.top_logprobs,
    )?;
    let id = format!("chatcmpl-{}", uuid::Uuid::now_v7().simple());
    let created = now_s();
    if knobs.stream {
        let header = started.header.clone();
        let sse = chat_stream(state, started, prompt.tools, behaviour, knobs, id, created);
        return Ok(with_adapter_header(sse.into_response(), &header));
    }
    let choices = collect(&mut started).await?;
    let tt = token_text(&state.inner.tokenizer);
    let mut completion = 0;
    let body_choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            completion += c.picks.len();
            let (content, calls) = if prompt.tools == ToolMode::None {
                (Some(c.text.clone()), vec![])
            } else {
                openai::parse_tool_calls(&c.text)
            };
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls.clone());
            }
            let logprobs = if behaviour {
                json!({"content": c.picks.iter().map(|p| openai::chat_logprob_entry(p, &tt, knobs.top_logprobs > 0)).collect::<Vec<_>>()})
            } else {
                Value::Null
            };
            json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": openai::finish_str(c, !calls.is_empty())})
        })
        .collect();
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": started.model_tag,
        "system_fingerprint": "hindsight-serve",
        "choices": body_choices,
        "usage": usage(started.prompt_tokens, completion),
    });
    if let Some(scored) = started.prompt_logprobs(&state.inner.tokenizer).await? {
        body["prompt_logprobs"] = scored;
    }
    Ok(with_adapter_header(
        Json(body).into_response(),
        &started.header,
    ))
}

fn sse_json(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

#[allow(clippy::too_many_arguments)]
fn chat_stream(
    state: ServeState,
    mut started: Started,
    tools: ToolMode,
    behaviour: bool,
    knobs: openai::Knobs,
    id: String,
    created: u64,
) -> Sse<impl futures::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let (tx, rx) = mpsc::unbounded_channel::<SseEvent>();
    tokio::spawn(async move {
        let tt = token_text(&state.inner.tokenizer);
        let chunk = |choices: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created,
                   "model": started.model_tag, "system_fingerprint": "hindsight-serve", "choices": choices})
        };
        for i in 0..started.n {
            let first = chunk(
                json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            );
            if tx.send(sse_json(&first)).is_err() {
                return;
            }
        }
        // With tools, the text is held until the end to be parsed into tool calls.
        let buffer = tools != ToolMode::None;
        let mut held = vec![ChoiceOutput::default(); started.n];
        let mut open = started.n;
        let mut completion = 0;
        while open > 0 {
            let Some(ev) = started.rx.recv().await else {
                break;
            };
            let msg = match ev {
                Event::Token { index, pick, delta } => {
                    completion += 1;
                    if buffer {
                        if let Some(h) = held.get_mut(index) {
                            h.text.push_str(&delta);
                            h.picks.push(pick);
                        }
                        continue;
                    }
                    let lp = if behaviour {
                        json!({"content": [openai::chat_logprob_entry(&pick, &tt, knobs.top_logprobs > 0)]})
                    } else {
                        Value::Null
                    };
                    chunk(
                        json!([{"index": index, "delta": {"content": delta}, "logprobs": lp, "finish_reason": null}]),
                    )
                }
                Event::Finished { index, reason, .. } => {
                    open -= 1;
                    let mut finish = reason.as_str();
                    let mut delta = json!({});
                    let mut lp = Value::Null;
                    if buffer {
                        if let Some(h) = held.get_mut(index) {
                            h.finish = Some(reason);
                            let (content, calls) = openai::parse_tool_calls(&h.text);
                            if !calls.is_empty() {
                                finish = "tool_calls";
                                let calls: Vec<Value> = calls
                                    .into_iter()
                                    .enumerate()
                                    .map(|(k, mut c)| {
                                        c["index"] = json!(k);
                                        c
                                    })
                                    .collect();
                                delta = json!({"content": content, "tool_calls": calls});
                            } else {
                                delta = json!({"content": content.unwrap_or_default()});
                            }
                            if behaviour {
                                lp = json!({"content": h.picks.iter().map(|p| openai::chat_logprob_entry(p, &tt, knobs.top_logprobs > 0)).collect::<Vec<_>>()});
                            }
                        }
                    }
                    chunk(
                        json!([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]),
                    )
                }
            };
            if tx.send(sse_json(&msg)).is_err() {
                return;
            }
        }
        if knobs.include_usage {
            let mut u = chunk(json!([]));
            u["usage"] = usage(started.prompt_tokens, completion);
            let _ = tx.send(sse_json(&u));
        }
        let _ = tx.send(SseEvent::default().data("[DONE]"));
    });
    Sse::new(UnboundedReceiverStream::new(rx).map(Ok)).keep_alive(KeepAlive::default())
}

fn completion_logprobs(picks: &[Pick], tt: &dyn Fn(u32) -> String, top: usize) -> Value {
    let tokens: Vec<String> = picks.iter().map(|p| tt(p.id)).collect();
    let mut offset = 0;
    let offsets: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let o = offset;
            offset += t.len();
            o
        })
        .collect();
    json!({
        "tokens": tokens,
        "token_logprobs": picks.iter().map(|p| p.logprob).collect::<Vec<_>>(),
        "token_ids": picks.iter().map(|p| p.id).collect::<Vec<_>>(),
        "top_logprobs": if top > 0 {
            json!(picks.iter().map(|p| p.top.iter().map(|(id, lp)| (tt(*id), json!(lp))).collect::<serde_json::Map<String, Value>>()).collect::<Vec<_>>())
        } else { Value::Null },
        "text_offset": offsets,
    })
}

use crate::sampler::Pick;

async fn completions(
    State(state): State<ServeState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ServeError> {
    let req = openai::parse_body(&body)?;
    let knobs = req.knobs(false)?;
    let prompt = openai::completion_prompt(&req)?;
    let grammar = openai::response_format_grammar(&req)?;
    let behaviour = knobs.logprobs || wants_behaviour(&headers);
    let mut started = start_job(&state, &req, &knobs, &prompt, grammar, knobs.top_logprobs)?;
    let id = format!("cmpl-{}", uuid::Uuid::now_v7().simple());
    let created = now_s();
    if knobs.stream {
        let (tx, rx) = mpsc::unbounded_channel::<SseEvent>();
        let header = started.header.clone();
        let st = state.clone();
        tokio::spawn(async move {
            let tt = token_text(&st.inner.tokenizer);
            let mut open = started.n;
            let mut completion = 0;
            while open > 0 {
                let Some(ev) = started.rx.recv().await else {
                    break;
                };
                let (index, text, lp, finish) = match ev {
                    Event::Token { index, pick, delta } => {
                        completion += 1;
                        let lp = if behaviour {
                            completion_logprobs(&[pick], &tt, knobs.top_logprobs)
                        } else {
                            Value::Null
                        };
                        (index, delta, lp, Value::Null)
                    }
                    Event::Finished { index, reason, .. } => {
                        open -= 1;
                        (index, String::new(), Value::Null, json!(reason.as_str()))
                    }
                };
                let msg = json!({"id": id, "object": "text_completion", "created": created, "model": started.model_tag,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]});
                if tx.send(sse_json(&msg)).is_err() {
                    return;
                }
            }
            if knobs.include_usage {
                let msg = json!({"id": id, "object": "text_completion", "created": created, "model": started.model_tag,
                    "choices": [], "usage": usage(started.prompt_tokens, completion)});
                let _ = tx.send(sse_json(&msg));
            }
            let _ = tx.send(SseEvent::default().data("[DONE]"));
        });
        let sse = Sse::new(UnboundedReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>))
            .keep_alive(KeepAlive::default());
        return Ok(with_adapter_header(sse.into_response(), &header));
    }
    let choices = collect(&mut started).await?;
    let tt = token_text(&state.inner.tokenizer);
    let completion: usize = choices.iter().map(|c| c.picks.len()).sum();
    let mut body = json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": started.model_tag,
        "choices": choices.iter().enumerate().map(|(i, c)| json!({
            "index": i,
            "text": c.text,
            "logprobs": if behaviour { completion_logprobs(&c.picks, &tt, knobs.top_logprobs) } else { Value::Null },
            "finish_reason": c.finish.unwrap_or(FinishReason::Error).as_str(),
        })).collect::<Vec<_>>(),
        "usage": usage(started.prompt_tokens, completion),
    });
    if let Some(scored) = started.prompt_logprobs(&state.inner.tokenizer).await? {
        body["prompt_logprobs"] = scored;
    }
    Ok(with_adapter_header(
        Json(body).into_response(),
        &started.header,
    ))
}

async fn models(State(state): State<ServeState>) -> Json<Value> {
    let inner = &state.inner;
    let mut data = vec![json!({
        "id": inner.base_name, "object": "model", "created": inner.created,
        "owned_by": "hindsight", "root": inner.model_path, "parent": null,
    })];
    let table = inner.registry.snapshot();
    for a in table.current() {
        data.push(json!({
            "id": a.name, "object": "model", "created": a.created_ms / 1000, "owned_by": "hindsight",
            "root": a.path.display().to_string(), "parent": inner.base_name,
            "version": a.version, "sha256": a.sha256,
        }));
    }
    for a in table.all() {
        data.push(json!({
            "id": a.tag(), "object": "model", "created": a.created_ms / 1000, "owned_by": "hindsight",
            "root": a.path.display().to_string(), "parent": inner.base_name,
            "version": a.version, "sha256": a.sha256,
        }));
    }
    Json(json!({"object": "list", "data": data}))
}

fn str_field(v: &Value, key: &str) -> Result<String, ServeError> {
    v.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| ServeError::invalid(key, format!("{key} is required")))
}

async fn load_adapter(
    State(state): State<ServeState>,
    body: Bytes,
) -> Result<Response, ServeError> {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ServeError::invalid("body", format!("invalid JSON body: {e}")))?;
    let req = LoadRequest {
        name: str_field(&v, "lora_name")?,
        path: PathBuf::from(str_field(&v, "lora_path")?),
        load_inplace: v
            .get("load_inplace")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        sha256: v.get("sha256").and_then(Value::as_str).map(str::to_string),
    };
    let st = state.clone();
    let loaded = tokio::task::spawn_blocking(move || st.registry().load(&req))
        .await
        .map_err(|_| ServeError::Unavailable)??;
    let resp = (
        StatusCode::OK,
        format!(
            "Success: LoRA adapter '{}' added successfully.",
            loaded.name
        ),
    )
        .into_response();
    Ok(with_adapter_header(resp, &loaded.tag()))
}

async fn unload_adapter(
    State(state): State<ServeState>,
    body: Bytes,
) -> Result<Response, ServeError> {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ServeError::invalid("body", format!("invalid JSON body: {e}")))?;
    let name = str_field(&v, "lora_name")?;
    state.registry().unload(&name)?;
    Ok((
        StatusCode::OK,
        format!("Success: LoRA adapter '{name}' removed successfully."),
    )
        .into_response())
}
