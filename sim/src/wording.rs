//! Natural-language variety: how customers write tickets. Every choice comes from the
//! ticket's own RNG, so wording is as deterministic as the facts.

use super::rng::Rng;
use super::world::{Customer, IssueKind, Order};

const OPENERS: &[&str] = &[
    "Hi,",
    "Hello,",
    "Hi there,",
    "Good morning,",
    "Dear support team,",
    "Hey,",
    "",
];

const DISTRACTORS: &[&str] = &[
    "I've been shopping with you for a while and never had a problem before.",
    "It was meant to be a birthday present.",
    "I need this sorted before the weekend if at all possible.",
    "Your chat widget kept disconnecting, so I'm writing here instead.",
    "I already checked the FAQ page.",
    "My neighbour recommended your store, so this is disappointing.",
    "",
    "",
];

const ESCALATIONS: &[&str] = &[
    "If this isn't resolved I will file a chargeback with my bank.",
    "I'm ready to dispute the charge with my credit card company.",
    "My lawyer will be hearing about this if it drags on.",
    "I'll open a chargeback if I don't hear back today.",
    "Consider this a formal complaint; I'm prepared to take legal action.",
];

fn body(rng: &mut Rng, issue: IssueKind, order: &Order) -> String {
    let p = &order.product;
    let o = &order.order_id;
    let templates: &[&str] = match issue {
        IssueKind::Damaged => &[
            "The {p} from order {o} arrived with a cracked casing.",
            "My {p} (order {o}) showed up damaged - the box was crushed and the item is broken.",
            "Order {o}: the {p} was broken when I opened the package.",
            "I just unpacked the {p} from {o} and it's dented and scratched all over.",
        ],
        IssueKind::WrongItem => &[
            "I ordered the {p} (order {o}) but received something completely different.",
            "Order {o} was supposed to be a {p}, but the parcel contained the wrong product.",
            "You sent me the wrong item for order {o} - I never ordered this, I wanted the {p}.",
        ],
        IssueKind::NotArrived => &[
            "My order {o} ({p}) still hasn't arrived.",
            "Where is my {p}? Order {o} shows in transit forever and nothing came.",
            "The tracking for {o} hasn't moved in days and I have no {p}.",
            "Order {o} never showed up. I was expecting a {p}.",
        ],
        IssueKind::DoubleCharge => &[
            "I was charged twice for order {o} ({p}).",
            "My statement shows two identical payments for order {o}.",
            "You billed my card two times for the {p}, order {o}.",
            "There's a duplicate charge for order {o} on my account.",
        ],
        IssueKind::NotWorking if matches!(order.category.as_str(), "electronics" | "kitchen") => &[
            "The {p} from order {o} stopped working after a few uses.",
            "My {p} (order {o}) won't turn on anymore.",
            "Order {o}: the {p} keeps failing and I can't get it to work.",
            "The {p} I bought (order {o}) has a fault - it just doesn't work properly.",
        ],
        IssueKind::NotWorking => &[
            "The {p} from order {o} is already falling apart after a few uses.",
            "My {p} (order {o}) has a defect - a seam came loose in the first week.",
            "Order {o}: the {p} is faulty and no longer usable.",
        ],
        IssueKind::ChangedMind => &[
            "I'd like to return the {p} from order {o}; I changed my mind.",
            "The {p} (order {o}) isn't what I expected, so I want to send it back.",
            "Can I return order {o}? I don't need the {p} after all.",
            "I no longer want the {p} I bought in order {o} and would like to return it.",
        ],
    };
    rng.pick_str(templates).replace("{p}", p).replace("{o}", o)
}

fn ask(rng: &mut Rng, issue: IssueKind) -> &'static str {
    match issue {
        IssueKind::DoubleCharge => rng.pick_str(&[
            "Please fix this.",
            "I want the extra charge back.",
            "Can you sort this out?",
        ]),
        IssueKind::NotWorking => rng.pick_str(&[
            "What can you do?",
            "I want this fixed or my money back.",
            "Please help.",
        ]),
        _ => rng.pick_str(&[
            "I'd like a refund.",
            "What are my options?",
            "Please refund me.",
            "How do we resolve this?",
            "Please advise.",
        ]),
    }
}

/// The customer's message for a ticket.
pub fn ticket_message(
    rng: &mut Rng,
    issue: IssueKind,
    escalation: bool,
    customer: &Customer,
    order: &Order,
) -> String {
    let first = customer.name.split(' ').next().unwrap_or(&customer.name);
    let mut parts: Vec<String> = Vec::new();
    let opener = rng.pick_str(OPENERS);
    if !opener.is_empty() {
        parts.push(opener.to_string());
    }
    parts.push(body(rng, issue, order));
    let distractor = rng.pick_str(DISTRACTORS);
    if !distractor.is_empty() {
        parts.push(distractor.to_string());
    }
    parts.push(ask(rng, issue).to_string());
    if escalation {
        parts.push(rng.pick_str(ESCALATIONS).to_string());
    }
    let sign_off = match rng.range(0, 3) {
        0 => format!("Thanks, {first}"),
        1 => format!("Regards,\n{}", customer.name),
        2 => format!("- {first}"),
        _ => customer.name.clone(),
    };
    parts.push(sign_off);
    parts.join(if rng.chance(0.5) { "\n" } else { " " })
}
