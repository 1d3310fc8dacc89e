//! The device mesh: one named dimension per parallelism ([`ParallelDims`], torchtitan's `ParallelDims`), where
//! this rank sits on it ([`MeshCoords`]), and the sub-groups each parallelism takes of it (`Mesh`), built once
//! from the settings. Every group split in the crate comes from here.
//!
//! The dimensions, outermost first: `pp` (pipeline stages), `dp_replicate` (replicas of the whole state),
//! `dp_shard` (ranks one state is sharded over), `cp` (context parallelism), `tp` (tensor parallelism). Rank `r`
//! is the row-major index of its coordinates: `tp` varies fastest, `pp` slowest, so that a stage's ranks are
//! consecutive and a shard group's too.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};

/// The size of each dimension of the device mesh; their product is the number of ranks.
///
/// ```
/// use burn_accelerate::ParallelDims;
///
/// let dims = ParallelDims { pp: 2, dp_replicate: 1, dp_shard: 4, cp: 1, tp: 1 };
/// assert_eq!(dims.world_size(), 8);
/// let place = dims.coords(5);
/// assert_eq!((place.pp, place.dp_shard), (1, 1));
/// assert_eq!(place.dp(&dims), 1);
/// assert_eq!(dims.to_string(), "pp 2 × dp_replicate 1 × dp_shard 4 × cp 1 × tp 1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParallelDims {
    /// Pipeline stages (`pp_size`).
    pub pp: usize,
    /// Replicas of the training state: data-parallel ranks that hold the same state (`NO_SHARD`'s ranks, a hybrid
    /// strategy's shard groups).
    pub dp_replicate: usize,
    /// Ranks one training state is sharded over (`SHARD_GRAD_OP`'s and `FULL_SHARD`'s ranks, a hybrid strategy's
    /// `dp_shard_size`).
    pub dp_shard: usize,
    /// Context-parallel ranks (`cp_size`): each holds a slice of every sequence.
    pub cp: usize,
    /// Tensor-parallel ranks (`tp_size`): each holds a slice of every layer a plan splits.
    pub tp: usize,
}

/// Where one rank sits on the mesh: its index along each dimension of [`ParallelDims`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshCoords {
    /// Its pipeline stage.
    pub pp: usize,
    /// Its replica of the training state.
    pub dp_replicate: usize,
    /// Its shard of the training state.
    pub dp_shard: usize,
    /// Its context-parallel rank.
    pub cp: usize,
    /// Its tensor-parallel rank.
    pub tp: usize,
}

impl MeshCoords {
    /// Its data-parallel index (`dp_replicate × dp_shard`): which shard of the data it reads. Every rank of one
    /// data-parallel index (its pipeline stages, its tensor and context ranks) reads the same batches.
    pub fn dp(&self, dims: &ParallelDims) -> usize {
        self.dp_replicate * dims.dp_shard + self.dp_shard
    }
}

impl ParallelDims {
    /// One process alone: every dimension 1.
    pub const ONE: Self = Self {
        pp: 1,
        dp_replicate: 1,
        dp_shard: 1,
        cp: 1,
        tp: 1,
    };

    /// Plain data parallelism over `world` ranks, every rank a replica.
    pub fn data_parallel(world: usize) -> Self {
        Self {
            dp_replicate: world,
            ..Self::ONE
        }
    }

    /// The mesh `config` asks of `world` ranks, `local_world` of them on this machine (a hybrid strategy's default
    /// shard group).
    ///
    /// # Errors
    /// A size of 0; `pp_size` × `tp_size` × `cp_size` not dividing the ranks; a `dp_shard_size` that does not divide
    /// the data-parallel ranks; `cp_size` × `tp_size` not dividing the ranks, or `cp_size` above 1 under a pipeline.
    /// Each error names its setting and how to set it.
    pub fn from_config(
        config: &AcceleratorConfig,
        world: usize,
        local_world: usize,
    ) -> Result<Self> {
        let (pp, tp, cp) = (
            config.pipeline.pp_size,
            config.distributed.tp_size,
            config.distributed.cp_size,
        );
        for (name, size) in [("tp_size", tp), ("cp_size", cp)] {
            if size == 0 {
                return Err(Error::config(
                    name,
                    "0",
                    "configuration",
                    "a number of ranks of 1 or more",
                ));
            }
        }
        if cp > 1 && pp > 1 {
            return Err(Error::config(
                "cp_size",
                cp.to_string(),
                "configuration",
                format!(
                    "1 under a pipeline (pp_size {pp}): context parallelism does not run inside pipeline stages \
                     yet; set cp_size 1, or pp_size 1"
                ),
            ));
        }
        if cp > 1 && !world.is_multiple_of(cp * tp) {
            return Err(Error::InvalidArgument(format!(
                "cp_size {cp} × tp_size {tp} does not divide the {world} rank(s) of this run: each context group \
                 needs {cp} ranks (of one tensor-parallel index); launch a multiple of {} processes, or set cp_size \
                 to a divisor of {}",
                cp * tp,
                world / tp.max(1)
            )));
        }
        let inner = pp * tp * cp;
        if tp > 1 && !world.is_multiple_of(tp) {
            return Err(Error::InvalidArgument(format!(
                "tp_size {tp} does not divide the {world} rank(s) of this run: each tensor-parallel group needs \
                 {tp} ranks; launch a multiple of {tp} processes, or set tp_size to a divisor of {world}"
            )));
        }
        if pp == 0 || !world.is_multiple_of(inner) {
            return Err(Error::InvalidArgument(format!(
                "pp_size {pp} does not divide the {world} rank(s) of this run: each stage needs the same number \
                 of ranks; launch a multiple of {pp} processes, or set pp_size to a divisor of {world}"
            )));
        }
        let dp = world / inner;
        let sharding = config.distributed.sharding;
        let (dp_replicate, dp_shard) = if !sharding.is_sharded() || dp == 1 {
            (dp, 1)
        } else if sharding.is_hybrid() {
            let shard = config
                .distributed
                .dp_shard_size
                .unwrap_or_else(|| gcd(local_world.max(1), dp));
            if shard == 0 || !dp.is_multiple_of(shard) {
                return Err(Error::config(
                    "dp_shard_size",
                    shard.to_string(),
                    "configuration",
                    format!(
                        "a number of ranks per shard group that divides the {dp} data-parallel ranks (set it \
                         with AcceleratorBuilder::dp_shard_size or PARALLELISM_CONFIG_DP_SHARD_SIZE)"
                    ),
                ));
            }
            (dp / shard, shard)
        } else {
            (1, dp)
        };
        Ok(Self {
            pp,
            dp_replicate,
            dp_shard,
            cp,
            tp,
        })
    }

    /// The number of ranks: the product of the dimensions.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp() * self.cp * self.tp
    }

    /// Data-parallel ranks per stage: `dp_replicate × dp_shard`, the shards of the data.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// Where rank `rank` sits.
    pub fn coords(&self, rank: usize) -> MeshCoords {
        let tp = rank % self.tp;
        let rest = rank / self.tp;
        let cp = rest % self.cp;
        let rest = rest / self.cp;
        let dp_shard = rest % self.dp_shard;
        let rest = rest / self.dp_shard;
        let dp_replicate = rest % self.dp_replicate;
        MeshCoords {
            pp: rest / self.dp_replicate,
            dp_replicate,
            dp_shard,
            cp,
            tp,
        }
    }
}

impl fmt::Display for ParallelDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pp {} × dp_replicate {} × dp_shard {} × cp {} × tp {}",
            self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp
        )
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The mesh of one rank: the dimensions, its coordinates, and the sub-groups its parallelisms talk over, split
/// once, in the same order on every rank.
#[derive(Debug, Clone)]
pub(crate) struct Mesh {
    /// The size of each dimension.
    pub dims: ParallelDims,
    /// This rank's place.
    pub coords: MeshCoords,
    /// Every rank of the run.
    pub world: Arc<ProcessGroup>,
    /// The data-parallel ranks of this rank's stage (and tensor and context rank): the ranks whose data differ.
    /// The whole world without a pipeline, tensor or context parallelism.
    pub dp: Arc<ProcessGroup>,
    /// The ranks gradients are reduced (and a sharded strategy's state sharded) over: `dp` with every context rank
    /// of each (`dp × cp`, torchtitan's `dp_shard_cp`), numbered `dp × cp + cp`. `dp` itself with `cp` 1.
    pub grad: Arc<ProcessGroup>,
    /// This rank's context group (the ranks of its data-parallel and tensor-parallel index), numbered by `cp`
    /// coordinate; `None` with `cp` 1.
    pub cp: Option<Arc<ProcessGroup>>,
    /// This replica's pipeline, one rank per stage, numbered by stage; `None` without a pipeline.
    pub pp: Option<Arc<ProcessGroup>>,
    /// This rank's tensor-parallel group (the ranks of its data-parallel index), numbered by `tp` coordinate;
    /// `None` with `tp` 1.
    pub tp: Option<Arc<ProcessGroup>>,
    /// Under a pipeline of tensor-parallel groups: the ranks of this rank's stage (its data-parallel and
    /// tensor-parallel ranks), numbered `dp × tp`; `None` otherwise.
    pub stage: Option<Arc<ProcessGroup>>,
    /// Under a hybrid strategy over more than one data-parallel rank: the shard group (`dp_shard` consecutive ranks
    /// of `dp`) and the replica group (the `dp_replicate` ranks holding the same slice), in that order.
    pub hybrid: Option<(Arc<ProcessGroup>, Arc<ProcessGroup>)>,
}

impl Mesh {
    /// The mesh `config` asks of `world`'s ranks, its sub-groups split.
    ///
    /// # Errors
    /// As [`ParallelDims::from_config`]; a sub-group that cannot be split.
    pub fn build(world: &Arc<ProcessGroup>, config: &AcceleratorConfig) -> Result<Self> {
        let dims =
            ParallelDims::from_config(config, world.num_processes(), world.local_world_size())?;
        Self::of(world, dims, config.distributed.sharding.is_hybrid())
    }

    /// Plain data parallelism over `world` (a strategy the user made).
    pub fn data_parallel(world: &Arc<ProcessGroup>) -> Self {
        let dims = ParallelDims::data_parallel(world.num_processes());
        Self {
            coords: dims.coords(world.process_index()),
            dims,
            world: world.clone(),
            dp: world.clone(),
            grad: world.clone(),
            cp: None,
            pp: None,
            tp: None,
            stage: None,
            hybrid: None,
        }
    }

    fn of(world: &Arc<ProcessGroup>, dims: ParallelDims, hybrid: bool) -> Result<Self> {
        let coords = dims.coords(world.process_index());
        let dp_index = coords.dp(&dims);
        // Every rank splits in the same order: its stage's data-parallel group, then its replica's pipeline, then a
        // hybrid strategy's shard and replica groups within the data-parallel group.
        if dims.cp > 1 {
            return Self::with_context(world, dims, hybrid);
        }
        let (dp, pp, tp, stage) = if dims.pp > 1 && dims.tp > 1 {
            // A stage's ranks of one tensor-parallel index read different data; a replica's ranks of one stage form
            // a tensor-parallel group; the ranks of one data-parallel and tensor-parallel index, one per stage, a
            // pipeline.
            let (pp_i, tp_i) = (coords.pp, coords.tp);
            let dp = Arc::new(world.split(pp_i * dims.tp + tp_i, dp_index)?);
            let pp = Arc::new(world.split(dp_index * dims.tp + tp_i, pp_i)?);
            let tp = Arc::new(world.split(pp_i * dims.dp() + dp_index, tp_i)?);
            let stage = Arc::new(world.split(pp_i, dp_index * dims.tp + tp_i)?);
            (dp, Some(pp), Some(tp), Some(stage))
        } else if dims.pp > 1 {
            let dp = Arc::new(world.split(coords.pp, dp_index)?);
            let pp = Arc::new(world.split(dp_index, coords.pp)?);
            (dp, Some(pp), None, None)
        } else if dims.tp > 1 {
            // The ranks of one tensor-parallel index read different data; those of one data-parallel index form a
            // tensor-parallel group.
            let dp = Arc::new(world.split(coords.tp, dp_index)?);
            let tp = Arc::new(world.split(dp_index, coords.tp)?);
            (dp, None, Some(tp), None)
        } else {
            (world.clone(), None, None, None)
        };
        let hybrid = if hybrid && dims.dp() > 1 {
            Some(hybrid_groups(&dp, dims.dp_shard)?)
        } else {
            None
        };
        Ok(Self {
            dims,
            coords,
            world: world.clone(),
            grad: dp.clone(),
            cp: None,
            dp,
            pp,
            tp,
            stage,
            hybrid,
        })
    }

    /// The mesh of a context-parallel run (`cp` > 1, no pipeline): the data-parallel group (one context and
    /// tensor index), the context group, the tensor-parallel group, and the gradient group (`dp × cp` of one tensor
    /// index), split in that order; a hybrid strategy's groups within the gradient group, each shard group
    /// `dp_shard × cp` consecutive ranks of it.
    fn with_context(world: &Arc<ProcessGroup>, dims: ParallelDims, hybrid: bool) -> Result<Self> {
        let coords = dims.coords(world.process_index());
        let (dp_i, cp_i, tp_i) = (coords.dp(&dims), coords.cp, coords.tp);
        let dp = Arc::new(world.split(cp_i * dims.tp + tp_i, dp_i)?);
        let cp = Arc::new(world.split(dp_i * dims.tp + tp_i, cp_i)?);
        let (tp, grad) = match dims.tp > 1 {
            true => (
                Some(Arc::new(world.split(dp_i * dims.cp + cp_i, tp_i)?)),
                Arc::new(world.split(tp_i, dp_i * dims.cp + cp_i)?),
            ),
            // One tensor index: every rank reduces gradients with every other, in world order.
            false => (None, world.clone()),
        };
        let hybrid = match hybrid && dims.dp() > 1 {
            true => Some(hybrid_groups(&grad, dims.dp_shard * dims.cp)?),
            false => None,
        };
        Ok(Self {
            dims,
            coords,
            world: world.clone(),
            dp,
            grad,
            cp: Some(cp),
            pp: None,
            tp,
            stage: None,
            hybrid,
        })
    }
}

/// A hybrid strategy's groups of `dp`'s ranks: the shard group (`shard_size` consecutive ranks) and the replica
/// group (the ranks holding the same slice: one per shard group), split in that order.
///
/// # Errors
/// A shard size that does not divide the ranks; a group that cannot be split.
pub(crate) fn hybrid_groups(
    dp: &Arc<ProcessGroup>,
    shard_size: usize,
) -> Result<(Arc<ProcessGroup>, Arc<ProcessGroup>)> {
    let (rank, ranks) = (dp.process_index(), dp.num_processes());
    if shard_size == 0 || !ranks.is_multiple_of(shard_size) {
        return Err(Error::config(
            "dp_shard_size",
            shard_size.to_string(),
            "configuration",
            format!(
                "a number of ranks per shard group that divides the {ranks} data-parallel ranks (set it with \
                 AcceleratorBuilder::dp_shard_size or PARALLELISM_CONFIG_DP_SHARD_SIZE)"
            ),
        ));
    }
    let shards = Arc::new(dp.split(rank / shard_size, rank)?);
    let replicas = Arc::new(dp.split(rank % shard_size, rank)?);
    Ok((shards, replicas))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShardingStrategy;

    fn config(pp: usize, sharding: ShardingStrategy, shard: Option<usize>) -> AcceleratorConfig {
        let mut config = AcceleratorConfig::default();
        config.pipeline.pp_size = pp;
        config.distributed.sharding = sharding;
        config.distributed.dp_shard_size = shard;
        config
    }

    #[test]
    fn each_strategy_takes_its_dimensions_and_the_ranks_fill_the_innermost_first() {
        let dims = |pp, s, shard, world, local| {
            ParallelDims::from_config(&config(pp, s, shard), world, local)
        };
        let no_shard = dims(1, ShardingStrategy::NoShard, None, 4, 4).unwrap();
        assert_eq!((no_shard.dp_replicate, no_shard.dp_shard), (4, 1));
        let full = dims(2, ShardingStrategy::FullShard, None, 8, 8).unwrap();
        assert_eq!((full.pp, full.dp_replicate, full.dp_shard), (2, 1, 4));
        let hybrid = dims(1, ShardingStrategy::HybridShard, Some(2), 8, 8).unwrap();
        assert_eq!((hybrid.dp_replicate, hybrid.dp_shard), (4, 2));
        // The default shard group: the ranks of one machine within a stage.
        let machines = dims(2, ShardingStrategy::HybridShard, None, 8, 2).unwrap();
        assert_eq!((machines.dp_replicate, machines.dp_shard), (2, 2));
        for d in [no_shard, full, hybrid, machines] {
            assert_eq!(d.world_size(), if d == no_shard { 4 } else { 8 });
            let places: Vec<_> = (0..d.world_size()).map(|r| d.coords(r)).collect();
            // Row-major: a stage's ranks are consecutive, and a shard group's within it.
            for (r, c) in places.iter().enumerate() {
                assert_eq!(c.pp * d.dp() + c.dp(&d), r, "{d}: rank {r} at {c:?}");
            }
        }
        let places: Vec<_> = (0..6)
            .map(|r| {
                let c =
                    ParallelDims::from_config(&config(3, ShardingStrategy::NoShard, None), 6, 6)
                        .unwrap()
                        .coords(r);
                (c.pp, c.dp_replicate)
            })
            .collect();
        assert_eq!(places, vec![(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
    }

    #[test]
    fn a_mesh_that_does_not_fit_the_ranks_says_which_setting_to_change() {
        let err = ParallelDims::from_config(&config(4, ShardingStrategy::NoShard, None), 6, 6)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pp_size 4 does not divide the 6 rank(s)"),
            "{err}"
        );
        let err =
            ParallelDims::from_config(&config(1, ShardingStrategy::HybridShard, Some(3)), 4, 4)
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("dp_shard_size") && err.contains("divides the 4"),
            "{err}"
        );
        // Context parallelism: cp varies faster than the data-parallel index, slower than tp.
        let mut c = config(1, ShardingStrategy::FullShard, None);
        c.distributed.cp_size = 2;
        c.distributed.tp_size = 2;
        let dims = ParallelDims::from_config(&c, 8, 8).unwrap();
        assert_eq!((dims.dp_shard, dims.cp, dims.tp), (2, 2, 2));
        let c6 = dims.coords(6);
        assert_eq!((c6.dp(&dims), c6.cp, c6.tp), (1, 1, 0));
        let err = ParallelDims::from_config(&c, 6, 6).unwrap_err().to_string();
        assert!(
            err.contains("cp_size 2 × tp_size 2 does not divide the 6"),
            "{err}"
        );
        c.pipeline.pp_size = 2;
        let err = ParallelDims::from_config(&c, 8, 8).unwrap_err().to_string();
        assert!(
            err.contains("cp_size") && err.contains("under a pipeline"),
            "{err}"
        );
        // A pipeline of tensor-parallel stages: rank 6 is stage 1's replica 1, its tensor-parallel rank 0.
        let mut c = config(2, ShardingStrategy::NoShard, None);
        c.distributed.tp_size = 2;
        let dims = ParallelDims::from_config(&c, 8, 8).unwrap();
        assert_eq!((dims.pp, dims.dp_replicate, dims.tp), (2, 2, 2));
        let c6 = dims.coords(6);
        assert_eq!((c6.pp, c6.dp(&dims), c6.tp), (1, 1, 0));
        // Sharded strategies shard over the ranks of one tensor-parallel index: FSDP2 + TP.
        let mut c = config(1, ShardingStrategy::FullShard, None);
        c.distributed.tp_size = 2;
        let dims = ParallelDims::from_config(&c, 4, 4).unwrap();
        assert_eq!((dims.dp_replicate, dims.dp_shard, dims.tp), (1, 2, 2));
        let mut c = config(1, ShardingStrategy::HybridShard, Some(2));
        c.distributed.tp_size = 2;
        let dims = ParallelDims::from_config(&c, 8, 8).unwrap();
        assert_eq!((dims.dp_replicate, dims.dp_shard, dims.tp), (2, 2, 2));
        // Rank 5: tp 1 of the shard group's rank 0, replica 1.
        let c5 = dims.coords(5);
        assert_eq!((c5.dp_replicate, c5.dp_shard, c5.tp), (1, 0, 1));
        let mut c = config(1, ShardingStrategy::NoShard, None);
        c.distributed.tp_size = 3;
        let err = ParallelDims::from_config(&c, 4, 4).unwrap_err().to_string();
        assert!(
            err.contains("tp_size 3 does not divide the 4 rank(s)"),
            "{err}"
        );
        // tp varies fastest: ranks 0 and 1 are one tensor-parallel group, 0 and 2 one data-parallel group.
        c.distributed.tp_size = 2;
        let dims = ParallelDims::from_config(&c, 4, 4).unwrap();
        assert_eq!((dims.dp_replicate, dims.tp), (2, 2));
        let places: Vec<_> = (0..4)
            .map(|r| (dims.coords(r).dp(&dims), dims.coords(r).tp))
            .collect();
        assert_eq!(places, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    }
}
