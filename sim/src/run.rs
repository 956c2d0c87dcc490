//! `hindsight-sim run`: drives production-like traffic through the proxy. Each episode
//! takes the next train ticket, talks to the agent endpoint (tool calls answered from the
//! fixtures, failures injected), judges the final answer against the SOP and, after a delay,
//! sends the simulated user's feedback through the webhook targeting the answer's interaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hindsight_eval::{extract_json_answer, ChatClient, Unparseable};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::error::EnvError;
use super::prompt::{messages, response_format, tools, PromptOptions, Variant};
use super::sop::Sop;
use super::tools::ToolBox;
use super::user::{react, Reaction, UserConfig};
use super::webhook::{feedback_events, FeedbackSender, Target};
use super::world::{Split, World};
use hindsight_core::now_ms;

/// Where and how feedback is sent.
#[derive(Debug, Clone)]
pub struct FeedbackConfig {
    /// Base URL of the webhook (the proxy, or `hindsight feedback`).
    pub endpoint: String,
    /// Signing secret; unsigned when `None`.
    pub secret: Option<String>,
    /// Delay between the answer and its feedback, in milliseconds.
    pub delay_ms: u64,
    /// Send the feedback in episode order: an episode's as soon as it and every earlier episode
    /// of the run are answered (`delay_ms` is then unused). With several episodes in flight,
    /// feedback otherwise arrives in the order the answers finish, which follows the server's
    /// timing; in order, the joined episodes (one partition) and so a learner's training order
    /// are the same on every run of a seed, and a learner still trains while later episodes are
    /// being answered.
    pub in_episode_order: bool,
}

/// Settings of `env run`.
#[derive(Debug, Clone)]
pub struct EnvRunConfig {
    /// Agent API base (normally the proxy), e.g. `http://127.0.0.1:8080/v1`.
    pub agent_endpoint: String,
    /// Model name sent.
    pub model: String,
    /// Bearer token, if needed.
    pub api_key: Option<String>,
    /// Episodes to run.
    pub episodes: u64,
    /// Index of the first episode (and train ticket): a run can continue where another
    /// stopped, so successive runs see new tickets.
    pub first_episode: u64,
    /// Episodes started per second.
    pub rate_per_s: f64,
    /// Episodes in flight at most.
    pub concurrency: usize,
    /// World seed.
    pub seed: u64,
    /// Prompt options.
    pub options: PromptOptions,
    /// Share of tool calls that fail.
    pub tool_failure_rate: f64,
    /// Model calls per episode at most.
    pub max_turns: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Per-request timeout, milliseconds.
    pub timeout_ms: u64,
    /// Prefix of episode ids (`<run_id>-<episode>`), so reruns never collide.
    pub run_id: String,
    /// Feedback target; no feedback when `None`.
    pub feedback: Option<FeedbackConfig>,
    /// The simulated user.
    pub user: UserConfig,
    /// The SOP the user judges answers by (the default unless a scenario changes a rule).
    pub sop: Sop,
}

impl EnvRunConfig {
    /// Defaults for an agent endpoint and model: 20 episodes at 2/s, 4 in flight, seed 0,
    /// single-turn, 10% tool failures, 6 turns, temperature 0.7.
    pub fn new(agent_endpoint: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            agent_endpoint: agent_endpoint.into(),
            model: model.into(),
            api_key: None,
            episodes: 20,
            first_episode: 0,
            rate_per_s: 2.0,
            concurrency: 4,
            seed: 0,
            options: PromptOptions::default(),
            tool_failure_rate: 0.1,
            max_turns: 6,
            temperature: 0.7,
            timeout_ms: 120_000,
            run_id: format!("bench-{}", now_ms()),
            feedback: None,
            user: UserConfig::default(),
            sop: Sop::default(),
        }
    }
}

/// What happened in one episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeOutcome {
    /// Episode number in this run.
    pub episode: u64,
    /// Episode id sent as `x-hindsight-episode`.
    pub episode_id: String,
    /// The ticket.
    pub ticket_id: String,
    /// Interaction ids returned by the proxy, in order.
    pub interaction_ids: Vec<String>,
    /// Adapter that produced the final answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// Model calls.
    pub turns: usize,
    /// Tool calls answered.
    pub tool_calls: u64,
    /// Tool calls that failed by injection.
    pub tool_failures: u64,
    /// The final answer's JSON, when parseable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Value>,
    /// Why the answer was not parseable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unparseable: Option<Unparseable>,
    /// Whether the answer matched the SOP on every field.
    pub correct: bool,
    /// The simulated user's reaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reaction: Option<Reaction>,
    /// Feedback ids returned by the webhook.
    pub feedback_ids: Vec<String>,
    /// Why feedback could not be sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback_error: Option<String>,
    /// Why the episode failed (agent unreachable …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Totals of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvRunSummary {
    /// Episode id prefix.
    pub run_id: String,
    /// World seed.
    pub seed: u64,
    /// Episodes run.
    pub episodes: u64,
    /// Episodes that failed outright.
    pub failed: u64,
    /// Share of completed episodes answered exactly right.
    pub exact_match: f64,
    /// Feedback events accepted by the webhook.
    pub feedback_events: u64,
    /// Episodes whose feedback could not be sent.
    pub feedback_failures: u64,
    /// Reactions that were deliberately noisy.
    pub noisy_reactions: u64,
    /// Tool calls / injected failures.
    pub tool_calls: u64,
    /// Injected tool failures.
    pub tool_failures: u64,
    /// Wall time, ms.
    pub duration_ms: u64,
    /// Every episode.
    pub outcomes: Vec<EpisodeOutcome>,
}

/// Runs the episodes and waits for all their feedback.
pub async fn run_env(cfg: EnvRunConfig) -> Result<EnvRunSummary, EnvError> {
    if !(cfg.rate_per_s.is_finite() && cfg.rate_per_s > 0.0) {
        return Err(EnvError::Config("rate must be > 0".into()));
    }
    for (name, rate) in [
        ("tool failure rate", cfg.tool_failure_rate),
        ("noise rate", cfg.user.noise_rate),
        ("correction rate", cfg.user.correction_rate),
        ("thanks rate", cfg.user.thanks_rate),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            return Err(EnvError::Config(format!(
                "{name} must be in [0, 1], got {rate}"
            )));
        }
    }
    if cfg.concurrency == 0 || cfg.max_turns == 0 {
        return Err(EnvError::Config(
            "concurrency and max turns must be >= 1".into(),
        ));
    }
    let client = ChatClient::new(
        &cfg.agent_endpoint,
        cfg.api_key.as_deref(),
        cfg.timeout_ms,
        3,
        &[],
    )?;
    let sender = match &cfg.feedback {
        Some(f) => Some(FeedbackSender::new(
            &f.endpoint,
            f.secret.clone(),
            cfg.timeout_ms,
        )?),
        None => None,
    };
    let world = World::new(cfg.seed);
    let cfg = Arc::new(cfg);
    let permits = Arc::new(Semaphore::new(cfg.concurrency));
    let started = Instant::now();
    let mut interval = tokio::time::interval(Duration::from_secs_f64(1.0 / cfg.rate_per_s));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = JoinSet::new();
    // Feedback in episode order, from here rather than from each episode's task.
    let in_order = cfg.feedback.as_ref().is_some_and(|f| f.in_episode_order);
    let mut order = InOrder::new(cfg.first_episode);
    let mut indices = world
        .ticket_indices(Split::Train)
        .skip(cfg.first_episode as usize);
    for episode in cfg.first_episode..cfg.first_episode + cfg.episodes {
        interval.tick().await;
        let Some(index) = indices.next() else { break };
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| EnvError::Config(e.to_string()))?;
        let (task_cfg, client, task_sender) = (cfg.clone(), client.clone(), sender.clone());
        tasks.spawn(async move {
            let cfg = task_cfg;
            let mut outcome = run_episode(&cfg, &client, world, episode, index).await;
            drop(permit);
            if let (Some(sender), Some(fb), false) = (&task_sender, &cfg.feedback, in_order) {
                tokio::time::sleep(Duration::from_millis(fb.delay_ms)).await;
                send_feedback(sender, &world, index, &mut outcome).await;
            }
            (outcome, index)
        });
        while let Some(joined) = tasks.try_join_next() {
            order.take(joined)?;
        }
        if let (Some(sender), true) = (&sender, in_order) {
            order.send_ready(sender, &world).await;
        }
    }
    while let Some(joined) = tasks.join_next().await {
        order.take(joined)?;
        if let (Some(sender), true) = (&sender, in_order) {
            order.send_ready(sender, &world).await;
        }
    }
    let outcomes = order.into_outcomes();
    let failed = outcomes.iter().filter(|o| o.error.is_some()).count() as u64;
    if failed > 0 && failed == outcomes.len() as u64 {
        let first = outcomes
            .iter()
            .find_map(|o| o.error.clone())
            .unwrap_or_default();
        return Err(EnvError::AllEpisodesFailed(first));
    }
    let completed = outcomes.iter().filter(|o| o.error.is_none()).count().max(1) as f64;
    Ok(EnvRunSummary {
        run_id: cfg.run_id.clone(),
        seed: cfg.seed,
        episodes: outcomes.len() as u64,
        failed,
        exact_match: outcomes.iter().filter(|o| o.correct).count() as f64 / completed,
        feedback_events: outcomes.iter().map(|o| o.feedback_ids.len() as u64).sum(),
        feedback_failures: outcomes
            .iter()
            .filter(|o| o.feedback_error.is_some())
            .count() as u64,
        noisy_reactions: outcomes
            .iter()
            .filter(|o| o.reaction.as_ref().is_some_and(|r| r.noisy))
            .count() as u64,
        tool_calls: outcomes.iter().map(|o| o.tool_calls).sum(),
        tool_failures: outcomes.iter().map(|o| o.tool_failures).sum(),
        duration_ms: started.elapsed().as_millis() as u64,
        outcomes,
    })
}

/// Finished episodes in episode order: `send_ready` sends the feedback of the answered prefix
/// (every episode up to the first one still in flight), so feedback goes out in episode order
/// while later episodes are still being answered.
struct InOrder {
    /// The first episode whose feedback is not sent yet.
    next: u64,
    /// Finished episodes by number, with their ticket index.
    done: std::collections::BTreeMap<u64, (EpisodeOutcome, u64)>,
}

impl InOrder {
    fn new(first: u64) -> Self {
        Self {
            next: first,
            done: Default::default(),
        }
    }

    fn take(
        &mut self,
        joined: Result<(EpisodeOutcome, u64), tokio::task::JoinError>,
    ) -> Result<(), EnvError> {
        let (outcome, index) =
            joined.map_err(|e| EnvError::Http(format!("episode task failed: {e}")))?;
        self.done.insert(outcome.episode, (outcome, index));
        Ok(())
    }

    async fn send_ready(&mut self, sender: &FeedbackSender, world: &World) {
        while let Some((outcome, index)) = self.done.get_mut(&self.next) {
            send_feedback(sender, world, *index, outcome).await;
            self.next += 1;
        }
    }

    /// Every outcome, in episode order.
    fn into_outcomes(self) -> Vec<EpisodeOutcome> {
        self.done.into_values().map(|(o, _)| o).collect()
    }
}

/// Sends the simulated user's reaction (if any) to the episode's last answer, or to the
/// episode when no answer was logged; records the feedback ids or the error in `outcome`.
async fn send_feedback(
    sender: &FeedbackSender,
    world: &World,
    index: u64,
    outcome: &mut EpisodeOutcome,
) {
    let Some(reaction) = &outcome.reaction else {
        return;
    };
    let target = match outcome.interaction_ids.last() {
        Some(id) => Target::Interaction(id.clone()),
        None => Target::Episode(outcome.episode_id.clone()),
    };
    let rater = world.ticket(index).customer.customer_id;
    let events = feedback_events(&target, reaction, &rater);
    let key = format!(
        "{}:{}",
        outcome.episode_id,
        outcome
            .interaction_ids
            .last()
            .map(String::as_str)
            .unwrap_or("-")
    );
    match sender.send(&events, &key).await {
        Ok(ids) => outcome.feedback_ids = ids,
        Err(e) => outcome.feedback_error = Some(e.to_string()),
    }
}

async fn run_episode(
    cfg: &EnvRunConfig,
    client: &ChatClient,
    world: World,
    episode: u64,
    index: u64,
) -> EpisodeOutcome {
    let ticket = world.ticket(index);
    let resolution = cfg.sop.resolve(&ticket);
    let episode_id = format!("{}-{episode}", cfg.run_id);
    let mut outcome = EpisodeOutcome {
        episode,
        episode_id: episode_id.clone(),
        ticket_id: ticket.ticket_id.clone(),
        interaction_ids: Vec::new(),
        adapter: None,
        turns: 0,
        tool_calls: 0,
        tool_failures: 0,
        answer: None,
        unparseable: None,
        correct: false,
        reaction: None,
        feedback_ids: Vec::new(),
        feedback_error: None,
        error: None,
    };
    let mut convo = messages(&ticket, cfg.options);
    let mut toolbox = ToolBox::new(world, ticket.clone(), episode, cfg.tool_failure_rate);
    let headers = [
        ("x-hindsight-episode", episode_id.clone()),
        ("x-hindsight-user", ticket.customer.customer_id.clone()),
    ];
    let mut final_content = None;
    for turn in 0..cfg.max_turns {
        let mut body = json!({
            "model": cfg.model,
            "messages": convo,
            "temperature": cfg.temperature,
            "seed": cfg.seed.wrapping_add(episode),
        });
        if cfg.options.variant == Variant::Multi {
            body["tools"] = json!(tools());
        }
        if cfg.options.response_format {
            body["response_format"] = response_format();
        }
        let response = match client.complete_with_headers(&body, &headers).await {
            Ok(r) => r,
            Err(e) => {
                outcome.error = Some(e.to_string());
                return outcome;
            }
        };
        outcome.turns = turn + 1;
        if let Some(id) = &response.interaction_id {
            outcome.interaction_ids.push(id.clone());
        }
        outcome.adapter = response.adapter.clone();
        let calls = response.tool_calls();
        if calls.is_empty() {
            final_content = Some(response.content());
            break;
        }
        convo.push(response.message().clone());
        for call in calls {
            let name = call["function"]["name"].as_str().unwrap_or_default();
            let args = call["function"]["arguments"].as_str().unwrap_or("{}");
            let (result, failed) = toolbox.call(name, args);
            outcome.tool_failures += u64::from(failed);
            convo.push(json!({
                "role": "tool",
                "tool_call_id": call["id"].as_str().unwrap_or_default(),
                "content": result,
            }));
        }
    }
    outcome.tool_calls = toolbox.calls();
    let parsed = match &final_content {
        Some(content) => extract_json_answer(content, cfg.options.response_format),
        None => Err(Unparseable::ToolTurnLimit),
    };
    let answer = parsed.as_ref().ok();
    outcome.unparseable = parsed.as_ref().err().copied();
    let reaction = react(&cfg.user, cfg.seed, index, &ticket, &resolution, answer);
    outcome.correct = reaction.correct;
    outcome.answer = answer.map(|a| Value::Object(a.clone()));
    outcome.reaction = Some(reaction);
    outcome
}
