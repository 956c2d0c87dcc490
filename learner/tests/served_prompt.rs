//! The learner trains on exactly the prompt `hindsight serve` built: the contract between the
//! two crates, checked on the real default model.

use serde_json::json;

/// The learner trains on the prompt `hindsight serve` actually served: for a logged multi-turn
/// request with tools, a tool call and its result, the learner's context tokens are exactly the
/// tokens of serve's prompt (the default model's template has no native tools, so this covers
/// the tool block and the `<tool_call>` / `<tool_response>` text). `tool_choice: "none"` keeps
/// the tools out of both.
#[test]
fn the_learner_sees_the_prompt_serve_built() {
    use hindsight_feedback::{
        EpisodeContext, EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue,
    };
    use hindsight_learner::example::{build_example, ExampleConfig};
    use hindsight_model::{candle_core, default_model_path, encode, ModelBundle};

    let bundle = ModelBundle::load(
        &default_model_path(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let template = bundle.chat_template.as_ref().unwrap();
    assert!(
        !template.native_tools(),
        "the default template is expected to need the tool block"
    );
    let end = bundle.tokenizer.token_to_id("<|im_end|>").unwrap();
    for tool_choice in [None, Some(json!("auto")), Some(json!("none"))] {
        let mut request = json!({
            "model": "base",
            "messages": [
                {"role": "system", "content": "You resolve support tickets."},
                {"role": "user", "content": "Where is my order ORD-100066?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "lookup_order", "arguments": "{\"order_id\": \"ORD-100066\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"status\": \"delivered\"}"}
            ],
            "tools": [{"type": "function", "function": {"name": "lookup_order", "description": "Order record",
                "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]
        });
        if let Some(c) = &tool_choice {
            request["tool_choice"] = c.clone();
        }
        let raw = hindsight_serve::parse_body(request.to_string().as_bytes()).unwrap();
        let served = hindsight_serve::chat_prompt(&raw, template).unwrap().text;
        assert_eq!(
            served.contains("<tools>"),
            tool_choice != Some(json!("none")),
            "{served}"
        );
        assert!(served.contains("<tool_response>"), "{served}");

        // The same request as the joiner logs it, with a comment to learn from.
        let rec = EpisodeRecord::turn(
            "e",
            EpisodeContext {
                messages: request["messages"].clone(),
                tools: Some(request["tools"].clone()),
                tool_choice: tool_choice.clone(),
                model: Some("base".into()),
                ..Default::default()
            },
            Some(json!({"role": "assistant", "content": "It was delivered."})),
            vec![FeedbackRecord::new(
                FeedbackTarget::Episode("e".into()),
                FeedbackValue::Comment("Give the delivery date too.".into()),
                0,
            )],
        );
        let ex = build_example(
            &rec,
            &bundle.tokenizer,
            template,
            end,
            &ExampleConfig::default(),
        )
        .unwrap();
        assert_eq!(
            ex.context_ids,
            encode(&bundle.tokenizer, &served).unwrap(),
            "the learner's context differs from the served prompt (tool_choice {tool_choice:?})"
        );
    }
}
