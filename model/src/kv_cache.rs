//! The key/value cache of incremental decoding (prefill once, then one token at a time) and of
//! the learner's prompt passes.

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// Keys and values of past tokens, per layer, for incremental decoding.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(crate) layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per row, whether each cached token is real.
    pub(crate) valid: Vec<Vec<bool>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Tokens cached per row.
    pub fn len(&self) -> usize {
        self.valid.first().map(Vec::len).unwrap_or(0)
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `i` is this cache's row `rows[i]` (rows may repeat: choices sharing one prefill).
    pub fn select_rows(&self, rows: &[usize]) -> Result<Self> {
        let valid = rows
            .iter()
            .map(|&r| {
                self.valid.get(r).cloned().ok_or_else(|| {
                    ModelError::InvalidArgument(format!(
                        "row {r} of a cache of {} rows",
                        self.valid.len()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let index: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let layers = match self.layers.iter().flatten().next() {
            None => self.layers.clone(),
            Some((k, _)) => {
                let index = Tensor::from_vec(index, rows.len(), k.device())?;
                self.layers
                    .iter()
                    .map(|l| match l {
                        Some((k, v)) => Ok(Some((
                            k.index_select(&index, 0)?,
                            v.index_select(&index, 0)?,
                        ))),
                        None => Ok(None),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        Ok(Self { layers, valid })
    }
}
