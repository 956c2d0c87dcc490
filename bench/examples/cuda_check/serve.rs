//! `hindsight serve` on the device, through its OpenAI API.

use super::*;

/// Starts `hindsight serve` on `device` (bf16 on a GPU) in-process, asks the sanity question
/// (plain and under a JSON schema), then measures 1 and 16 concurrent streams of 64 tokens.
pub(super) fn serve_check(r: &mut Report, model: PathBuf, device: &str) -> Result<Value> {
    use hindsight_serve::run_serve;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let raw = hindsight_serve::RawServeSection {
            model,
            listen_addr: addr.to_string(),
            served_model_name: Some("base".into()),
            default_max_tokens: 64,
            device: device.parse()?,
            dtype: if device == "cpu" { "f32" } else { "bf16" }.parse()?,
            ..Default::default()
        };
        let config = raw.validate()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(run_serve(config, listener, async {
            let _ = rx.await;
        }));
        let client = reqwest::Client::new();
        let base = format!("http://{addr}");
        let deadline = Instant::now() + std::time::Duration::from_secs(120);
        while !client
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            anyhow::ensure!(Instant::now() < deadline, "serve did not come up");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        let ask = |body: Value| {
            let client = client.clone();
            let url = format!("{base}/v1/chat/completions");
            async move {
                let resp = client.post(url).json(&body).send().await?;
                let status = resp.status();
                let v: Value = resp.json().await?;
                anyhow::ensure!(status.is_success(), "{status}: {v}");
                anyhow::Ok(v)
            }
        };
        let question = json!([{"role": "user", "content": "What is the capital of France?"}]);
        let v = ask(json!({"model": "base", "messages": question, "max_tokens": 24, "temperature": 0})).await?;
        let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
        println!("serve on {device}: {text:?}");
        r.check(&format!("serve on {device}: answers Paris"), f64::from(u8::from(text.contains("Paris"))), 1.0, true);
        let schema = json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Berlin"]}},
            "required": ["city"], "additionalProperties": false}}});
        let v = ask(json!({"model": "base", "messages": question, "max_tokens": 24, "temperature": 0, "response_format": schema})).await?;
        let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
        let parsed: Option<Value> = serde_json::from_str(&text).ok();
        println!("serve on {device}, json_schema: {text:?}");
        r.check(
            &format!("serve on {device}: guided JSON parses with an allowed city"),
            f64::from(u8::from(parsed.as_ref().and_then(|p| p["city"].as_str()).is_some_and(|c| ["Paris", "Lyon", "Berlin"].contains(&c)))),
            1.0,
            true,
        );
        let mut figures = serde_json::Map::new();
        for streams in [1usize, 16] {
            let t0 = Instant::now();
            let reqs = (0..streams).map(|i| {
                ask(json!({"model": "base", "max_tokens": 64, "temperature": 0.8, "seed": i,
                    "messages": [{"role": "user", "content": "Write a long story about a brave knight."}]}))
            });
            let outs = futures_join_all(reqs.collect()).await?;
            let tokens: u64 = outs.iter().map(|v| v["usage"]["completion_tokens"].as_u64().unwrap_or(0)).sum();
            let tps = tokens as f64 / t0.elapsed().as_secs_f64();
            println!("serve on {device}: {streams} concurrent streams, {tokens} tokens, {tps:.1} tokens/s");
            figures.insert(format!("streams_{streams}_tokens_per_s"), json!(tps));
        }
        let _ = tx.send(());
        let _ = server.await;
        anyhow::Ok(Value::Object(figures))
    })
}

/// Awaits every future concurrently (spawned on the runtime), failing on the first error.
async fn futures_join_all<F>(futs: Vec<F>) -> Result<Vec<Value>>
where
    F: std::future::Future<Output = Result<Value>> + Send + 'static,
{
    let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await??);
    }
    Ok(out)
}
