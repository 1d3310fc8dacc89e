//! Context parallelism's settings: how keys and values reach every rank of a context group, and how each
//! sequence is cut into the ranks' slices.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable that sets [`DistributedSettings::cp_comm_strategy`](super::DistributedSettings).
pub const CP_COMM_STRATEGY_VAR: &str = "PARALLELISM_CONFIG_CP_COMM_STRATEGY";
/// The environment variable that sets [`DistributedSettings::cp_load_balance`](super::DistributedSettings).
pub const CP_LOAD_BALANCE_VAR: &str = "PARALLELISM_CONFIG_CP_LOAD_BALANCE";

/// How a context group's attention sees the keys and values of the whole sequence (Accelerate's
/// `cp_comm_strategy`, torchtitan's `context_parallel_rotate_method`, Megatron's `--cp-comm-type`).
///
/// ```
/// use burn_accelerate::config::ContextAttention;
/// assert_eq!("allgather".parse::<ContextAttention>()?, ContextAttention::AllGather);
/// // Accelerate's name for the rotation of key/value blocks around the ranks.
/// assert_eq!("alltoall".parse::<ContextAttention>()?, ContextAttention::Ring);
/// assert_eq!("ring".parse::<ContextAttention>()?, ContextAttention::Ring);
/// assert!("ulysses".parse::<ContextAttention>().is_err());
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ContextAttention {
    /// Every rank gathers the keys and values of the whole sequence and attends its queries to them; their
    /// gradients are reduce-scattered back (the default). Simple; each rank holds the sequence's keys and values.
    #[default]
    #[serde(rename = "allgather")]
    AllGather,
    /// Ring attention: key/value blocks travel around the ranks, one block per step, each step's partial result
    /// merged by log-sum-exp and blocks a causal mask hides skipped; the backward pass recomputes each step's
    /// scores and sends the key/value gradients around the ring. Each rank holds two blocks at a time.
    #[serde(rename = "ring")]
    Ring,
}

impl ContextAttention {
    /// The setting's spelling (`allgather`, `ring`).
    pub fn name(self) -> &'static str {
        match self {
            ContextAttention::AllGather => "allgather",
            ContextAttention::Ring => "ring",
        }
    }
}

impl fmt::Display for ContextAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ContextAttention {
    type Err = Error;

    /// `allgather` (also `all_gather`, `all-gather`), or `ring` (also `alltoall`, Accelerate's name for it, and
    /// `p2p`, Megatron's), in any case.
    fn from_str(s: &str) -> Result<Self> {
        match s
            .trim()
            .to_ascii_lowercase()
            .replace(['_', '-'], "")
            .as_str()
        {
            "allgather" => Ok(ContextAttention::AllGather),
            "ring" | "alltoall" | "p2p" => Ok(ContextAttention::Ring),
            _ => Err(Error::config(
                "cp_comm_strategy",
                s.trim(),
                "configuration",
                "allgather or ring (alltoall)",
            )),
        }
    }
}
