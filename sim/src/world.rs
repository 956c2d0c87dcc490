//! The simulated shop: customers, orders and support tickets, each a pure function of the
//! seed and its index. The train/eval split is decided per ticket index, so the two splits
//! never share a ticket and the eval split can be regenerated without ever being shown to
//! the learner.

use serde::{Deserialize, Serialize};

use super::rng::Rng;

/// Customers in the pool tickets draw from.
pub const CUSTOMER_POOL: u64 = 300;

/// Loyalty tier of a customer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Most customers.
    Standard,
    /// Mid tier.
    Silver,
    /// Top tier.
    Gold,
}

/// What the ticket is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IssueKind {
    /// The item arrived broken.
    Damaged,
    /// A different item arrived.
    WrongItem,
    /// The parcel never arrived.
    NotArrived,
    /// The card was charged twice.
    DoubleCharge,
    /// The product stopped working.
    NotWorking,
    /// The customer wants to send it back.
    ChangedMind,
}

/// Which split a ticket belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Seen in production traffic (and by the learner).
    Train,
    /// Held out for evaluation only.
    Eval,
}

/// A past order shown in a customer's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrderSummary {
    /// Order id.
    pub order_id: String,
    /// Product name.
    pub product: String,
    /// Days ago it was placed.
    pub days_ago: u32,
}

/// A customer account (what `lookup_customer` returns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Customer {
    /// `C-1xxxx`.
    pub customer_id: String,
    /// Full name.
    pub name: String,
    /// Loyalty tier.
    pub tier: Tier,
    /// Year the account was opened.
    pub member_since: u32,
    /// Orders placed so far.
    pub lifetime_orders: u32,
    /// A few recent orders (distractors: the ticket's order is not among them).
    pub recent_orders: Vec<OrderSummary>,
}

/// An order (what `lookup_order` returns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Order {
    /// `ORD-xxxxxx`.
    pub order_id: String,
    /// Owner.
    pub customer_id: String,
    /// Product name.
    pub product: String,
    /// Product category.
    pub category: String,
    /// Unit price in USD.
    pub unit_price: f64,
    /// Units bought.
    pub quantity: u32,
    /// Amount charged in USD.
    pub total: f64,
    /// Bought on a final-sale (clearance) promotion.
    pub final_sale: bool,
    /// Days since the order was placed.
    pub days_since_purchase: u32,
    /// `delivered` or `in_transit`.
    pub status: String,
    /// How it was paid.
    pub payment_method: String,
}

impl Order {
    /// The total in cents (exact).
    pub fn total_cents(&self) -> u64 {
        (self.total * 100.0).round() as u64
    }
}

/// One support ticket with everything needed to resolve it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ticket {
    /// `TCK-xxxxxx`.
    pub ticket_id: String,
    /// Index in the ticket stream.
    pub index: u64,
    /// Train or eval.
    pub split: Split,
    /// What it is about.
    pub issue: IssueKind,
    /// The customer threatens a chargeback, a bank dispute or legal action.
    pub escalation: bool,
    /// The customer's message.
    pub message: String,
    /// The customer's account.
    pub customer: Customer,
    /// The order the ticket is about.
    pub order: Order,
}

struct Product {
    name: &'static str,
    category: &'static str,
    price_lo: u64,
    price_hi: u64,
}

const PRODUCTS: &[Product] = &[
    Product {
        name: "Aurora wireless headphones",
        category: "electronics",
        price_lo: 59,
        price_hi: 249,
    },
    Product {
        name: "Trailblazer hiking boots",
        category: "footwear",
        price_lo: 89,
        price_hi: 179,
    },
    Product {
        name: "Nimbus espresso machine",
        category: "kitchen",
        price_lo: 199,
        price_hi: 649,
    },
    Product {
        name: "Merino wool scarf",
        category: "apparel",
        price_lo: 19,
        price_hi: 59,
    },
    Product {
        name: "Vista 27-inch 4K monitor",
        category: "electronics",
        price_lo: 279,
        price_hi: 799,
    },
    Product {
        name: "Summit standing desk",
        category: "furniture",
        price_lo: 349,
        price_hi: 899,
    },
    Product {
        name: "Lotus yoga mat",
        category: "sports",
        price_lo: 22,
        price_hi: 68,
    },
    Product {
        name: "Shield phone case",
        category: "accessories",
        price_lo: 12,
        price_hi: 39,
    },
    Product {
        name: "Cyclone blender",
        category: "kitchen",
        price_lo: 49,
        price_hi: 189,
    },
    Product {
        name: "Voyager travel backpack",
        category: "bags",
        price_lo: 45,
        price_hi: 139,
    },
    Product {
        name: "Pulse smartwatch",
        category: "electronics",
        price_lo: 149,
        price_hi: 449,
    },
    Product {
        name: "Ember coffee grinder",
        category: "kitchen",
        price_lo: 29,
        price_hi: 119,
    },
    Product {
        name: "Stride running shoes",
        category: "footwear",
        price_lo: 69,
        price_hi: 159,
    },
    Product {
        name: "Polar winter jacket",
        category: "apparel",
        price_lo: 99,
        price_hi: 329,
    },
    Product {
        name: "Folio e-reader",
        category: "electronics",
        price_lo: 89,
        price_hi: 229,
    },
    Product {
        name: "Harbor cast-iron skillet",
        category: "kitchen",
        price_lo: 25,
        price_hi: 79,
    },
];

const FIRST: &[&str] = &[
    "Maria", "James", "Aisha", "Chen", "Lukas", "Sofia", "Daniel", "Priya", "Tom", "Elena",
    "Kwame", "Hannah", "Diego", "Yuki", "Olivia", "Samir", "Grace", "Mateo", "Ingrid", "Noah",
];
const LAST: &[&str] = &[
    "Garcia",
    "Smith",
    "Khan",
    "Wei",
    "Becker",
    "Rossi",
    "Okafor",
    "Patel",
    "Novak",
    "Johansson",
    "Mensah",
    "Dubois",
    "Tanaka",
    "Brown",
    "Haddad",
    "Silva",
    "Murphy",
    "Kowalski",
    "Larsen",
    "Nguyen",
];

/// The world of one seed.
#[derive(Debug, Clone, Copy)]
pub struct World {
    /// The seed everything derives from.
    pub seed: u64,
    /// Share of ticket indices held out for evaluation, in percent.
    pub eval_percent: u64,
}

impl World {
    /// A world for `seed` with 20% of tickets held out.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            eval_percent: 20,
        }
    }

    /// The split of ticket `index` (a pure function of seed and index).
    pub fn split_of(&self, index: u64) -> Split {
        if Rng::derive(self.seed, "split", index).range(0, 99) < self.eval_percent {
            Split::Eval
        } else {
            Split::Train
        }
    }

    /// The first `n` tickets of a split, in index order.
    pub fn tickets(&self, split: Split, n: usize) -> Vec<Ticket> {
        self.ticket_indices(split)
            .take(n)
            .map(|i| self.ticket(i))
            .collect()
    }

    /// Indices of a split, in order (an endless stream).
    pub fn ticket_indices(&self, split: Split) -> impl Iterator<Item = u64> + '_ {
        (0u64..).filter(move |i| self.split_of(*i) == split)
    }

    /// Customer `j` of the pool.
    pub fn customer(&self, j: u64) -> Customer {
        let mut rng = Rng::derive(self.seed, "customer", j);
        let first = rng.pick_str(FIRST);
        let last = rng.pick_str(LAST);
        let tier = match rng.weighted(&[0.6, 0.25, 0.15]) {
            0 => Tier::Standard,
            1 => Tier::Silver,
            _ => Tier::Gold,
        };
        let lifetime_orders = match tier {
            Tier::Standard => rng.range(1, 12),
            Tier::Silver => rng.range(8, 30),
            Tier::Gold => rng.range(20, 90),
        } as u32;
        let recent = rng.range(0, 3);
        let recent_orders = (0..recent)
            .map(|k| {
                let product = PRODUCTS
                    .get((rng.next_u64() % PRODUCTS.len() as u64) as usize)
                    .map(|p| p.name)
                    .unwrap_or("gift card");
                OrderSummary {
                    order_id: format!(
                        "ORD-{}",
                        300_000 + (j * 7 + k * 131 + rng.range(0, 99_999)) % 600_000
                    ),
                    product: product.to_string(),
                    days_ago: rng.range(3, 400) as u32,
                }
            })
            .collect();
        Customer {
            customer_id: format!("C-{}", 10_000 + j),
            name: format!("{first} {last}"),
            tier,
            member_since: rng.range(2012, 2025) as u32,
            lifetime_orders,
            recent_orders,
        }
    }

    /// The customer with this id, if it belongs to the pool.
    pub fn customer_by_id(&self, customer_id: &str) -> Option<Customer> {
        let j: u64 = customer_id.strip_prefix("C-")?.parse().ok()?;
        (10_000..10_000 + CUSTOMER_POOL)
            .contains(&j)
            .then(|| self.customer(j - 10_000))
    }

    /// Ticket `index`.
    pub fn ticket(&self, index: u64) -> Ticket {
        let mut rng = Rng::derive(self.seed, "ticket", index);
        let customer = self.customer(rng.range(0, CUSTOMER_POOL - 1));
        let issue = match rng.weighted(&[0.2, 0.12, 0.16, 0.12, 0.18, 0.22]) {
            0 => IssueKind::Damaged,
            1 => IssueKind::WrongItem,
            2 => IssueKind::NotArrived,
            3 => IssueKind::DoubleCharge,
            4 => IssueKind::NotWorking,
            _ => IssueKind::ChangedMind,
        };
        let product = &PRODUCTS[(rng.next_u64() % PRODUCTS.len() as u64) as usize];
        let cents_tail = *rng.pick(&[0u64, 99, 49, 95, 50]).unwrap_or(&0);
        let unit_cents = rng.range(product.price_lo, product.price_hi) * 100 + cents_tail;
        let quantity = [1u32, 2, 3][rng.weighted(&[0.8, 0.15, 0.05])];
        let total_cents = unit_cents * u64::from(quantity);
        let days_since_purchase = match rng.weighted(&[0.6, 0.1, 0.3]) {
            0 => rng.range(1, 29),
            1 => rng.range(29, 32), // the boundary: 30 is not "older than 30 days"
            _ => rng.range(32, 120),
        } as u32;
        let order = Order {
            order_id: format!(
                "ORD-{}",
                100_000 + (index * 7919 + rng.range(0, 999)) % 900_000
            ),
            customer_id: customer.customer_id.clone(),
            product: product.name.to_string(),
            category: product.category.to_string(),
            unit_price: unit_cents as f64 / 100.0,
            quantity,
            total: total_cents as f64 / 100.0,
            final_sale: rng.chance(0.2),
            days_since_purchase,
            status: if issue == IssueKind::NotArrived {
                "in_transit"
            } else {
                "delivered"
            }
            .to_string(),
            payment_method: rng
                .pick_str(&["visa", "mastercard", "paypal", "amex", "gift_card"])
                .to_string(),
        };
        let escalation = rng.chance(0.15);
        let message =
            super::wording::ticket_message(&mut rng, issue, escalation, &customer, &order);
        Ticket {
            ticket_id: format!("TCK-{:06}", index),
            index,
            split: self.split_of(index),
            issue,
            escalation,
            message,
            customer,
            order,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_world() {
        let a = World::new(42);
        let b = World::new(42);
        assert_eq!(a.tickets(Split::Train, 50), b.tickets(Split::Train, 50));
        assert_eq!(a.tickets(Split::Eval, 20), b.tickets(Split::Eval, 20));
        assert_ne!(
            a.tickets(Split::Train, 5),
            World::new(43).tickets(Split::Train, 5)
        );
    }

    #[test]
    fn splits_are_disjoint_and_roughly_sized() {
        let w = World::new(1);
        let train: Vec<u64> = w.ticket_indices(Split::Train).take(400).collect();
        let eval: Vec<u64> = w.ticket_indices(Split::Eval).take(100).collect();
        assert!(train.iter().all(|i| !eval.contains(i)));
        let eval_share = (0..1000).filter(|i| w.split_of(*i) == Split::Eval).count();
        assert!((120..280).contains(&eval_share), "{eval_share}");
        assert!(w
            .tickets(Split::Eval, 10)
            .iter()
            .all(|t| t.split == Split::Eval));
    }

    #[test]
    fn tickets_vary() {
        let w = World::new(3);
        let tickets = w.tickets(Split::Train, 200);
        let messages: std::collections::HashSet<_> =
            tickets.iter().map(|t| t.message.clone()).collect();
        assert_eq!(messages.len(), 200);
        for kind in [
            IssueKind::Damaged,
            IssueKind::NotArrived,
            IssueKind::DoubleCharge,
            IssueKind::ChangedMind,
        ] {
            assert!(tickets.iter().any(|t| t.issue == kind));
        }
        assert!(tickets.iter().any(|t| t.customer.tier == Tier::Gold));
        assert!(tickets.iter().any(|t| t.order.final_sale));
        assert!(tickets.iter().any(|t| t.escalation));
        assert!(tickets
            .iter()
            .all(|t| t.message.contains(&t.order.order_id)));
        assert_eq!(
            w.customer_by_id(&tickets[0].customer.customer_id),
            Some(tickets[0].customer.clone())
        );
        assert_eq!(w.customer_by_id("C-99999"), None);
    }
}
