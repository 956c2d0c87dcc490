//! `hindsight serve` in-process for the root tests that need the real model server (the eval
//! gate, the dense term's ratio on served tokens). Apart from `mod.rs` because the proxy crate's
//! tests include that file and do not depend on the serve crate.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

/// Starts `hindsight serve` in-process on 127.0.0.1:0; returns its API base and the shutdown trigger.
pub async fn start_serve(
    model: &std::path::Path,
    served_model_name: &str,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = hindsight_serve::ServeConfig {
        model: model.to_path_buf(),
        listen: addr,
        adapters: vec![],
        served_model_name: served_model_name.into(),
        engine: hindsight_serve::EngineConfig {
            queue_capacity: 64,
            max_active_sequences: 32,
            max_group_size: 16,
        },
        default_max_tokens: 32,
        keep_adapter_versions: 2,
        device: Default::default(),
        dtype: Default::default(),
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        hindsight_serve::run_serve(config, listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    let endpoint = format!("http://{addr}/v1");
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let up = client.get(format!("http://{addr}/health")).send().await;
        if up.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "serve did not come up in 120 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    (endpoint, tx)
}
