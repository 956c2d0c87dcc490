//! What the deployed agent is given: its system prompt, the decision schema, the tools and the
//! ticket as a user message, for the single-turn and the multi-turn (tool-calling) variant.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::sop::{rules_text, DEPARTMENTS, PRIORITIES, REFUNDS};
use super::world::Ticket;

/// How the ticket reaches the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Variant {
    /// Everything (ticket, order record, customer record) in one user message.
    Single,
    /// Only the ticket; the agent calls `lookup_order` / `lookup_customer` first.
    Multi,
}

/// Prompt options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptOptions {
    /// Single- or multi-turn.
    pub variant: Variant,
    /// Put the whole SOP in the system prompt (baseline (b)).
    pub with_rules: bool,
    /// Request the decision with `response_format` json_schema (as production agents do).
    /// Without it the agent is asked to wrap the JSON in `<final_output>` tags.
    pub response_format: bool,
}

impl Default for PromptOptions {
    fn default() -> Self {
        Self {
            variant: Variant::Single,
            with_rules: false,
            response_format: true,
        }
    }
}

/// The decision's JSON schema as an OpenAI `response_format`.
pub fn response_format() -> Value {
    json!({
        "type": "json_schema",
        "json_schema": {
            "name": "ticket_decision",
            "strict": true,
            "schema": {
                "type": "object",
                "properties": {
                    "department": {"type": "string", "enum": DEPARTMENTS},
                    "priority": {"type": "string", "enum": PRIORITIES},
                    "refund": {"type": "string", "enum": REFUNDS}
                },
                "required": ["department", "priority", "refund"],
                "additionalProperties": false
            }
        }
    })
}

/// The read-only tools of the multi-turn variant.
pub fn tools() -> Vec<Value> {
    vec![
        json!({
            "type": "function",
            "function": {
                "name": "lookup_order",
                "description": "Look up an order by its id (e.g. ORD-123456).",
                "parameters": {
                    "type": "object",
                    "properties": {"order_id": {"type": "string"}},
                    "required": ["order_id"]
                }
            }
        }),
        json!({
            "type": "function",
            "function": {
                "name": "lookup_customer",
                "description": "Look up a customer account by its id (e.g. C-10042).",
                "parameters": {
                    "type": "object",
                    "properties": {"customer_id": {"type": "string"}},
                    "required": ["customer_id"]
                }
            }
        }),
    ]
}

/// The agent's system prompt.
pub fn system_prompt(options: PromptOptions) -> String {
    let mut s = String::from(
        "You are the customer support agent of Northwind Outfitters, an online shop. \
Read the customer's ticket and decide how to resolve it.\n\
Decide three fields:\n\
- department: one of billing, shipping, returns, technical, retention\n\
- priority: one of low, normal, high, urgent\n\
- refund: full (the order total), partial (the total minus the restocking fee) or none\n",
    );
    if options.variant == Variant::Multi {
        s.push_str(
            "Use the tools lookup_order and lookup_customer to fetch the order and the customer's account before deciding. If a tool fails, try again.\n",
        );
    }
    if options.with_rules {
        s.push('\n');
        s.push_str(&rules_text());
        s.push('\n');
    }
    if options.response_format {
        s.push_str("Reply with the decision as a JSON object with exactly these three fields.");
    } else {
        s.push_str(
            "End your reply with the decision as a JSON object with exactly these three fields inside <final_output></final_output> tags.",
        );
    }
    s
}

/// The ticket as the user message.
pub fn user_message(ticket: &Ticket, variant: Variant) -> String {
    let header = format!(
        "Ticket {} from customer {} about order {}",
        ticket.ticket_id, ticket.customer.customer_id, ticket.order.order_id
    );
    match variant {
        Variant::Multi => format!("{header}\n\n{}", ticket.message),
        Variant::Single => format!(
            "{header}\n\n{}\n\nOrder record: {}\nCustomer record: {}",
            ticket.message,
            serde_json::to_string(&ticket.order).unwrap_or_default(),
            serde_json::to_string(&ticket.customer).unwrap_or_default(),
        ),
    }
}

/// The opening messages of an episode for a ticket.
pub fn messages(ticket: &Ticket, options: PromptOptions) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": system_prompt(options)}),
        json!({"role": "user", "content": user_message(ticket, options.variant)}),
    ]
}
