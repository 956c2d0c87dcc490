use super::*;

fn cfg() -> FeedbackConfig {
    FeedbackConfig::default()
}

fn err(v: Value) -> ApiError {
    parse_event(&cfg(), &v, "", 0).unwrap_err()
}

#[test]
fn every_kind_parses() {
    let id = Uuid::now_v7().to_string();
    for (kind, value) in [
        ("thumbs", json!(true)),
        ("score", json!(0.5)),
        ("comment", json!("nice")),
        ("correction", json!("better")),
        (
            "correction",
            json!({"content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        ),
        ("tool_outcome", json!({"success": false, "detail": "404"})),
    ] {
        let mut ev = json!({"interaction_id": id, "kind": kind, "value": value});
        if kind == "score" {
            ev["metric"] = json!("quality");
        }
        let rec = parse_event(&cfg(), &ev, "", 0).unwrap();
        assert_eq!(rec.value.kind(), kind);
    }
}

#[test]
fn rejections_name_the_field() {
    let id = Uuid::now_v7().to_string();
    assert_eq!(
        err(json!({"kind": "thumbs", "value": true})).field,
        "interaction_id"
    );
    assert_eq!(
        err(json!({"interaction_id": "x", "kind": "thumbs", "value": true})).field,
        "interaction_id"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "thumbs", "value": 1})).field,
        "value"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "score", "value": 2, "metric": "quality"})).field,
        "value"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "score", "value": 0.2, "metric": "nope"})).field,
        "metric"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "score", "value": 0.2})).field,
        "metric"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "thumbs", "value": true, "extra": 1})).field,
        "extra"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "bad"})).field,
        "kind"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "thumbs", "value": true, "tags": [1]})).field,
        "tags[0]"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "comment", "value": "x".repeat(20000)})).field,
        "value"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "tool_outcome", "value": {"success": "yes"}}))
            .field,
        "value.success"
    );
    assert_eq!(
        err(json!({"interaction_id": id, "kind": "retraction"})).field,
        "retracts"
    );
    assert_eq!(err(json!([1])).field, "body");
}
