//! What the benches read about a process from Linux's `/proc`: resident memory and CPU time.
//! Off Linux (or for a process that is gone) the figures are NaN, so a table shows the gap
//! instead of a made-up number.

/// Which process: this one, or a child by pid.
#[derive(Debug, Clone, Copy)]
pub enum Proc {
    /// The calling process (`/proc/self`).
    This,
    /// Another process.
    Pid(u32),
}

impl Proc {
    fn read(self, file: &str) -> Option<String> {
        let path = match self {
            Proc::This => format!("/proc/self/{file}"),
            Proc::Pid(pid) => format!("/proc/{pid}/{file}"),
        };
        std::fs::read_to_string(path).ok()
    }

    /// A memory field of `status` in MiB: `"VmRSS:"` (resident now), `"VmHWM:"` (peak).
    pub fn memory_mib(self, field: &str) -> f64 {
        self.read("status")
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }

    /// Resident memory now, MiB.
    pub fn rss_mib(self) -> f64 {
        self.memory_mib("VmRSS:")
    }

    /// Peak resident memory, MiB.
    pub fn peak_rss_mib(self) -> f64 {
        self.memory_mib("VmHWM:")
    }

    /// User + system CPU seconds of all the process's threads so far: on a shared machine
    /// steadier than wall time.
    pub fn cpu_seconds(self) -> f64 {
        let Some(stat) = self.read("stat") else {
            return f64::NAN;
        };
        // Fields after the parenthesised command name; utime and stime are 14 and 15 overall.
        let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks = |i: usize| {
            f.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        (ticks(11) + ticks(12)) / 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn this_process_has_memory_and_cpu_time() {
        let v: Vec<u64> = (0..1_000_000).collect();
        let busy: u64 = (0..20_000_000u64).fold(0, |a, x| a.wrapping_add(x * x));
        std::hint::black_box((v, busy));
        let (rss, peak) = (Proc::This.rss_mib(), Proc::This.peak_rss_mib());
        assert!(rss > 1.0 && peak >= rss, "rss {rss} peak {peak}");
        assert!(Proc::This.cpu_seconds() > 0.0);
        assert!(Proc::Pid(u32::MAX).rss_mib().is_nan(), "no such process");
    }
}
