//! The simulated user: judges each answer against the hidden SOP and reacts like a customer
//! or a supervisor would — a thumbs up or down, a short critique naming the broken rule in
//! varied wording (never the whole answer), sometimes a corrected answer, and with a
//! configurable share of noisy (wrong) feedback.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::rng::Rng;
use super::sop::{
    Resolution, Rule, ALL_RULES, DEPARTMENTS, PRIORITIES, REFUNDS, RETENTION_AFTER_DAYS,
};
use super::world::Ticket;

/// How explicit a critique is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
#[value(rename_all = "kebab-case")]
pub enum CritiqueStyle {
    /// Names the broken rule only ("gold members always get high priority").
    Rule,
    /// Names the broken rule and the value it implies for that field ("… so priority should
    /// be high"); still never the whole answer (fields that were right are not mentioned).
    /// The default: it is how a supervisor writes a critique, and what the default model can
    /// act on in hindsight.
    #[default]
    RuleAndValue,
}

/// How the simulated user behaves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Share of reactions that are wrong (flipped thumbs, misleading critique or correction).
    #[serde(default = "default_noise_rate")]
    pub noise_rate: f64,
    /// Share of wrong answers that also get a corrected answer.
    #[serde(default = "default_correction_rate")]
    pub correction_rate: f64,
    /// Share of right answers that get a short thank-you comment besides the thumbs up.
    #[serde(default = "default_thanks_rate")]
    pub thanks_rate: f64,
    /// How explicit critiques are.
    #[serde(default)]
    pub critique_style: CritiqueStyle,
}

fn default_noise_rate() -> f64 {
    0.1
}
fn default_correction_rate() -> f64 {
    0.3
}
fn default_thanks_rate() -> f64 {
    0.2
}

impl Default for UserConfig {
    fn default() -> Self {
        Self {
            noise_rate: default_noise_rate(),
            correction_rate: default_correction_rate(),
            thanks_rate: default_thanks_rate(),
            critique_style: CritiqueStyle::default(),
        }
    }
}

impl UserConfig {
    /// A user who is never wrong and never corrects (what the hindsight baselines use).
    pub fn truthful_critic() -> Self {
        Self {
            noise_rate: 0.0,
            correction_rate: 0.0,
            thanks_rate: 0.0,
            critique_style: CritiqueStyle::Rule,
        }
    }
}

/// The user's reaction to one answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reaction {
    /// Whether the answer was actually right (every field).
    pub correct: bool,
    /// Whether this reaction is deliberately wrong (noise). Never sent to the proxy.
    pub noisy: bool,
    /// Thumbs up or down.
    pub thumbs_up: bool,
    /// Free-text comment (critique or thanks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// A corrected decision (as JSON text), sometimes, for wrong answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correction: Option<Value>,
    /// The rules the answer actually broke.
    pub broken_rules: Vec<Rule>,
}

/// Reacts to `answer` (the parsed JSON object, or `None` when it could not be parsed).
/// Deterministic in (seed, episode).
pub fn react(
    cfg: &UserConfig,
    seed: u64,
    episode: u64,
    ticket: &Ticket,
    resolution: &Resolution,
    answer: Option<&Map<String, Value>>,
) -> Reaction {
    let mut rng = Rng::derive(seed, "user", episode);
    let broken = resolution.broken_rules(answer);
    let correct = broken.is_empty();
    let noisy = rng.chance(cfg.noise_rate);
    let mut reaction = Reaction {
        correct,
        noisy,
        thumbs_up: correct != noisy,
        comment: None,
        correction: None,
        broken_rules: broken.clone(),
    };
    match (correct, noisy) {
        (true, false) => {
            if rng.chance(cfg.thanks_rate) {
                reaction.comment = Some(rng.pick_str(THANKS).to_string());
            }
        }
        (false, false) => {
            reaction.comment = Some(critique(
                &mut rng,
                ticket,
                resolution,
                &broken,
                answer.is_none(),
                cfg.critique_style,
            ));
            if rng.chance(cfg.correction_rate) {
                reaction.correction = Some(resolution.decision.to_json());
            }
        }
        (true, true) => {
            // A wrong complaint: blames a rule that did not decide this ticket.
            let decided = [
                resolution.department_rule,
                resolution.priority_rule,
                resolution.refund_rule,
            ];
            let candidates: Vec<Rule> = ALL_RULES
                .iter()
                .copied()
                .filter(|r| r.is_hidden() && !decided.contains(r))
                .collect();
            let rule = rng.pick(&candidates).copied().unwrap_or(Rule::GoldHigh);
            // A misleading critique never states a value: it only blames a rule.
            reaction.comment = Some(critique(
                &mut rng,
                ticket,
                resolution,
                &[rule],
                false,
                CritiqueStyle::Rule,
            ));
            if rng.chance(cfg.correction_rate) {
                reaction.correction = Some(perturbed(&mut rng, resolution));
            }
        }
        (false, true) => {
            // A wrong approval.
            if rng.chance(0.5) {
                reaction.comment = Some(rng.pick_str(THANKS).to_string());
            }
        }
    }
    reaction
}

const THANKS: &[&str] = &[
    "Thanks, that was quick.",
    "Great, thank you!",
    "Perfect, appreciated.",
    "That works for me, thanks.",
];

const OPENERS: &[&str] = &[
    "Not quite.",
    "That's not right.",
    "Hmm, no.",
    "This needs fixing.",
    "Close, but no.",
    "",
];

/// A short critique naming each broken rule, in varied wording, never restating the whole
/// answer.
pub fn critique(
    rng: &mut Rng,
    ticket: &Ticket,
    resolution: &Resolution,
    broken: &[Rule],
    unparseable: bool,
    style: CritiqueStyle,
) -> String {
    let mut parts: Vec<String> = Vec::new();
    let opener = rng.pick_str(OPENERS);
    if !opener.is_empty() {
        parts.push(opener.to_string());
    }
    if unparseable {
        parts.push(
            rng.pick_str(&[
                "I couldn't read a decision in that reply - I need the JSON with department, priority and refund.",
                "That reply had no usable decision; give me the three-field JSON decision.",
            ])
            .to_string(),
        );
    } else {
        for rule in broken {
            parts.push(rule_phrase(rng, *rule, ticket, resolution));
            if style == CritiqueStyle::RuleAndValue {
                parts.push(value_phrase(rng, *rule, resolution));
            }
        }
    }
    parts.join(" ")
}

/// One natural sentence naming `rule` (several wordings each).
pub fn rule_phrase(rng: &mut Rng, rule: Rule, ticket: &Ticket, resolution: &Resolution) -> String {
    let days = ticket.order.days_since_purchase;
    // The retention window of the SOP the answer was judged under.
    let window = resolution.sop.retention_after_days;
    let ago = if window == RETENTION_AFTER_DAYS {
        "a month".to_string()
    } else {
        format!("{window} days")
    };
    let options: Vec<String> = match rule {
        Rule::BillingErrorsToBilling => vec![
            "A double charge is a billing error, and billing errors always go to the billing team.".into(),
            "Duplicate payments are handled by billing, no matter how old the order is.".into(),
            "Being charged twice is billing's job.".into(),
        ],
        Rule::OldOrdersToRetention => vec![
            format!("This order is {days} days old; anything older than {window} days goes to the retention team."),
            format!("Orders placed more than {ago} ago are handled by retention, per our policy."),
            format!("Old orders (over {window} days) should be routed to retention."),
        ],
        Rule::DepartmentByIssue => vec![
            "Wrong team: damaged, wrong or returned items go to returns, missing parcels to shipping, faulty products to technical.".into(),
            "You routed it to the wrong department for this kind of problem.".into(),
        ],
        Rule::DuplicateChargeRefunded => vec![
            "When we charge someone twice we refund the duplicate charge in full, the whole order total.".into(),
            "The duplicate payment has to be refunded completely, final sale or not.".into(),
            "A double charge always gets the full order amount back.".into(),
        ],
        Rule::FinalSaleNoRefund => vec![
            "That item was bought as final sale, and final-sale items are never refunded.".into(),
            "Final sale means no refund, full stop.".into(),
            "We don't refund clearance (final-sale) purchases.".into(),
        ],
        Rule::OldOrdersNoRefund => vec![
            format!("At {days} days this order is past our {window}-day window, so no refund; retention offers store credit instead."),
            format!("Orders older than {window} days don't get refunded."),
            format!("No refunds after {window} days."),
        ],
        Rule::TroubleshootFirst => vec![
            "For a product that stopped working we troubleshoot first; no refund at this stage.".into(),
            "Faulty items go through troubleshooting before any money goes back.".into(),
            "Don't refund a malfunction yet, tech support has to look at it first.".into(),
        ],
        Rule::FullRefund => vec![
            "Damaged, wrong or undelivered orders get the full order total back.".into(),
            "The refund should be the entire amount they paid.".into(),
        ],
        Rule::RestockingFee => vec![
            "Change-of-mind returns are refunded minus our 15% restocking fee.".into(),
            "You forgot the 15% restocking fee on a change-of-mind return.".into(),
            "If they simply changed their mind, they get 85% of the total back.".into(),
        ],
        Rule::EscalationUrgent => vec![
            "The customer threatened a chargeback or legal action; those tickets are always urgent.".into(),
            "Anything mentioning a chargeback, a card dispute or a lawyer must be marked urgent.".into(),
            "This one is an escalation risk, so it's urgent.".into(),
        ],
        Rule::GoldHigh => vec![
            "This is a gold-tier customer; gold members always get high priority.".into(),
            "Gold customers are always high priority.".into(),
            "You missed that the customer is gold tier - that means high priority.".into(),
        ],
        Rule::HighValueHigh => vec![
            "Orders of $500 or more are high priority.".into(),
            "This is a high-value order (over $500), so it gets high priority.".into(),
            "Big-ticket orders, $500 and up, are always high priority.".into(),
        ],
        Rule::ChangeOfMindLow => vec![
            "A plain change-of-mind return is low priority.".into(),
            "Returns where the customer just changed their mind are low priority.".into(),
        ],
        Rule::NormalPriority => vec![
            "Nothing special about this one; it should be normal priority.".into(),
            "The priority is off, this is a normal-priority ticket.".into(),
        ],
    };
    rng.pick(&options).cloned().unwrap_or_default()
}

/// The value a rule implies for its field, in words.
pub fn value_phrase(rng: &mut Rng, rule: Rule, resolution: &Resolution) -> String {
    let d = &resolution.decision;
    match rule.field() {
        "department" => {
            let options = [
                format!("So the department is {}.", d.department),
                format!("It has to go to {}.", d.department),
            ];
            rng.pick(&options).cloned().unwrap_or_default()
        }
        "priority" => {
            let options = [
                format!("So priority should be {}.", d.priority),
                format!("That makes it {} priority.", d.priority),
            ];
            rng.pick(&options).cloned().unwrap_or_default()
        }
        _ => match d.refund.as_str() {
            "full" => rng
                .pick_str(&["So the refund is full.", "That means a full refund."])
                .to_string(),
            "partial" => rng
                .pick_str(&["So the refund is partial.", "That means a partial refund."])
                .to_string(),
            _ => rng
                .pick_str(&["So the refund is none.", "That means no refund."])
                .to_string(),
        },
    }
}

fn perturbed(rng: &mut Rng, resolution: &Resolution) -> Value {
    let mut v = resolution.decision.to_json();
    match rng.range(0, 2) {
        0 => v["department"] = Value::String(rng.pick_str(&DEPARTMENTS).to_string()),
        1 => v["priority"] = Value::String(rng.pick_str(&PRIORITIES).to_string()),
        _ => {
            let others: Vec<&str> = REFUNDS
                .iter()
                .copied()
                .filter(|r| *r != resolution.decision.refund)
                .collect();
            v["refund"] = Value::String(rng.pick(&others).copied().unwrap_or("none").to_string());
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sop::resolve;
    use crate::world::{Split, World};
    use serde_json::json;

    #[test]
    fn truthful_critic_thumbs_and_names_rules_without_the_answer() {
        let w = World::new(21);
        let cfg = UserConfig::truthful_critic();
        let mut wordings = std::collections::HashSet::new();
        for (e, t) in w.tickets(Split::Train, 200).iter().enumerate() {
            let r = resolve(t);
            let right = r.decision.to_json();
            let right = right.as_object().unwrap();
            let ok = react(&cfg, 1, e as u64, t, &r, Some(right));
            assert!(ok.correct && ok.thumbs_up && ok.comment.is_none());

            let mut wrong = right.clone();
            wrong.insert(
                "priority".into(),
                json!(if r.decision.priority == "low" {
                    "urgent"
                } else {
                    "low"
                }),
            );
            let bad = react(&cfg, 1, e as u64, t, &r, Some(&wrong));
            assert!(!bad.correct && !bad.thumbs_up);
            assert_eq!(bad.broken_rules, vec![r.priority_rule]);
            let text = bad.comment.unwrap();
            assert!(!text.contains(&r.decision.to_json().to_string()));
            wordings.insert(text);

            let none = react(&cfg, 1, e as u64, t, &r, None);
            assert!(none.comment.unwrap().contains("JSON"));
        }
        assert!(wordings.len() > 10, "{}", wordings.len());
    }

    #[test]
    fn rule_and_value_critiques_state_only_the_broken_field() {
        let w = World::new(12);
        let cfg = UserConfig {
            critique_style: CritiqueStyle::RuleAndValue,
            ..UserConfig::truthful_critic()
        };
        for (e, t) in w.tickets(Split::Train, 100).iter().enumerate() {
            let r = resolve(t);
            let mut wrong = r.decision.to_json().as_object().unwrap().clone();
            wrong.insert("department".into(), json!("nowhere"));
            let text = react(&cfg, 1, e as u64, t, &r, Some(&wrong))
                .comment
                .unwrap();
            assert!(text.contains(&r.decision.department), "{text}");
            assert!(
                !text.contains("priority should") && !text.contains("the refund is"),
                "{text}"
            );
        }
    }

    #[test]
    fn critiques_quote_the_window_of_the_sop_the_answer_was_judged_by() {
        let w = World::new(6);
        let sop = crate::sop::Sop {
            retention_after_days: 14,
        };
        let cfg = UserConfig::truthful_critic();
        let mut quoted = 0;
        for (e, t) in w.tickets(Split::Train, 300).iter().enumerate() {
            let r = sop.resolve(t);
            if r.department_rule != Rule::OldOrdersToRetention {
                continue;
            }
            let mut wrong = r.decision.to_json().as_object().unwrap().clone();
            wrong.insert("department".into(), json!("returns"));
            let text = react(&cfg, 2, e as u64, t, &r, Some(&wrong))
                .comment
                .unwrap();
            for stale in ["than 30 days", "30-day", "after 30", "over 30", "a month"] {
                assert!(!text.contains(stale), "{text}");
            }
            quoted += usize::from(text.contains("14 days") || text.contains("14-day"));
        }
        assert!(quoted >= 5, "{quoted}");
    }

    #[test]
    fn noise_and_corrections_follow_their_rates() {
        let w = World::new(4);
        let cfg = UserConfig {
            noise_rate: 0.2,
            correction_rate: 0.5,
            thanks_rate: 0.0,
            critique_style: CritiqueStyle::Rule,
        };
        let tickets = w.tickets(Split::Train, 500);
        let mut noisy = 0;
        let mut corrections = 0;
        for (e, t) in tickets.iter().enumerate() {
            let r = resolve(t);
            let reaction = react(&cfg, 8, e as u64, t, &r, None);
            assert_eq!(reaction.thumbs_up, reaction.noisy);
            noisy += usize::from(reaction.noisy);
            corrections += usize::from(reaction.correction.is_some());
            // Deterministic.
            assert_eq!(reaction, react(&cfg, 8, e as u64, t, &r, None));
        }
        assert!((60..140).contains(&noisy), "{noisy}");
        assert!((150..260).contains(&corrections), "{corrections}");
    }
}
