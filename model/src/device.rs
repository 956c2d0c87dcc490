//! Where the model runs and in which dtype, as named in configuration (`device = "cuda:0"`,
//! `dtype = "bf16"`; `--device`, `--dtype` on the command line).

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// A compute device: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`. CUDA needs the `cuda` feature;
/// without it [`DeviceSpec::open`] fails with candle's "not compiled with cuda support".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The host CPU (candle's thread pool; `CANDLE_NUM_THREADS` sizes it).
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Opens the device (for CUDA: creates the context, loads nothing yet).
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(i) => Device::new_cuda(i).map_err(|e| {
                ModelError::InvalidArgument(format!("device cuda:{i} cannot be opened: {e}"))
            }),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            ModelError::InvalidArgument(format!(
                "device {s:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""
            ))
        };
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The dtype the frozen base weights are held and computed in. Adapters, optimizer state and
/// the reductions in rmsnorm, softmax and cross-entropy stay f32 whatever this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum WeightDType {
    /// f32: exact; the only sensible choice on a CPU.
    #[default]
    F32,
    /// bfloat16: half the memory and bandwidth; for GPUs.
    Bf16,
    /// float16.
    F16,
}

impl WeightDType {
    /// The candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            WeightDType::F32 => DType::F32,
            WeightDType::Bf16 => DType::BF16,
            WeightDType::F16 => DType::F16,
        }
    }
}

impl FromStr for WeightDType {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "f32" | "float32" => Ok(WeightDType::F32),
            "bf16" | "bfloat16" => Ok(WeightDType::Bf16),
            "f16" | "float16" => Ok(WeightDType::F16),
            other => Err(ModelError::InvalidArgument(format!(
                "dtype {other:?}: expected \"f32\", \"bf16\" or \"f16\""
            ))),
        }
    }
}

impl TryFrom<String> for WeightDType {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<WeightDType> for String {
    fn from(d: WeightDType) -> String {
        d.to_string()
    }
}

impl fmt::Display for WeightDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightDType::F32 => "f32",
            WeightDType::Bf16 => "bf16",
            WeightDType::F16 => "f16",
        })
    }
}

/// The environment variable candle's CPU backend reads for its thread count.
pub const CPU_THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// Settles the CPU thread count for the rest of the process: when `RAYON_NUM_THREADS` is not
/// set, sets it to the count candle would pick itself (its physical cores, or `CANDLE_CPU_MASK`),
/// and returns the count in use. Call it first thing in `main`, before any other thread exists
/// (it writes the environment).
///
/// Why: candle-core 0.11's CPU matmul asks for its thread count on every call, and without the
/// variable that means reading and parsing `/proc/cpuinfo` each time (`num_cpus::get_physical`):
/// a system call and kernel formatting per matrix product (measured:
/// docs/experiments/2026-12-02-cpu-thread-count.md). With the variable set, the same call is an
/// environment lookup. The count is unchanged, so results are too.
pub fn settle_cpu_threads() -> usize {
    match threads_set(std::env::var(CPU_THREADS_VAR).ok().as_deref()) {
        Some(n) => n,
        None => {
            // Reads /proc/cpuinfo once, as candle would on every matmul.
            let n = candle_core::utils::get_num_threads().max(1);
            std::env::set_var(CPU_THREADS_VAR, n.to_string());
            n
        }
    }
}

/// `main`'s body for an async binary that runs the model: [`settle_cpu_threads`] while this is
/// the only thread, then `fut` on a multi-threaded tokio runtime. Fails only when the runtime
/// cannot be built.
pub fn run_settled<F: std::future::Future>(fut: F) -> std::io::Result<F::Output> {
    settle_cpu_threads();
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(fut))
}

/// The thread count a value of [`CPU_THREADS_VAR`] sets, as candle and rayon read it (a
/// positive integer; anything else counts as unset).
fn threads_set(value: Option<&str>) -> Option<usize> {
    value?.parse::<usize>().ok().filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_positive_thread_count_counts_as_set() {
        assert_eq!(threads_set(Some("2")), Some(2));
        // What candle and rayon would not parse leaves the count unset (then it is settled).
        for unset in [
            None,
            Some(""),
            Some("0"),
            Some(" 2"),
            Some("two"),
            Some("-1"),
        ] {
            assert_eq!(threads_set(unset), None, "{unset:?}");
        }
    }

    #[test]
    fn device_specs_parse_and_print_back() {
        for (s, d) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), d);
        }
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
        for bad in ["", "cuda:", "cuda:x", "tpu", "cuda:-1"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains("expected \"cpu\""), "{bad:?}: {e}");
        }
    }

    #[test]
    fn cpu_opens_and_a_gpu_without_the_feature_is_a_clear_error() {
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
            assert!(e.contains("cuda:0 cannot be opened"), "{e}");
        }
    }

    #[test]
    fn dtypes_parse_and_serde_round_trip() {
        assert_eq!("bf16".parse::<WeightDType>().unwrap().dtype(), DType::BF16);
        assert!("int8".parse::<WeightDType>().is_err());
        #[derive(Serialize, Deserialize)]
        struct C {
            device: DeviceSpec,
            dtype: WeightDType,
        }
        let c: C = serde_json::from_str(r#"{"device":"cuda:1","dtype":"bf16"}"#).unwrap();
        assert_eq!(
            (c.device, c.dtype),
            (DeviceSpec::Cuda(1), WeightDType::Bf16)
        );
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"device":"cuda:1","dtype":"bf16"}"#
        );
        let e = serde_json::from_str::<C>(r#"{"device":"gpu7","dtype":"f32"}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("gpu7"), "{e}");
    }
}
