//! What the deployed agent is given: its system prompt, the decision schema, the tools and the
//! ticket as a user message, for the single-turn and the multi-turn (tool-calling) variant.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::sop::{rules_text, DEPARTMENTS, PRIORITIES, REFUNDS};
use super::world::{Customer, Order, Ticket, Tier};

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

/// How the single-turn variant writes the order and customer records into the ticket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Records {
    /// The records as the tools return them: JSON, every field, the customer's recent orders
    /// (user messages of ~230-315 tokens with the default model's tokenizer; prompts ~400).
    Json,
    /// One line each, the same fields in words, without the customer's recent orders (which
    /// no rule reads) and the ids the ticket's header already gives (user messages of
    /// ~150-170 tokens; prompts ~270). The default: every pass of serving and training is
    /// ~30% cheaper, and the headline learning result was measured on it.
    #[default]
    Compact,
}

/// Prompt options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptOptions {
    /// Single- or multi-turn.
    pub variant: Variant,
    /// How the single-turn variant writes the records (the multi-turn one calls tools).
    pub records: Records,
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
            records: Records::default(),
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
pub fn user_message(ticket: &Ticket, variant: Variant, records: Records) -> String {
    let header = format!(
        "Ticket {} from customer {} about order {}",
        ticket.ticket_id, ticket.customer.customer_id, ticket.order.order_id
    );
    match (variant, records) {
        (Variant::Multi, _) => format!("{header}\n\n{}", ticket.message),
        (Variant::Single, Records::Json) => format!(
            "{header}\n\n{}\n\nOrder record: {}\nCustomer record: {}",
            ticket.message,
            serde_json::to_string(&ticket.order).unwrap_or_default(),
            serde_json::to_string(&ticket.customer).unwrap_or_default(),
        ),
        (Variant::Single, Records::Compact) => format!(
            "{header}\n\n{}\n\n{}\n{}",
            ticket.message,
            compact_order(&ticket.order),
            compact_customer(&ticket.customer),
        ),
    }
}

/// The order record in one line ([`Records::Compact`]).
fn compact_order(o: &Order) -> String {
    let when = match o.status.as_str() {
        "delivered" => "delivered",
        "in_transit" => "in transit",
        other => other,
    };
    format!(
        "Order: {} ({}), {} x ${:.2}, total ${:.2}, {}, bought {} days ago, {}, paid by {}.",
        o.product,
        o.category,
        o.quantity,
        o.unit_price,
        o.total,
        if o.final_sale {
            "final sale"
        } else {
            "not final sale"
        },
        o.days_since_purchase,
        when,
        o.payment_method,
    )
}

/// The customer record in one line ([`Records::Compact`]).
fn compact_customer(c: &Customer) -> String {
    let tier = match c.tier {
        Tier::Standard => "standard",
        Tier::Silver => "silver",
        Tier::Gold => "gold",
    };
    format!(
        "Customer: {}, {tier} tier, member since {}, {} orders.",
        c.name, c.member_since, c.lifetime_orders
    )
}

/// The opening messages of an episode for a ticket.
pub fn messages(ticket: &Ticket, options: PromptOptions) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": system_prompt(options)}),
        json!({"role": "user", "content": user_message(ticket, options.variant, options.records)}),
    ]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::world::{Split, World};

    #[test]
    fn compact_records_keep_every_fact_a_rule_reads_in_a_shorter_message() {
        let world = World::new(3);
        for ticket in world.tickets(Split::Train, 200) {
            let json = user_message(&ticket, Variant::Single, Records::Json);
            let compact = user_message(&ticket, Variant::Single, Records::Compact);
            let o = &ticket.order;
            let c = &ticket.customer;
            // The SOP reads the issue and escalation (the message), the order's age, total
            // and final-sale flag, and the customer's tier.
            assert!(compact.contains(&ticket.message), "{compact}");
            assert!(compact.contains(&format!("bought {} days ago", o.days_since_purchase)));
            assert!(
                compact.contains(&format!("total ${:.2}", o.total)),
                "{compact}"
            );
            let sale = if o.final_sale {
                ", final sale,"
            } else {
                ", not final sale,"
            };
            assert!(compact.contains(sale), "{compact}");
            let tier = serde_json::to_value(c.tier).unwrap();
            assert!(compact.contains(&format!(", {} tier,", tier.as_str().unwrap())));
            assert!(compact.starts_with(&format!(
                "Ticket {} from customer {} about order {}",
                ticket.ticket_id, c.customer_id, o.order_id
            )));
            // No rule reads the recent orders: the compact form leaves them out.
            for r in &c.recent_orders {
                assert!(!compact.contains(&r.order_id));
            }
            assert!(compact.len() * 10 < json.len() * 8, "{compact}\n{json}");
        }
        // The multi-turn variant has no records in the message either way.
        let t = world.ticket(0);
        assert_eq!(
            user_message(&t, Variant::Multi, Records::Compact),
            user_message(&t, Variant::Multi, Records::Json)
        );
    }
}
