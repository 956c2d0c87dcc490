//! Part 3: exposures the sequential guard needs to roll back a harmful canary, against the
//! fixed-horizon test, and the guard's false-alarm rate on an equal canary.

use std::time::Instant;

use anyhow::{anyhow, bail};
use hindsight_control::rollout::stats::{
    fixed_horizon_canary_n, two_proportion_z_test, Alpha, HarmSimulation, RateArm, SplitMix64,
};
use serde_json::{json, Value};

use crate::figures::quantile;
use crate::settings::Settings;

/// Runs `f(seed)` for `seeds` seeds drawn from `base` on every core; results in seed order.
pub(crate) fn par_seeds<T: Send>(
    seeds: usize,
    base: u64,
    f: impl Fn(u64) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    let mut rng = SplitMix64(base);
    let list: Vec<u64> = (0..seeds).map(|_| rng.next_u64()).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = list.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = list
            .chunks(chunk)
            .map(|part| {
                let f = &f;
                scope.spawn(move || {
                    part.iter()
                        .map(|&s| f(s))
                        .collect::<anyhow::Result<Vec<T>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(seeds);
        for h in handles {
            out.extend(
                h.join()
                    .map_err(|_| anyhow!("a simulation thread panicked"))??,
            );
        }
        Ok(out)
    })
}

/// The fixed-horizon z-test run as planned: `n_c` canary and `k n_c` stable exposures, one
/// look; whether it rejects with the canary worse. Checks the planned n has its power.
pub(crate) fn z_test_rejects(
    seed: u64,
    n_canary: u64,
    stable_per_canary: f64,
    p_stable: f64,
    p_canary: f64,
    alpha: Alpha,
) -> bool {
    let mut rng = SplitMix64(seed);
    let (mut c, mut s) = (RateArm::default(), RateArm::default());
    for _ in 0..n_canary {
        c.record(rng.next_f64() < p_canary);
    }
    for _ in 0..(n_canary as f64 * stable_per_canary).round() as u64 {
        s.record(rng.next_f64() < p_stable);
    }
    two_proportion_z_test(&c, &s, alpha).is_some_and(|z| z.reject && z.z > 0.0)
}

/// The same z-test looked at after every exposure (as a controller would), equal arms: whether
/// it ever rejects with the canary worse before `horizon` canary exposures. Looks start at 30
/// canary exposures, the usual rule of thumb for the normal approximation.
pub(crate) fn peeking_z_test_alarms(
    seed: u64,
    horizon: u64,
    share: f64,
    p: f64,
    alpha: Alpha,
) -> bool {
    let mut rng = SplitMix64(seed);
    let (mut c, mut s) = (RateArm::default(), RateArm::default());
    while c.exposures < horizon {
        if rng.next_f64() < share {
            c.record(rng.next_f64() < p);
        } else {
            s.record(rng.next_f64() < p);
        }
        if c.exposures >= 30
            && two_proportion_z_test(&c, &s, alpha).is_some_and(|z| z.reject && z.z > 0.0)
        {
            return true;
        }
    }
    false
}

pub(crate) fn statistics(s: &Settings) -> anyhow::Result<Value> {
    let k = (1.0 - s.canary_share) / s.canary_share;
    let sim = |p_canary: f64, max: u64| HarmSimulation {
        p_stable: s.p_stable,
        p_canary,
        canary_share: s.canary_share,
        alpha: s.alpha,
        margin: s.margin,
        max_canary_exposures: max,
    };
    println!(
        "\n== 3. canary exposures until rollback: p_stable {}, canary share {}, alpha {}, margin {}, {} seeds",
        s.p_stable, s.canary_share, s.alpha.get(), s.margin, s.seeds
    );
    println!(
        "{:>8} | {:>11} {:>11} {:>9} | {:>12} {:>10} | {:>12}",
        "p_canary", "seq median", "seq p90", "censored", "fixed n_c", "z power", "seq <= n_c"
    );
    let mut rows = Vec::new();
    for (g, &p_canary) in s.p_canary.iter().enumerate() {
        let started = Instant::now();
        let model = sim(p_canary, s.max_canary_exposures);
        let hits = par_seeds(s.seeds, 0x5EED_0000 + g as u64, |seed| {
            Ok(model.exposures_to_harm(seed)?)
        })?;
        let censored = hits.iter().filter(|h| h.is_none()).count();
        // A run that never said Harm counts as beyond the budget (+inf) in the quantiles.
        let mut x: Vec<f64> = hits
            .iter()
            .map(|h| h.map_or(f64::INFINITY, |n| n as f64))
            .collect();
        let (median, p90) = (quantile(&mut x, 0.5), quantile(&mut x, 0.9));
        let fixed = fixed_horizon_canary_n(s.alpha, s.power, s.p_stable, p_canary, k)?;
        let within = hits
            .iter()
            .filter(|h| h.is_some_and(|n| n <= fixed))
            .count();
        let rejects = par_seeds(s.seeds, 0x2_7E57_0000 + g as u64, |seed| {
            Ok(z_test_rejects(
                seed, fixed, k, s.p_stable, p_canary, s.alpha,
            ))
        })?;
        let power = rejects.iter().filter(|r| **r).count() as f64 / s.seeds as f64;
        let show = |v: f64| {
            if v.is_finite() {
                format!("{v:.0}")
            } else {
                format!(">{}", s.max_canary_exposures)
            }
        };
        println!(
            "{p_canary:>8.2} | {:>11} {:>11} {:>9} | {fixed:>12} {power:>10.3} | {:>11.1}%   ({:.1} s)",
            show(median),
            show(p90),
            censored,
            100.0 * within as f64 / s.seeds as f64,
            started.elapsed().as_secs_f64()
        );
        rows.push(json!({
            "p_canary": p_canary,
            "sequential_median": median.is_finite().then_some(median),
            "sequential_p90": p90.is_finite().then_some(p90),
            "sequential_censored": censored,
            "fixed_horizon_n_canary": fixed,
            "fixed_horizon_empirical_power": power,
            "sequential_within_fixed_n_share": within as f64 / s.seeds as f64,
        }));
    }

    let started = Instant::now();
    let equal = sim(s.p_stable, s.false_alarm_horizon);
    let alarms = par_seeds(s.seeds, 0xFA15E, |seed| {
        Ok(equal.exposures_to_harm(seed)?.is_some())
    })?;
    let rate = alarms.iter().filter(|a| **a).count() as f64 / s.seeds as f64;
    let sequential_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let peeking = par_seeds(s.seeds, 0xFA15E, |seed| {
        Ok(peeking_z_test_alarms(
            seed,
            s.false_alarm_horizon,
            s.canary_share,
            s.p_stable,
            s.alpha,
        ))
    })?;
    let peek_rate = peeking.iter().filter(|a| **a).count() as f64 / s.seeds as f64;
    let alpha = s.alpha.get();
    let tolerance = 3.0 * (alpha * (1.0 - alpha) / s.seeds as f64).sqrt();
    println!(
        "false alarms, p_canary = p_stable = {}, {} canary exposures each: sequential guard {:.4} (alpha {alpha}; {sequential_s:.1} s); z-test looked at after every exposure {:.4} ({:.1} s)",
        s.p_stable,
        s.false_alarm_horizon,
        rate,
        peek_rate,
        started.elapsed().as_secs_f64()
    );
    let out = json!({
        "p_stable": s.p_stable, "canary_share": s.canary_share, "alpha": alpha, "margin": s.margin,
        "power": s.power, "seeds": s.seeds, "max_canary_exposures": s.max_canary_exposures,
        "harm": rows,
        "false_alarm": {"horizon_canary_exposures": s.false_alarm_horizon, "sequential_rate": rate,
            "peeking_z_test_rate": peek_rate, "tolerance": tolerance},
    });
    if rate > alpha + tolerance {
        bail!("the sequential guard's false-alarm rate {rate} is above alpha {alpha} beyond noise ({tolerance:.4})");
    }
    Ok(out)
}
