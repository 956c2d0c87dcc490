use super::*;

#[test]
fn clashing_client_options_are_refused() {
    let mut cfg = LogConfig::default();
    cfg.client_options.insert("acks".into(), "1".into());
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("client_options.acks"), "{err}");
}

#[test]
fn unknown_keys_are_refused() {
    let err = toml_like(r#"{"brokers":"x","spill_dirr":"y"}"#);
    assert!(err.contains("spill_dirr"), "{err}");
}

fn toml_like(json: &str) -> String {
    serde_json::from_str::<LogConfig>(json)
        .unwrap_err()
        .to_string()
}

#[test]
fn topic_names_follow_prefix() {
    let cfg = LogConfig {
        topic_prefix: "t1".into(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    assert_eq!(cfg.topics().get(Topic::Feedback), "t1.feedback");
    assert_eq!(cfg.topics().get(Topic::DeadLetter), "t1.deadletter");
}
