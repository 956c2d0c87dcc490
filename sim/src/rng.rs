//! A small deterministic PRNG (SplitMix64) and seed derivation, so every ticket, tool failure
//! and feedback choice is a pure function of the seed and a few indices.

/// SplitMix64: 64-bit state, passes BigCrush, trivially reproducible across platforms.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for a (seed, stream, index) triple: independent streams for tickets,
    /// customers, tool failures, feedback, …
    pub fn derive(seed: u64, stream: &str, index: u64) -> Self {
        let mut h = seed ^ 0x6A09_E667_F3BC_C908;
        for b in stream.bytes() {
            h = mix(h ^ u64::from(b));
        }
        Self(mix(h ^ mix(index.wrapping_add(0x243F_6A88_85A3_08D3))))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi] (inclusive).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// A uniformly chosen element (`items` must not be empty; an empty slice yields the
    /// default of the element type through `pick_or`).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get((self.next_u64() % items.len() as u64) as usize)
        }
    }

    /// Picks a string from a non-empty list of literals (falls back to "").
    pub fn pick_str(&mut self, items: &[&'static str]) -> &'static str {
        self.pick(items).copied().unwrap_or("")
    }

    /// Index chosen with the given relative weights.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len().saturating_sub(1)
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4)
            .map(|_| Rng::derive(7, "ticket", 3).next_u64())
            .collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            Rng::derive(7, "ticket", 3).next_u64(),
            Rng::derive(7, "ticket", 4).next_u64()
        );
        assert_ne!(
            Rng::derive(7, "ticket", 3).next_u64(),
            Rng::derive(7, "tool", 3).next_u64()
        );
        assert_ne!(
            Rng::derive(7, "ticket", 3).next_u64(),
            Rng::derive(8, "ticket", 3).next_u64()
        );
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let x = r.range(3, 5);
            assert!((3..=5).contains(&x));
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
