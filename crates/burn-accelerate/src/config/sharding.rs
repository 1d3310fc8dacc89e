//! How much of the training state each rank holds: Accelerate's FSDP `sharding_strategy`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How the training state is split across ranks, named as Accelerate's FSDP `fsdp_sharding_strategy` (and
/// DeepSpeed's ZeRO stages).
///
/// Every trainable parameter is cut along its first dimension into one even slice per rank (FSDP2's `Shard(0)`;
/// the last slice padded with zero rows, so that every rank holds the same share of every tensor, however large
/// one tensor is). Each rank keeps the optimizer state and the reduced gradients of its slices only (burn-train's
/// Learner, whose optimizer steps whole parameters, has each owned whole by one rank, balanced by size):
///
/// | strategy | gradients after the sync step | optimizer state | parameters between steps | ZeRO |
/// |---|---|---|---|---|
/// | `NoShard` | all, on every rank (all-reduce) | all | all | DDP |
/// | `ShardGradOp` | this rank's slices (reduce-scatter) | this rank's slices | all (all-gathered after the step) | 2 |
/// | `FullShard` | this rank's slices (reduce-scatter) | this rank's slices | this rank's slices (the model never arrives whole at `prepare_model`); gathered block by block by [`Accelerator::backward_blocks`](crate::Accelerator::backward_blocks), or whole by [`Accelerator::unshard`](crate::Accelerator::unshard) | 3 |
/// | `HybridShard` | as `FullShard` within a shard group, then averaged across the groups (all-reduce) | this rank's in its group | as `FullShard`, gathered within the group | 3 within, DDP across |
/// | `HybridShardZero2` | as `ShardGradOp` within a shard group, then averaged across the groups | this rank's in its group | all | 2 within, DDP across |
///
/// The hybrid strategies shard within groups of [`dp_shard_size`](crate::AcceleratorBuilder::dp_shard_size)
/// consecutive ranks (default: the processes of one machine) and replicate across the groups, as FSDP's
/// `HYBRID_SHARD` does between machines: the parameter gathers stay inside a machine.
///
/// Set it with [`AcceleratorBuilder::sharding`](crate::AcceleratorBuilder::sharding), the config file
/// (`distributed_type: FSDP` with `fsdp_config: {fsdp_sharding_strategy: SHARD_GRAD_OP}`),
/// `ACCELERATE_USE_FSDP=true` with `FSDP_SHARDING_STRATEGY`, or `burn-accelerate launch --use_fsdp
/// --fsdp_sharding_strategy SHARD_GRAD_OP`. Names and Accelerate's numbers are both accepted:
///
/// ```
/// use burn_accelerate::ShardingStrategy;
/// assert_eq!("SHARD_GRAD_OP".parse::<ShardingStrategy>()?, ShardingStrategy::ShardGradOp);
/// assert_eq!("1".parse::<ShardingStrategy>()?, ShardingStrategy::FullShard);
/// assert_eq!("4".parse::<ShardingStrategy>()?, ShardingStrategy::HybridShard);
/// assert_eq!("_HYBRID_SHARD_ZERO2".parse::<ShardingStrategy>()?, ShardingStrategy::HybridShardZero2);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    /// Every rank holds everything (data parallelism). The default.
    #[default]
    NoShard,
    /// Gradients and optimizer state sharded (ZeRO-2).
    ShardGradOp,
    /// Gradients, optimizer state and parameters sharded (ZeRO-3).
    FullShard,
    /// `FullShard` within each shard group, replicated across the groups (FSDP's `HYBRID_SHARD`).
    HybridShard,
    /// `ShardGradOp` within each shard group, replicated across the groups (FSDP's `_HYBRID_SHARD_ZERO2`).
    #[serde(rename = "_HYBRID_SHARD_ZERO2", alias = "HYBRID_SHARD_ZERO2")]
    HybridShardZero2,
}

impl ShardingStrategy {
    /// Accelerate's name (`NO_SHARD`, `SHARD_GRAD_OP`, `FULL_SHARD`).
    pub fn name(self) -> &'static str {
        match self {
            ShardingStrategy::NoShard => "NO_SHARD",
            ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
            ShardingStrategy::FullShard => "FULL_SHARD",
            ShardingStrategy::HybridShard => "HYBRID_SHARD",
            ShardingStrategy::HybridShardZero2 => "_HYBRID_SHARD_ZERO2",
        }
    }

    /// What a rank holds at its peak, in a training step under this strategy, with `P` ranks (or `P` in a shard
    /// group): what `burn-accelerate env` says of it.
    pub fn peak_memory(self) -> &'static str {
        match self {
            ShardingStrategy::NoShard => {
                "every rank holds the whole model, its gradients and its optimizer state (16 bytes a parameter \
                 with f32 Adam) and the activations of the whole forward pass"
            }
            ShardingStrategy::ShardGradOp | ShardingStrategy::HybridShardZero2 => {
                "every rank holds the whole model and, during backward, every gradient; between steps only its \
                 own gradients and optimizer state (1/P)"
            }
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard => {
                "with backward_blocks: 1/P of the parameters, gradients and optimizer state, one block gathered \
                 at a time and the activations between blocks, for one more forward pass per step; with unshard \
                 and backward: the whole model and every gradient at the peak (only 1/P between steps)"
            }
        }
    }

    /// Whether each rank drops the parameters it does not own between steps (`FULL_SHARD`, `HYBRID_SHARD`).
    pub fn reshards_parameters(self) -> bool {
        matches!(
            self,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        )
    }

    /// Whether the state is sharded within groups and replicated across them (`HYBRID_SHARD`,
    /// `_HYBRID_SHARD_ZERO2`).
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2
        )
    }

    /// Whether ranks hold only part of the state.
    pub fn is_sharded(self) -> bool {
        self != ShardingStrategy::NoShard
    }

    /// The strategy of FSDP2's `reshard_after_forward` (`fsdp_reshard_after_forward` in a config file):
    /// parameters resharded between uses are `FULL_SHARD`, kept whole are `SHARD_GRAD_OP`.
    pub fn from_reshard_after_forward(reshard: bool) -> Self {
        if reshard {
            ShardingStrategy::FullShard
        } else {
            ShardingStrategy::ShardGradOp
        }
    }
}

impl fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ShardingStrategy {
    type Err = Error;

    /// Accelerate's names, in any case, and its numbers: 1 `FULL_SHARD`, 2 `SHARD_GRAD_OP`, 3 `NO_SHARD`,
    /// 4 `HYBRID_SHARD`, 5 `_HYBRID_SHARD_ZERO2`.
    fn from_str(s: &str) -> Result<Self> {
        let text = s.trim();
        match text.to_ascii_uppercase().as_str() {
            "NO_SHARD" | "3" => Ok(ShardingStrategy::NoShard),
            "SHARD_GRAD_OP" | "2" => Ok(ShardingStrategy::ShardGradOp),
            "FULL_SHARD" | "1" => Ok(ShardingStrategy::FullShard),
            "HYBRID_SHARD" | "4" => Ok(ShardingStrategy::HybridShard),
            "_HYBRID_SHARD_ZERO2" | "HYBRID_SHARD_ZERO2" | "5" => {
                Ok(ShardingStrategy::HybridShardZero2)
            }
            _ => Err(Error::config(
                "fsdp_sharding_strategy",
                text,
                "configuration",
                "FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4) or _HYBRID_SHARD_ZERO2 (5)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_are_accelerates() {
        for (text, expected) in [
            ("FULL_SHARD", ShardingStrategy::FullShard),
            ("full_shard", ShardingStrategy::FullShard),
            ("1", ShardingStrategy::FullShard),
            ("SHARD_GRAD_OP", ShardingStrategy::ShardGradOp),
            (" 2 ", ShardingStrategy::ShardGradOp),
            ("NO_SHARD", ShardingStrategy::NoShard),
            ("3", ShardingStrategy::NoShard),
            ("HYBRID_SHARD", ShardingStrategy::HybridShard),
            ("4", ShardingStrategy::HybridShard),
            ("_HYBRID_SHARD_ZERO2", ShardingStrategy::HybridShardZero2),
            ("hybrid_shard_zero2", ShardingStrategy::HybridShardZero2),
            ("5", ShardingStrategy::HybridShardZero2),
        ] {
            assert_eq!(
                text.parse::<ShardingStrategy>().unwrap(),
                expected,
                "{text}"
            );
            assert_eq!(
                expected.name().parse::<ShardingStrategy>().unwrap(),
                expected
            );
        }
        let yaml = serde_json::to_string(&ShardingStrategy::HybridShardZero2).unwrap();
        assert_eq!(yaml, "\"_HYBRID_SHARD_ZERO2\"");
        let err = "ZERO9".parse::<ShardingStrategy>().unwrap_err().to_string();
        assert!(
            err.contains("ZERO9") && err.contains("SHARD_GRAD_OP (2)"),
            "{err}"
        );
    }
}
