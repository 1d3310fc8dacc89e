//! The pipeline × data mesh: where each rank sits ([`PipelineLayout`]), the groups it talks to, and what its
//! pipelined steps share ([`Stages`]); its strategy is `stage_strategy::Staged`.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use serde::{Deserialize, Serialize};

use super::trace::StageTrace;
use crate::config::PipelineSchedule;
use crate::distributed::ProcessGroup;
use crate::distributed::tensor_comm::TensorComm;
use crate::error::{Error, Result};

/// Where a rank sits in the pipeline × data mesh: rank `r` of `W` runs stage `r / (W / stages)` of data-parallel
/// replica `r % (W / stages)` (torchtitan's mesh, pipeline dimension outermost; the whole mesh is
/// [`ParallelDims`](crate::ParallelDims)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineLayout {
    /// This rank's stage (0 runs what precedes the blocks, `stages - 1` what follows them and the loss).
    pub stage: usize,
    /// Pipeline stages (`pp_size`; 1 without a pipeline).
    pub stages: usize,
    /// This rank's data-parallel replica: its index in its stage's group, and the shard of the data it reads.
    pub replica: usize,
    /// Data-parallel replicas (ranks per stage).
    pub replicas: usize,
}

impl PipelineLayout {
    /// Whether this rank runs the first stage.
    pub fn is_first_stage(&self) -> bool {
        self.stage == 0
    }

    /// Whether this rank runs the last stage (the one that computes the loss).
    pub fn is_last_stage(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// What a pipelined rank's step needs beyond its data-parallel strategy: its place, the stage group's
/// communication (activations forward, their gradients back), the schedule, and its last step's trace.
#[derive(Debug)]
pub(crate) struct Stages {
    /// This rank's place in the mesh.
    pub layout: PipelineLayout,
    /// The ranks of one stage: its data-parallel replicas times its tensor-parallel ranks (rank `r` runs stage
    /// `r / stage_ranks`).
    pub stage_ranks: usize,
    /// The ranks of this replica's pipeline, one per stage, numbered by stage.
    pub comm: Arc<dyn TensorComm>,
    /// How each stage orders its passes.
    pub schedule: PipelineSchedule,
    /// Micro-batches per batch.
    pub micro_batches: usize,
    /// The last step's trace on this rank.
    pub last_trace: Mutex<Option<StageTrace>>,
    /// Each stage's blocks, once cut (at `prepare_blocks`, or at the first step of a model prepared whole).
    pub cut: Mutex<Option<Vec<Range<usize>>>>,
    /// The user's counts of blocks per stage (`pp_stage_blocks`), if any.
    pub stage_blocks: Option<Vec<usize>>,
    /// While `prepare_blocks` prepares a model: the stages that keep each parameter, by position (visiting order:
    /// a block's, the stage that runs it; one outside the blocks, the first and the last stage, whose `before` and
    /// `after` can reach it; empty: every stage), and the position of the next to arrive.
    pub arrivals: Mutex<Option<(Vec<Vec<usize>>, usize)>>,
    /// The elements of each parameter outside the blocks that arrived here as a placeholder (a middle stage's
    /// embeddings and head): what a sum over the stages needs of it.
    pub rest_lens: Mutex<HashMap<ParamId, usize>>,
    /// The parameters outside the blocks that more than one stage uses (a tied embedding and head), with their
    /// lengths: found at the first window's end.
    pub tied: Mutex<Option<Vec<(ParamId, usize)>>>,
    /// The first stage that trains each parameter outside the blocks (the one a save takes it from): found at the
    /// first window's end.
    pub rest_owner: Mutex<Option<HashMap<ParamId, usize>>>,
    /// The parameters outside the blocks that this stage's passes reach, on any of its replicas: what its
    /// data-parallel group reduces of them, the same list on every replica. Found at the first window's end.
    pub rest_reached: Mutex<Option<HashSet<ParamId>>>,
    /// The parameters outside the blocks that another stage trains and this one's passes never reach (the
    /// embedding on the last stage, the head on the first, both on the middle ones): found at the first window's
    /// end, then dropped to placeholders after the optimizer step (`dropped_rest` once done).
    pub rest_elsewhere: Mutex<Option<HashSet<ParamId>>>,
    /// Whether those were dropped.
    pub dropped_rest: std::sync::atomic::AtomicBool,
    /// Whether the stage's model keeps its copy of those instead (burn-train's Learner, which cannot change its
    /// model's shapes): the stage's strategy forgets them all the same, so they are never used, gathered or
    /// trained here.
    pub keeps_rest: std::sync::atomic::AtomicBool,
    /// The whole run's ranks (initial weights, a save's fetches).
    pub world: Arc<dyn TensorComm>,
    /// This replica's pipeline as a process group (debug mode's check of each step).
    pub pipe: Arc<ProcessGroup>,
    /// What a transfer of this stage is called in errors (a timeout, a peer that failed): it names the stage, the
    /// replica and the rank.
    pub transfer: String,
}

impl Stages {
    /// Whether this stage trains parameter `id` outside the blocks (the first stage whose passes reach it), once
    /// the first window's end found out; `None` for a parameter of the blocks, and before that.
    pub fn trains_here(&self, id: ParamId) -> Option<bool> {
        self.rest_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|owners| owners.get(&id))
            .map(|owner| *owner == self.layout.stage)
    }

    /// Each stage's contiguous run of `model`'s blocks: cut once, from the blocks' parameters while the model is
    /// whole, and kept (a stage's model holds placeholders for the other stages' blocks afterwards).
    ///
    /// # Errors
    /// Fewer blocks than stages.
    pub fn blocks_of<M: crate::Blocks>(&self, model: &M) -> Result<Vec<Range<usize>>> {
        let mut cut = self.cut.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ranges) = cut.as_ref()
            && ranges.last().map(|r| r.end) == Some(model.blocks().len())
        {
            return Ok(ranges.clone());
        }
        let ranges = match &self.stage_blocks {
            Some(counts) => {
                let blocks = model.blocks().len();
                if counts.iter().sum::<usize>() != blocks {
                    return Err(Error::InvalidArgument(format!(
                        "pp_stage_blocks {counts:?} runs {} block(s), and the model has {blocks}: give each stage its \
                         count so that they add up to the model's blocks",
                        counts.iter().sum::<usize>()
                    )));
                }
                let mut start = 0;
                counts
                    .iter()
                    .map(|n| {
                        start += n;
                        start - n..start
                    })
                    .collect()
            }
            None => crate::model::stage_blocks(model, self.layout.stages)?,
        };
        *cut = Some(ranges.clone());
        Ok(ranges)
    }
}
