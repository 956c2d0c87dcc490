//! Tickets as eval items (`hindsight eval` JSONL): the request the agent gets, the SOP's
//! decision as the expected object, the fixtures replayed for tool calls.

use std::collections::BTreeMap;

use hindsight_eval::{canonical_arguments, EvalItem, ScorerKind};
use serde_json::{json, Value};

use super::prompt::{messages, response_format, tools, PromptOptions, Variant};
use super::sop::Sop;
use super::tools::lookup;
use super::world::{Split, Ticket, World};

/// The eval item for one ticket under the default SOP.
pub fn eval_item(world: &World, ticket: &Ticket, options: PromptOptions) -> EvalItem {
    eval_item_under(world, ticket, options, &Sop::default())
}

/// The eval item for one ticket, its expected decision under `sop`.
pub fn eval_item_under(
    world: &World,
    ticket: &Ticket,
    options: PromptOptions,
    sop: &Sop,
) -> EvalItem {
    let resolution = sop.resolve(ticket);
    let (tools, tool_replay) = match options.variant {
        Variant::Single => (None, None),
        Variant::Multi => {
            let order_args = json!({"order_id": ticket.order.order_id}).to_string();
            let customer_args = json!({"customer_id": ticket.customer.customer_id}).to_string();
            let mut replay = BTreeMap::new();
            replay.insert(
                "lookup_order".to_string(),
                BTreeMap::from([(
                    canonical_arguments(&order_args),
                    lookup(world, ticket, "lookup_order", &order_args),
                )]),
            );
            replay.insert(
                "lookup_customer".to_string(),
                BTreeMap::from([(
                    canonical_arguments(&customer_args),
                    lookup(world, ticket, "lookup_customer", &customer_args),
                )]),
            );
            (Some(tools()), Some(replay))
        }
    };
    EvalItem {
        id: ticket.ticket_id.clone(),
        messages: messages(ticket, options),
        tools,
        response_format: options.response_format.then(response_format),
        tool_replay,
        scorer: ScorerKind::JsonExact,
        expected: resolution.decision.to_json(),
        metadata: Some(json!({
            "split": ticket.split,
            "issue": ticket.issue,
            "rules": {
                "department": resolution.department_rule,
                "priority": resolution.priority_rule,
                "refund": resolution.refund_rule,
            },
        })),
    }
}

/// The first `n` tickets of `split` as eval items.
pub fn eval_items(world: &World, split: Split, n: usize, options: PromptOptions) -> Vec<EvalItem> {
    eval_items_under(world, split, n, options, &Sop::default())
}

/// The first `n` tickets of `split` as eval items, their expected decisions under `sop`.
pub fn eval_items_under(
    world: &World,
    split: Split,
    n: usize,
    options: PromptOptions,
    sop: &Sop,
) -> Vec<EvalItem> {
    world
        .tickets(split, n)
        .iter()
        .map(|t| eval_item_under(world, t, options, sop))
        .collect()
}

/// The metadata's rule names, for reports.
pub fn rules_of(item: &EvalItem) -> Vec<String> {
    let rules = item
        .metadata
        .as_ref()
        .map(|m| m["rules"].clone())
        .unwrap_or(Value::Null);
    ["department", "priority", "refund"]
        .iter()
        .filter_map(|f| rules[*f].as_str().map(str::to_string))
        .collect()
}
