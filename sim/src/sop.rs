//! The hidden standard operating procedure: the business rules that decide the correct
//! resolution of a ticket. The deployed agent is not told them; the simulated user's
//! critiques name them one at a time; baseline (b) puts them all in the system prompt.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::world::{IssueKind, Ticket, Tier};

/// Orders older than this many days go to retention and are not refunded (the default
/// [`Sop`]'s window).
pub const RETENTION_AFTER_DAYS: u32 = 30;
/// Orders at or above this total (cents) are high priority.
pub const HIGH_VALUE_CENTS: u64 = 50_000;

/// The teams a ticket can go to.
pub const DEPARTMENTS: [&str; 5] = ["billing", "shipping", "returns", "technical", "retention"];
/// The priorities.
pub const PRIORITIES: [&str; 4] = ["low", "normal", "high", "urgent"];
/// The refund decisions: the order total back, the total minus the restocking fee, nothing.
pub const REFUNDS: [&str; 3] = ["full", "partial", "none"];

/// One rule of the SOP. Each decided field is decided by exactly one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Duplicate charges always go to billing, whatever the order's age.
    BillingErrorsToBilling,
    /// Orders older than 30 days go to the retention team.
    OldOrdersToRetention,
    /// Otherwise: damaged/wrong/return → returns, missing → shipping, faulty → technical.
    DepartmentByIssue,
    /// A duplicate charge is refunded in full (the order total), final sale or not.
    DuplicateChargeRefunded,
    /// Final-sale items are never refunded.
    FinalSaleNoRefund,
    /// Orders older than 30 days are not refunded (retention offers store credit).
    OldOrdersNoRefund,
    /// Faulty products are troubleshot first: no refund yet.
    TroubleshootFirst,
    /// Damaged, wrong or undelivered orders get the full order total back.
    FullRefund,
    /// Change-of-mind returns are refunded minus a 15% restocking fee.
    RestockingFee,
    /// A chargeback, bank dispute or legal threat makes the ticket urgent.
    EscalationUrgent,
    /// Gold-tier customers get high priority.
    GoldHigh,
    /// Orders of $500 or more get high priority.
    HighValueHigh,
    /// Change-of-mind returns are low priority.
    ChangeOfMindLow,
    /// Everything else is normal priority.
    NormalPriority,
}

/// All rules, in SOP order.
pub const ALL_RULES: [Rule; 14] = [
    Rule::BillingErrorsToBilling,
    Rule::OldOrdersToRetention,
    Rule::DepartmentByIssue,
    Rule::DuplicateChargeRefunded,
    Rule::FinalSaleNoRefund,
    Rule::OldOrdersNoRefund,
    Rule::TroubleshootFirst,
    Rule::FullRefund,
    Rule::RestockingFee,
    Rule::EscalationUrgent,
    Rule::GoldHigh,
    Rule::HighValueHigh,
    Rule::ChangeOfMindLow,
    Rule::NormalPriority,
];

impl Rule {
    /// The hidden rules: the ones a model cannot guess from common sense. (Department by
    /// issue, full refunds for damage and normal priority are what anyone would do.)
    pub fn is_hidden(self) -> bool {
        !matches!(
            self,
            Rule::DepartmentByIssue | Rule::FullRefund | Rule::NormalPriority
        )
    }

    /// The decision field this rule decides.
    pub fn field(self) -> &'static str {
        match self {
            Rule::BillingErrorsToBilling | Rule::OldOrdersToRetention | Rule::DepartmentByIssue => {
                "department"
            }
            Rule::DuplicateChargeRefunded
            | Rule::FinalSaleNoRefund
            | Rule::OldOrdersNoRefund
            | Rule::TroubleshootFirst
            | Rule::FullRefund
            | Rule::RestockingFee => "refund",
            Rule::EscalationUrgent
            | Rule::GoldHigh
            | Rule::HighValueHigh
            | Rule::ChangeOfMindLow
            | Rule::NormalPriority => "priority",
        }
    }

    /// The SOP sentence (used for baseline (b), rules in the system prompt) under `sop`: the
    /// retention rules state its window, the others are fixed text.
    pub fn sop_text(self, sop: &Sop) -> Cow<'static, str> {
        let days = sop.retention_after_days;
        match self {
            Rule::OldOrdersToRetention => {
                format!("Any other order placed more than {days} days ago goes to the retention team.").into()
            }
            Rule::OldOrdersNoRefund => format!(
                "Otherwise, orders older than {days} days are not refunded (retention offers store credit instead)."
            )
            .into(),
            Rule::BillingErrorsToBilling => "Duplicate charges always go to billing, whatever the order's age.".into(),
            Rule::DepartmentByIssue => "Otherwise: damaged, wrong or change-of-mind returns go to returns; orders that never arrived go to shipping; products that stopped working go to technical.".into(),
            Rule::DuplicateChargeRefunded => "A duplicate charge gets a full refund (the order total), even for final-sale items or old orders.".into(),
            Rule::FinalSaleNoRefund => "Otherwise, final-sale items are never refunded.".into(),
            Rule::TroubleshootFirst => "Otherwise, products that stopped working are troubleshot first: no refund.".into(),
            Rule::FullRefund => "Otherwise, damaged, wrong or undelivered orders get a full refund (the order total).".into(),
            Rule::RestockingFee => "Otherwise, change-of-mind returns get a partial refund: the total minus a 15% restocking fee.".into(),
            Rule::EscalationUrgent => "A ticket that threatens a chargeback, a bank or card dispute, or legal action is urgent.".into(),
            Rule::GoldHigh => "Otherwise, gold-tier customers get high priority.".into(),
            Rule::HighValueHigh => "Otherwise, orders totalling $500 or more get high priority.".into(),
            Rule::ChangeOfMindLow => "Otherwise, change-of-mind returns are low priority.".into(),
            Rule::NormalPriority => "Everything else is normal priority.".into(),
        }
    }
}

/// The SOP's adjustable part: the company can change it mid-stream (issue 39's changing-rule
/// scenario moves the retention window from 30 to 14 days), and every judgement, critique and
/// eval item is made under one `Sop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sop {
    /// Orders older than this many days go to retention and are not refunded.
    #[serde(default = "default_retention_after_days")]
    pub retention_after_days: u32,
}

fn default_retention_after_days() -> u32 {
    RETENTION_AFTER_DAYS
}

impl Default for Sop {
    fn default() -> Self {
        Self {
            retention_after_days: RETENTION_AFTER_DAYS,
        }
    }
}

/// The resolution fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// One of [`DEPARTMENTS`].
    pub department: String,
    /// One of [`PRIORITIES`].
    pub priority: String,
    /// One of [`REFUNDS`]: `full`, `partial` (minus the restocking fee) or `none`.
    pub refund: String,
}

impl Decision {
    /// As the expected JSON object.
    pub fn to_json(&self) -> Value {
        json!({
            "department": self.department,
            "priority": self.priority,
            "refund": self.refund,
        })
    }
}

/// The correct decision and the rule behind each field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resolution {
    /// The correct decision.
    pub decision: Decision,
    /// Rule that set `department`.
    pub department_rule: Rule,
    /// Rule that set `priority`.
    pub priority_rule: Rule,
    /// Rule that set `refund`.
    pub refund_rule: Rule,
    /// The SOP it was decided under (critiques quote its window).
    #[serde(default)]
    pub sop: Sop,
}

impl Resolution {
    /// The rule behind a field name of the decision.
    pub fn rule_for_field(&self, field: &str) -> Option<Rule> {
        match field {
            "department" => Some(self.department_rule),
            "priority" => Some(self.priority_rule),
            "refund" => Some(self.refund_rule),
            _ => None,
        }
    }

    /// Rules (deduplicated, SOP order) whose field the answer got wrong; all rules behind the
    /// three fields when the answer is not a JSON object.
    pub fn broken_rules(&self, answer: Option<&serde_json::Map<String, Value>>) -> Vec<Rule> {
        let expected = self.decision.to_json();
        let mut broken: Vec<Rule> = ["department", "priority", "refund"]
            .iter()
            .filter(|f| match answer {
                Some(a) => !a
                    .get(**f)
                    .is_some_and(|got| hindsight_eval::values_equal(&expected[**f], got)),
                None => true,
            })
            .filter_map(|f| self.rule_for_field(f))
            .collect();
        broken.sort();
        broken.dedup();
        broken
    }
}

/// Applies the default SOP to a ticket.
pub fn resolve(ticket: &Ticket) -> Resolution {
    Sop::default().resolve(ticket)
}

/// The default SOP as a numbered list (baseline (b)).
pub fn rules_text() -> String {
    Sop::default().rules_text()
}

impl Sop {
    /// Applies this SOP to a ticket.
    pub fn resolve(&self, ticket: &Ticket) -> Resolution {
        let order = &ticket.order;
        let old = order.days_since_purchase > self.retention_after_days;
        let total_cents = order.total_cents();

        let (department, department_rule) = if ticket.issue == IssueKind::DoubleCharge {
            ("billing", Rule::BillingErrorsToBilling)
        } else if old {
            ("retention", Rule::OldOrdersToRetention)
        } else {
            let d = match ticket.issue {
                IssueKind::Damaged | IssueKind::WrongItem | IssueKind::ChangedMind => "returns",
                IssueKind::NotArrived => "shipping",
                IssueKind::NotWorking => "technical",
                IssueKind::DoubleCharge => "billing",
            };
            (d, Rule::DepartmentByIssue)
        };

        let (refund, refund_rule) = if ticket.issue == IssueKind::DoubleCharge {
            ("full", Rule::DuplicateChargeRefunded)
        } else if order.final_sale {
            ("none", Rule::FinalSaleNoRefund)
        } else if old {
            ("none", Rule::OldOrdersNoRefund)
        } else if ticket.issue == IssueKind::NotWorking {
            ("none", Rule::TroubleshootFirst)
        } else if ticket.issue == IssueKind::ChangedMind {
            ("partial", Rule::RestockingFee)
        } else {
            ("full", Rule::FullRefund)
        };

        let (priority, priority_rule) = if ticket.escalation {
            ("urgent", Rule::EscalationUrgent)
        } else if ticket.customer.tier == Tier::Gold {
            ("high", Rule::GoldHigh)
        } else if total_cents >= HIGH_VALUE_CENTS {
            ("high", Rule::HighValueHigh)
        } else if ticket.issue == IssueKind::ChangedMind {
            ("low", Rule::ChangeOfMindLow)
        } else {
            ("normal", Rule::NormalPriority)
        };

        Resolution {
            decision: Decision {
                department: department.to_string(),
                priority: priority.to_string(),
                refund: refund.to_string(),
            },
            department_rule,
            priority_rule,
            refund_rule,
            sop: *self,
        }
    }

    /// The whole SOP as a numbered list (baseline (b)).
    pub fn rules_text(&self) -> String {
        let mut out = String::from(
            "Company policy (apply in this order; the first matching rule for each field wins):\n",
        );
        for (i, rule) in ALL_RULES.iter().enumerate() {
            out.push_str(&format!("{}. {}\n", i + 1, rule.sop_text(self)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::{Split, World};

    #[test]
    fn every_rule_decides_some_tickets() {
        let w = World::new(11);
        let resolutions: Vec<Resolution> =
            w.tickets(Split::Train, 600).iter().map(resolve).collect();
        for rule in ALL_RULES {
            let fired = resolutions
                .iter()
                .filter(|r| [r.department_rule, r.priority_rule, r.refund_rule].contains(&rule))
                .count();
            assert!(fired >= 5, "{rule:?} fired {fired} times");
        }
        // Hidden rules decide a good share of tickets, so guessing cannot score well.
        let touched = resolutions
            .iter()
            .filter(|r| {
                [r.department_rule, r.priority_rule, r.refund_rule]
                    .iter()
                    .any(|x| x.is_hidden())
            })
            .count();
        assert!(touched * 100 / resolutions.len() >= 60, "{touched}");
    }

    #[test]
    fn refund_values_follow_their_rules() {
        let w = World::new(5);
        for t in w.tickets(Split::Train, 300) {
            let r = resolve(&t);
            assert!(REFUNDS.contains(&r.decision.refund.as_str()));
            let expected = match r.refund_rule {
                Rule::RestockingFee => "partial",
                Rule::DuplicateChargeRefunded | Rule::FullRefund => "full",
                _ => "none",
            };
            assert_eq!(r.decision.refund, expected, "{:?}", r.refund_rule);
            if t.order.final_sale && r.refund_rule != Rule::DuplicateChargeRefunded {
                assert_eq!(r.decision.refund, "none");
            }
        }
    }

    #[test]
    fn a_shorter_retention_window_changes_only_the_tickets_between_the_windows() {
        let w = World::new(3);
        let new = Sop {
            retention_after_days: 14,
        };
        assert!(new.rules_text().contains("more than 14 days ago"));
        assert!(!new.rules_text().contains("30 days"));
        assert!(rules_text().contains("more than 30 days ago"));
        let mut changed = 0;
        for t in w.tickets(Split::Train, 400) {
            let (a, b) = (resolve(&t), new.resolve(&t));
            assert_eq!(b.sop, new);
            let days = t.order.days_since_purchase;
            let between = days > 14 && days <= 30 && t.issue != IssueKind::DoubleCharge;
            if !between {
                assert_eq!(a.decision, b.decision, "{days} days, {:?}", t.issue);
                continue;
            }
            changed += 1;
            assert_eq!(b.decision.department, "retention");
            assert_eq!(b.department_rule, Rule::OldOrdersToRetention);
            assert_eq!(b.decision.refund, "none");
            // Priority is not decided by the window.
            assert_eq!(a.decision.priority, b.decision.priority);
        }
        // A change that matters: about a third of the tickets.
        assert!((80..200).contains(&changed), "{changed}");
    }

    #[test]
    fn broken_rules_name_the_wrong_fields() {
        let w = World::new(2);
        let t = w.tickets(Split::Train, 1).remove(0);
        let r = resolve(&t);
        let mut answer = r.decision.to_json().as_object().unwrap().clone();
        assert!(r.broken_rules(Some(&answer)).is_empty());
        answer.insert("priority".into(), json!("wrong"));
        assert_eq!(r.broken_rules(Some(&answer)), vec![r.priority_rule]);
        assert_eq!(r.broken_rules(None).len(), {
            let mut v = vec![r.department_rule, r.priority_rule, r.refund_rule];
            v.sort();
            v.dedup();
            v.len()
        });
    }
}
