//! Scoring a changing-rule run (issue 39, item 3; [`super::config::RuleChange`]): of the
//! held-out tickets the change affects, how many answers follow the new rule and how many
//! still the old one; of the tickets it leaves alone, how many stay right (retention).

use std::collections::HashSet;

use hindsight_eval::{
    compare_runs, extract_json_answer, values_equal, Comparison, EvalSet, RunReport,
};
use hindsight_sim::{Sop, Ticket};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A curve point's view of the rule change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleChangeScore {
    /// Held-out tickets whose decision the change alters.
    pub affected: usize,
    /// Of the fields the change alters on those tickets (every sample's answer), the share
    /// answered as the new SOP decides.
    pub new_rule: f64,
    /// The share answered as the old SOP decided.
    pub old_rule: f64,
    /// Exact match on the affected tickets under the new SOP.
    pub affected_exact: f64,
    /// Held-out tickets the change leaves alone.
    pub unaffected: usize,
    /// Exact match on them (the same under both SOPs): what learning the change must not
    /// break.
    pub unaffected_exact: f64,
}

/// The held-out tickets of a run with their decisions under the SOP before and after the
/// change, in eval-set order.
pub struct RuleChangeMeter {
    tickets: Vec<Ticket>,
    old: Sop,
    new: Sop,
}

/// The decision's fields the change can alter.
const FIELDS: [&str; 3] = ["department", "priority", "refund"];

impl RuleChangeMeter {
    /// `tickets` are the held-out set's tickets, in its order.
    pub fn new(tickets: Vec<Ticket>, old: Sop, new: Sop) -> Self {
        Self { tickets, old, new }
    }

    /// The fields whose value differs between the two SOPs on `ticket`, with the old and new
    /// values.
    fn changed(&self, ticket: &Ticket) -> Vec<(&'static str, Value, Value)> {
        let old = self.old.resolve(ticket).decision.to_json();
        let new = self.new.resolve(ticket).decision.to_json();
        FIELDS
            .iter()
            .filter(|f| old[**f] != new[**f])
            .map(|f| (*f, old[*f].clone(), new[*f].clone()))
            .collect()
    }

    /// Ids of the held-out tickets the change leaves alone.
    fn unaffected_ids(&self) -> HashSet<&str> {
        self.tickets
            .iter()
            .filter(|t| self.changed(t).is_empty())
            .map(|t| t.ticket_id.as_str())
            .collect()
    }

    /// Scores `report` (a run on `set`, whose items are these tickets in order); `None` when
    /// the report is not of this set.
    pub fn score(&self, set: &EvalSet, report: &RunReport) -> Option<RuleChangeScore> {
        if set.items.len() != self.tickets.len() || report.items.len() != self.tickets.len() {
            return None;
        }
        let (mut affected, mut unaffected) = (0usize, 0usize);
        let (mut affected_pass, mut unaffected_pass) = (0.0, 0.0);
        let (mut fields, mut new_hits, mut old_hits) = (0usize, 0usize, 0usize);
        for ((ticket, item), outcome) in self.tickets.iter().zip(&set.items).zip(&report.items) {
            if item.id != ticket.ticket_id || outcome.id != ticket.ticket_id {
                return None;
            }
            let changed = self.changed(ticket);
            if changed.is_empty() {
                unaffected += 1;
                unaffected_pass += outcome.pass_rate;
                continue;
            }
            affected += 1;
            affected_pass += outcome.pass_rate;
            for sample in &outcome.samples {
                let answer = sample
                    .content
                    .as_deref()
                    .and_then(|c| extract_json_answer(c, item.response_format.is_some()).ok());
                for (field, old, new) in &changed {
                    fields += 1;
                    let Some(got) = answer.as_ref().and_then(|a| a.get(*field)) else {
                        continue;
                    };
                    new_hits += usize::from(values_equal(new, got));
                    old_hits += usize::from(values_equal(old, got));
                }
            }
        }
        let share = |hits: usize, n: usize| if n == 0 { 0.0 } else { hits as f64 / n as f64 };
        Some(RuleChangeScore {
            affected,
            new_rule: share(new_hits, fields),
            old_rule: share(old_hits, fields),
            affected_exact: if affected == 0 {
                0.0
            } else {
                affected_pass / affected as f64
            },
            unaffected,
            unaffected_exact: if unaffected == 0 {
                0.0
            } else {
                unaffected_pass / unaffected as f64
            },
        })
    }

    /// Retention: exact match on the tickets the change leaves alone, `after` against `before`
    /// (the version at the change and the last one), paired by ticket.
    pub fn retention(
        &self,
        before: &RunReport,
        after: &RunReport,
        seed: u64,
    ) -> anyhow::Result<Option<Comparison>> {
        let keep = self.unaffected_ids();
        if keep.is_empty() {
            return Ok(None);
        }
        let only = |r: &RunReport| {
            let mut r = r.clone();
            r.items.retain(|o| keep.contains(o.id.as_str()));
            r
        };
        Ok(Some(compare_runs(
            &only(before),
            &only(after),
            10_000,
            seed,
        )?))
    }
}

/// Events after the change until the affected held-out tickets follow the new rule for good:
/// the first point after the change from which on every point has at least half of the
/// changed fields at the new value and more at the new value than at the old one; `None` when
/// the run never gets there (a point that reaches it and a later one that falls back do not
/// count).
pub fn events_to_new_rule(
    points: &[(u64, Option<&RuleChangeScore>)],
    after_events: u64,
) -> Option<u64> {
    let holds = |s: Option<&RuleChangeScore>| {
        s.is_some_and(|s| s.new_rule >= 0.5 && s.new_rule > s.old_rule)
    };
    let after: Vec<_> = points.iter().filter(|(e, _)| *e > after_events).collect();
    // The earliest point of the run's final stretch of points that hold.
    let mut first = None;
    for (events, score) in after.iter().rev() {
        if !holds(*score) {
            break;
        }
        first = Some(*events);
    }
    first.map(|e| e - after_events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hindsight_eval::{score_answer, EvalSet, ItemOutcome, SampleOutcome};
    use hindsight_sim::{eval_items_under, PromptOptions, Split, World};
    use serde_json::json;

    /// A report whose one answer to each item is `answer(ticket)`.
    fn report_of(
        set: &EvalSet,
        tickets: &[Ticket],
        answer: impl Fn(&Ticket) -> Value,
    ) -> RunReport {
        let items: Vec<ItemOutcome> = set
            .items
            .iter()
            .zip(tickets)
            .map(|(item, t)| {
                let content = answer(t).to_string();
                let score = score_answer(item.scorer, &item.expected, &content, true);
                let pass = f64::from(u8::from(score.passed));
                let sample = SampleOutcome {
                    sample: 0,
                    score,
                    content: Some(content),
                    error: None,
                    adapter: None,
                    tool_calls: 0,
                    latency_ms: 0,
                    tokens: None,
                };
                serde_json::from_value(json!({"id": item.id, "scorer": "json_exact",
                    "correct": pass as usize, "pass_rate": pass, "mean_score": pass,
                    "pass_at_k": {}, "samples": [sample]}))
                .unwrap()
            })
            .collect();
        serde_json::from_value(json!({
            "schema": "x", "endpoint": "x", "model": "m", "adapter_versions": [],
            "set": {"name": "t", "sha256": set.sha256, "items": set.items.len()},
            "seed": 0, "samples": 1, "temperature": 0.0, "started_at_ms": 0, "duration_ms": 0,
            "metrics": {"items": items.len(), "samples": items.len(), "exact_match": 0.0,
                "mean_score": 0.0, "pass_at_k": {}, "unparseable": {}, "request_errors": 0,
                "tool_calls_per_sample": 0.0, "mean_latency_ms": 0.0},
            "items": items,
        }))
        .unwrap()
    }

    #[test]
    fn answers_by_each_sop_score_as_that_rule() {
        let world = World::new(4);
        let (old, new) = (
            Sop::default(),
            Sop {
                retention_after_days: 14,
            },
        );
        let options = PromptOptions::default();
        let tickets = world.tickets(Split::Eval, 60);
        let set = EvalSet::from_items(
            "t",
            eval_items_under(&world, Split::Eval, 60, options, &new),
        )
        .unwrap();
        let meter = RuleChangeMeter::new(tickets.clone(), old, new);

        let by_old = report_of(&set, &tickets, |t| old.resolve(t).decision.to_json());
        let s = meter.score(&set, &by_old).unwrap();
        assert!(s.affected >= 10 && s.unaffected >= 10, "{s:?}");
        assert_eq!(s.affected + s.unaffected, 60);
        assert_eq!((s.new_rule, s.old_rule, s.affected_exact), (0.0, 1.0, 0.0));
        assert_eq!(s.unaffected_exact, 1.0);

        let by_new = report_of(&set, &tickets, |t| new.resolve(t).decision.to_json());
        let s = meter.score(&set, &by_new).unwrap();
        assert_eq!((s.new_rule, s.old_rule, s.affected_exact), (1.0, 0.0, 1.0));
        assert_eq!(s.unaffected_exact, 1.0);

        // Unchanged tickets answered wrong: retention lost, the new rule still learned.
        let forgot = report_of(&set, &tickets, |t| {
            let mut d = new.resolve(t).decision.to_json();
            if meter.changed(t).is_empty() {
                d["priority"] = Value::from("nonsense");
            }
            d
        });
        let s = meter.score(&set, &forgot).unwrap();
        assert_eq!((s.new_rule, s.unaffected_exact), (1.0, 0.0));
        let kept = meter.retention(&by_new, &forgot, 0).unwrap().unwrap();
        assert!(kept.exact_match.diff < -0.99, "{kept:?}");

        // Another set's report is refused, not scored.
        let other = RuleChangeMeter::new(tickets[1..].to_vec(), old, new);
        assert!(other.score(&set, &by_new).is_none());
    }

    #[test]
    fn events_to_the_new_rule_count_from_the_change() {
        let s = |new_rule, old_rule| RuleChangeScore {
            affected: 20,
            new_rule,
            old_rule,
            affected_exact: 0.0,
            unaffected: 40,
            unaffected_exact: 0.0,
        };
        let (a, b, c, d) = (s(0.0, 0.9), s(0.4, 0.5), s(0.6, 0.3), s(0.9, 0.0));
        let points = [
            (0, Some(&a)),
            (32, Some(&a)),
            (64, Some(&b)),
            (96, Some(&c)),
            (128, Some(&d)),
        ];
        assert_eq!(events_to_new_rule(&points, 32), Some(64));
        assert_eq!(events_to_new_rule(&points[..4], 32), Some(64));
        assert_eq!(events_to_new_rule(&points[..3], 32), None);
        // Reached, then lost again: not learned.
        let back = [(32, Some(&a)), (64, Some(&c)), (96, Some(&b))];
        assert_eq!(events_to_new_rule(&back, 32), None);
        // Holding before the change does not count.
        let early = [(32, Some(&d)), (64, Some(&d))];
        assert_eq!(events_to_new_rule(&early, 32), Some(32));
    }
}
