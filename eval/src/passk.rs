//! The unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained
//! on Code"): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k).

/// Unbiased pass@k for one item: `n` samples drawn, `c` of them correct.
///
/// Returns `None` when the estimate is undefined (`k == 0`, `k > n` or `c > n`).
/// Computed as a running product, never through factorials, so large `n` stays exact enough.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> Option<f64> {
    if k == 0 || k > n || c > n {
        return None;
    }
    if n - c < k {
        return Some(1.0);
    }
    // C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    let mut ratio = 1.0_f64;
    for i in (n - c + 1)..=n {
        ratio *= 1.0 - k as f64 / i as f64;
    }
    Some(1.0 - ratio)
}

#[cfg(test)]
mod tests {
    use super::pass_at_k;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn pass_at_1_is_the_fraction_correct() {
        assert!(close(pass_at_k(5, 2, 1).unwrap(), 0.4));
        assert!(close(pass_at_k(4, 1, 1).unwrap(), 0.25));
        assert!(close(pass_at_k(10, 0, 1).unwrap(), 0.0));
        assert!(close(pass_at_k(10, 10, 1).unwrap(), 1.0));
    }

    #[test]
    fn matches_the_binomial_formula() {
        // n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
        assert!(close(pass_at_k(10, 3, 5).unwrap(), 1.0 - 21.0 / 252.0));
        // n=4, c=1, k=4: any correct sample among all four → 1
        assert!(close(pass_at_k(4, 1, 4).unwrap(), 1.0));
        // n=4, c=0, k=4 → 0
        assert!(close(pass_at_k(4, 0, 4).unwrap(), 0.0));
        // n=20, c=2, k=10: 1 - C(18,10)/C(20,10) = 1 - 43758/184756
        assert!(close(
            pass_at_k(20, 2, 10).unwrap(),
            1.0 - 43758.0 / 184756.0
        ));
    }

    #[test]
    fn undefined_cases_are_none() {
        assert_eq!(pass_at_k(3, 1, 4), None);
        assert_eq!(pass_at_k(3, 1, 0), None);
        assert_eq!(pass_at_k(3, 4, 1), None);
    }
}
