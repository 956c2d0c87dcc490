//! The support agent of `examples/agent/agent.py`, in Rust on reqwest + serde_json: a tool-call
//! turn, then the answer, through the Hindsight proxy (base URL only; the proxy infers the
//! episode from the conversation), then signed feedback for the answer. Non-streaming.
//!
//! `main.rs` is the command line; `tests/examples.rs` calls [`run`] directly.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// What to run against.
#[derive(Debug, Clone)]
pub struct Options {
    /// The proxy's OpenAI base URL (`http://127.0.0.1:8080/v1`).
    pub base_url: String,
    /// Where `/hindsight/v1/feedback` lives (the proxy's origin).
    pub feedback_url: String,
    /// The webhook signing secret (`[feedback.signing] secrets`); `None` sends unsigned.
    pub secret: Option<String>,
    /// The model; `None`: the first one `/v1/models` lists.
    pub model: Option<String>,
    /// The customer's message.
    pub ticket: String,
    /// `max_tokens` of each call.
    pub max_tokens: u32,
}

/// The agent's tiny backend: orders and customers.
fn lookup_order(args: &Value) -> Value {
    let id = args["order_id"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_uppercase();
    match id.as_str() {
        "A-1001" => {
            json!({"order_id": id, "status": "shipped", "carrier": "DHL", "eta": "2 days", "customer": "C-7"})
        }
        "A-1002" => {
            json!({"order_id": id, "status": "processing", "eta": "5 days", "customer": "C-9"})
        }
        _ => json!({"error": format!("no order {id:?}")}),
    }
}

fn lookup_customer(args: &Value) -> Value {
    let id = args["customer_id"].as_str().unwrap_or_default();
    let email = args["email"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_lowercase();
    if id == "C-7" || email == "ana@example.com" {
        json!({"customer_id": "C-7", "name": "Ana", "tier": "gold"})
    } else {
        json!({"error": "no such customer"})
    }
}

fn run_tool(name: &str, arguments: &str) -> Value {
    let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
    match name {
        "lookup_order" => lookup_order(&args),
        "lookup_customer" => lookup_customer(&args),
        other => json!({"error": format!("unknown tool {other:?}")}),
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "lookup_order",
            "description": "Status, carrier and ETA of an order.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                           "required": ["order_id"]}}},
        {"type": "function", "function": {"name": "lookup_customer",
            "description": "A customer by id or email.",
            "parameters": {"type": "object", "properties": {"customer_id": {"type": "string"},
                                                             "email": {"type": "string"}}}}}
    ])
}

/// `v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`. The workspace's own signer is used
/// here; in your crate, with `hmac` and `sha2`:
/// `let mut m = Hmac::<Sha256>::new_from_slice(secret)?; m.update(format!("{ts}.").as_bytes());
/// m.update(body); hex::encode(m.finalize().into_bytes())`.
fn signature(secret: &str, ts: i64, body: &[u8]) -> String {
    let hex = hindsight_feedback::sign(&hindsight_feedback::Secret::new(secret), ts, body);
    format!("v1={hex}")
}

/// POSTs feedback events (a batch) signed with `secret`: (HTTP status, response body).
pub async fn post_feedback(
    client: &reqwest::Client,
    feedback_url: &str,
    secret: Option<&str>,
    events: &[Value],
) -> Result<(u16, Value)> {
    let body = serde_json::to_vec(&json!({ "events": events }))?;
    let url = format!(
        "{}/hindsight/v1/feedback/batch",
        feedback_url.trim_end_matches('/')
    );
    let mut req = client.post(&url).header("content-type", "application/json");
    if let Some(secret) = secret {
        let ts = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
        req = req
            .header("x-hindsight-timestamp", ts.to_string())
            .header("x-hindsight-signature", signature(secret, ts, &body));
    }
    let resp = req.body(body).send().await.with_context(|| url.clone())?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

/// One chat call: (x-hindsight-interaction-id, the assistant message).
async fn chat(client: &reqwest::Client, o: &Options, body: Value) -> Result<(String, Value)> {
    let url = format!("{}/chat/completions", o.base_url.trim_end_matches('/'));
    let resp = client
        .post(&url)
        .json(&body)
        .send()
        .await
        .with_context(|| url.clone())?;
    let id = resp
        .headers()
        .get("x-hindsight-interaction-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let status = resp.status();
    let v: Value = resp.json().await?;
    if !status.is_success() {
        bail!("{url}: {status}: {v}");
    }
    Ok((id, v["choices"][0]["message"].clone()))
}

/// Runs the agent once; the summary `main` prints.
pub async fn run(o: &Options) -> Result<Value> {
    let client = reqwest::Client::new();
    let model = match &o.model {
        Some(m) => m.clone(),
        None => {
            let list: Value = client
                .get(format!("{}/models", o.base_url.trim_end_matches('/')))
                .send()
                .await?
                .json()
                .await?;
            list["data"][0]["id"]
                .as_str()
                .context("no model listed")?
                .to_string()
        }
    };
    let mut messages = vec![
        json!({"role": "system", "content": "You are a support agent for an online shop. Look the order up with the tools, then answer the customer in one or two short sentences."}),
        json!({"role": "user", "content": o.ticket}),
    ];
    let mut turns = Vec::new();
    let mut tool_calls = Vec::new();

    // Turn 1: a tool call for sure (`tool_choice` names the function: guided decoding on
    // `hindsight serve`, honoured by OpenAI and vLLM too).
    let (id, msg) = chat(
        &client,
        o,
        json!({
            "model": model, "messages": messages, "tools": tools(), "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "lookup_order"}},
            "max_tokens": o.max_tokens,
        }),
    )
    .await?;
    turns.push(id);
    messages.push(msg.clone());
    for call in msg["tool_calls"].as_array().into_iter().flatten() {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        let args = call["function"]["arguments"].as_str().unwrap_or("{}");
        let result = run_tool(name, args);
        tool_calls.push(json!({"name": name, "arguments": args, "result": result}));
        messages.push(
            json!({"role": "tool", "tool_call_id": call["id"], "content": result.to_string()}),
        );
    }

    // Turn 2: the answer (the same conversation plus the tool results: the proxy continues
    // the episode).
    let (answer_id, msg) = chat(
        &client,
        o,
        json!({
            "model": model, "messages": messages, "tools": tools(), "tool_choice": "none",
            "temperature": 0, "max_tokens": o.max_tokens,
        }),
    )
    .await?;
    turns.push(answer_id.clone());
    let answer = msg["content"].as_str().unwrap_or_default().to_string();

    // The user's verdict on the answer: thumbs, plus a critique when it misses the status.
    let good = answer.to_lowercase().contains("shipped");
    let mut events = vec![
        json!({"interaction_id": answer_id, "kind": "thumbs", "value": good, "source": "agent-example-rust"}),
    ];
    if !good {
        events.push(
            json!({"interaction_id": answer_id, "kind": "comment", "source": "agent-example-rust",
                           "value": "My order has shipped; the answer should say so."}),
        );
    }
    let (status, response) =
        post_feedback(&client, &o.feedback_url, o.secret.as_deref(), &events).await?;
    Ok(json!({
        "model": model, "turns": turns, "tool_calls": tool_calls, "answer": answer,
        "answer_chars": answer.chars().count(), "answer_interaction_id": answer_id,
        "feedback": {"status": status, "thumbs": good, "response": response},
    }))
}
