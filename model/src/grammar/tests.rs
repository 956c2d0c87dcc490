use super::*;
use serde_json::json;

/// Re-parses the text of `v` keeping key order (json! sorts keys).
fn ordered(v: &Value) -> OJson {
    serde_json::from_str(&v.to_string()).unwrap()
}

#[test]
fn properties_follow_the_order_written_in_the_schema() {
    let schema: OJson = serde_json::from_str(
        r#"{"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}}}"#,
    )
    .unwrap();
    let mut s = JsonState::new(&compile_schema(&schema).unwrap());
    assert!(s.feed_str(r#"{"zeta": 3, "alpha": true}"#) && s.finished());
    let mut s = JsonState::new(&compile_schema(&schema).unwrap());
    assert!(!s.feed_str(r#"{"alpha""#));
}

fn accepts(schema: &Value, text: &str) -> (bool, bool) {
    let node = compile_schema(&ordered(schema)).unwrap();
    let mut s = JsonState::new(&node);
    let ok = s.feed_str(text);
    (ok, ok && s.finished())
}

#[test]
fn object_with_enum_string_number_array() {
    let schema: OJson = serde_json::from_str(
        r#"{"type": "object", "properties": {
        "color": {"enum": ["red", "green"]},
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}
    }}"#,
    )
    .unwrap();
    let run = |text: &str| {
        let mut s = JsonState::new(&compile_schema(&schema).unwrap());
        let ok = s.feed_str(text);
        (ok, ok && s.finished())
    };
    let good = r#"{"color": "green", "name": "a\"b", "age": -12, "score": 1.5e3, "ok": false, "tags": ["x", "y"]}"#;
    assert_eq!(run(good), (true, true));
    serde_json::from_str::<Value>(good).unwrap();
    assert!(!run(r#"{"color": "blue""#).0);
    assert!(!run(r#"{"color": "red", "name": "x", "age": 1.5"#).0);
    assert!(!run(r#"{"name""#).0, "properties come in schema order");
    let three =
        r#"{"color": "red", "name": "", "age": 0, "score": 0, "ok": true, "tags": ["a", "b", "#;
    assert!(!run(three).0, "maxItems");
    // A prefix is accepted but not finished.
    assert_eq!(run(r#"{"color": "re"#), (true, false));
}

#[test]
fn free_form_object_and_numbers_end_lazily() {
    let schema = json!({"type": "object"});
    let text = r#"{"a": [1, {"b": null}], "c": "d", "e": 10}"#;
    assert_eq!(accepts(&schema, text), (true, true));
    assert!(!accepts(&schema, "[").0);
    assert!(!accepts(&schema, r#"{"a": 01"#).0);
    assert!(
        !accepts(&schema, r#"{"a": 1e999"#).0,
        "exponents stay within f64"
    );
    assert_eq!(accepts(&json!({"type": "integer"}), "12"), (true, true));
}

#[test]
fn strings_reject_raw_control_characters_and_respect_max_length() {
    let s = json!({"type": "string", "maxLength": 3});
    assert!(!accepts(&s, "\"a\nb").0);
    assert_eq!(accepts(&s, "\"abc\""), (true, true));
    assert!(!accepts(&s, "\"abcd").0);
}

#[test]
fn unsupported_schemas_are_errors_that_name_the_problem() {
    let e = compile_schema(&ordered(&json!({"type": "tuple"}))).unwrap_err();
    assert!(e.0.contains("tuple"), "{e}");
}

#[test]
fn response_formats_compile_and_take_the_answers_key_order() {
    let rf = ordered(
        &json!({"type": "json_schema", "json_schema": {"name": "d", "schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}}}),
    );
    // serde_json sorted the keys; the served answer had them as the schema was written.
    let answer: OJson = serde_json::from_str(r#"{"b": true, "a": 1}"#).unwrap();
    let node = response_format_grammar(&with_answer_key_order(&rf, &answer))
        .unwrap()
        .unwrap();
    let mut st = JsonState::new(&node);
    assert!(st.feed_str(r#"{"b": true, "a": 1}"#) && st.finished());
    let node = response_format_grammar(&rf).unwrap().unwrap();
    assert!(!JsonState::new(&node).feed_str(r#"{"b""#));
    assert!(response_format_grammar(&ordered(&json!({"type": "text"})))
        .unwrap()
        .is_none());
    let e = response_format_grammar(&ordered(&json!({"type": "xml"}))).unwrap_err();
    assert!(e.0.contains("json_schema"), "{e}");
}

#[test]
fn choice_logprob_renormalises_over_the_allowed_tokens() {
    let logits = [2.0f32, 1.0, 0.0, 5.0, -100.0];
    let allowed = |i: u32| i != 3;
    let want = 2.0 - (2f64.exp() + 1f64.exp() + 1.0).ln();
    assert!((choice_logprob(&logits, 0, &allowed) - want).abs() < 1e-9);
    // The full-vocabulary log-probability is far lower: token 3 dominates it.
    let full = 2.0 - logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
    assert!(full < want - 2.5, "{full} vs {want}");
    // A forced token (the only one allowed) is a certain decision.
    assert_eq!(choice_logprob(&logits, 1, &|i| i == 1), 0.0);
    // A non-greedy choice counts the allowed tokens above it too.
    let want = 1.0 - (2f64.exp() + 1f64.exp()).ln();
    assert!((choice_logprob(&logits, 1, &|i| i <= 1) - want).abs() < 1e-9);
    assert_eq!(choice_logprob(&logits, 9, &allowed), f64::NEG_INFINITY);
}

#[test]
fn object_value_spans_find_each_members_value() {
    let doc = " {\"a\": \"x,}\\\"y\" , \"b\":{\"c\":[1,\"]\"]},\"d\":-1.5e3,\"e\":null}\n";
    let spans = object_value_spans(doc).unwrap();
    let got: Vec<(&str, &str)> = spans
        .iter()
        .map(|(k, r)| (k.as_str(), &doc[r.clone()]))
        .collect();
    assert_eq!(
        got,
        [
            ("a", "\"x,}\\\"y\""),
            ("b", "{\"c\":[1,\"]\"]}"),
            ("d", "-1.5e3"),
            ("e", "null")
        ]
    );
    assert_eq!(object_value_spans("{}"), Some(vec![]));
    for not_an_object in ["[1]", "\"a\"", "{\"a\": 1", "{\"a\": 1} x", ""] {
        assert_eq!(object_value_spans(not_an_object), None, "{not_an_object}");
    }
}

mod spans_prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any object, compact or pretty: every span parses back to its member's value.
        #[test]
        fn object_value_spans_round_trip(
            members in proptest::collection::btree_map(
                "[a-z\"\\\\ ,:{}]{0,6}",
                prop_oneof![
                    any::<i64>().prop_map(Value::from),
                    "[a-z\"\\\\ ,:{}\\[\\]]{0,8}".prop_map(Value::from),
                    any::<bool>().prop_map(Value::from),
                    proptest::collection::vec(proptest::prelude::any::<i32>(), 0..3)
                        .prop_map(|v| json!({"n": v})),
                ],
                0..5,
            ),
            pretty in any::<bool>(),
        ) {
            let obj = Value::Object(members.clone().into_iter().collect());
            let doc = if pretty {
                serde_json::to_string_pretty(&obj).unwrap()
            } else {
                obj.to_string()
            };
            let spans = object_value_spans(&doc).unwrap();
            prop_assert_eq!(spans.len(), members.len());
            for (key, range) in spans {
                let v: Value = serde_json::from_str(&doc[range]).unwrap();
                prop_assert_eq!(Some(&v), members.get(&key));
            }
        }
    }
}
