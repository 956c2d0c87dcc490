//! The read-only tools, replayed from the world's fixture tables and keyed by their inputs,
//! with failures injected at a configurable rate (deterministically per episode and call).

use serde_json::{json, Value};

use super::rng::Rng;
use super::world::{Ticket, World};

/// Executes tool calls for one episode.
#[derive(Debug, Clone)]
pub struct ToolBox {
    world: World,
    ticket: Ticket,
    failure_rate: f64,
    episode: u64,
    calls: u64,
}

impl ToolBox {
    /// Tools for an episode about `ticket`; `failure_rate` in [0, 1].
    pub fn new(world: World, ticket: Ticket, episode: u64, failure_rate: f64) -> Self {
        Self {
            world,
            ticket,
            failure_rate,
            episode,
            calls: 0,
        }
    }

    /// Tool calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// The result (JSON text) of calling `name` with `arguments` (JSON text) and whether the
    /// call failed by injection.
    pub fn call(&mut self, name: &str, arguments: &str) -> (String, bool) {
        let index = self.calls;
        self.calls += 1;
        let mut rng = Rng::derive(
            self.world.seed ^ self.episode.rotate_left(17),
            "tool",
            index,
        );
        if rng.chance(self.failure_rate) {
            let reason = rng.pick_str(&["timeout", "503 Service Unavailable", "connection reset"]);
            return (
                json!({"error": format!("{name} failed: {reason}; try again")}).to_string(),
                true,
            );
        }
        (
            lookup(&self.world, &self.ticket, name, arguments).to_string(),
            false,
        )
    }
}

/// The fixture lookup without failure injection (what eval items replay).
pub fn lookup(world: &World, ticket: &Ticket, name: &str, arguments: &str) -> Value {
    let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
    match name {
        "lookup_order" => {
            let id = args["order_id"].as_str().unwrap_or_default().trim();
            if id.eq_ignore_ascii_case(&ticket.order.order_id) {
                serde_json::to_value(&ticket.order).unwrap_or(Value::Null)
            } else {
                json!({"error": format!("order {id:?} not found")})
            }
        }
        "lookup_customer" => {
            let id = args["customer_id"].as_str().unwrap_or_default().trim();
            match world.customer_by_id(id) {
                Some(c) => serde_json::to_value(c).unwrap_or(Value::Null),
                None => json!({"error": format!("customer {id:?} not found")}),
            }
        }
        other => json!({"error": format!("unknown tool {other:?}")}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::Split;

    #[test]
    fn lookups_are_keyed_by_input_and_failures_are_deterministic() {
        let w = World::new(9);
        let t = w.tickets(Split::Train, 1).remove(0);
        let args = json!({"order_id": t.order.order_id}).to_string();
        let v = lookup(&w, &t, "lookup_order", &args);
        assert_eq!(v["total"], json!(t.order.total));
        let v = lookup(
            &w,
            &t,
            "lookup_customer",
            &json!({"customer_id": t.customer.customer_id}).to_string(),
        );
        assert_eq!(v["tier"], serde_json::to_value(t.customer.tier).unwrap());
        assert!(lookup(&w, &t, "lookup_order", r#"{"order_id":"ORD-1"}"#)["error"].is_string());
        assert!(lookup(&w, &t, "refund_now", "{}")["error"].is_string());

        let run = |rate| {
            let mut tb = ToolBox::new(w, t.clone(), 3, rate);
            (0..200)
                .map(|_| tb.call("lookup_order", &args).1)
                .collect::<Vec<bool>>()
        };
        assert_eq!(run(0.3), run(0.3));
        let failures = run(0.3).iter().filter(|f| **f).count();
        assert!((30..100).contains(&failures), "{failures}");
        assert_eq!(run(0.0).iter().filter(|f| **f).count(), 0);
    }
}
