//! The benches' environment knobs (`DURATION_S=30`, `RATES="500 2000"`, ...): unset means the
//! default, a value that does not parse stops the bench naming the variable — never a silent
//! fallback to the default, which would print a figure for a run nobody asked for.

use std::str::FromStr;

/// `name`'s value parsed, or `default` when it is unset.
pub fn knob<T: FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) => parse(name, &v),
        Err(_) => Ok(default),
    }
}

/// `name`'s whitespace-separated values parsed, or `default` when it is unset.
pub fn knob_list<T: FromStr>(name: &str, default: Vec<T>) -> anyhow::Result<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) => v.split_whitespace().map(|x| parse(name, x)).collect(),
        Err(_) => Ok(default),
    }
}

fn parse<T: FromStr>(name: &str, value: &str) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e| anyhow::anyhow!("{name}={value:?} is not valid: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_value_names_the_variable_and_unset_is_the_default() {
        let e = parse::<u64>("DURATION_S", "ten").unwrap_err();
        assert!(e.to_string().contains("DURATION_S=\"ten\""), "{e}");
        assert_eq!(parse::<f64>("RATE", " 2.5 ").unwrap(), 2.5);
        let unset = "HINDSIGHT_BENCH_KNOB_NEVER_SET";
        assert_eq!(knob::<u64>(unset, 10).unwrap(), 10);
        assert_eq!(knob_list::<f64>(unset, vec![1.0]).unwrap(), vec![1.0]);
    }
}
