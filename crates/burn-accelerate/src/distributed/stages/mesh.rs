//! The pipeline × data mesh: where each rank sits ([`PipelineLayout`]), the groups it talks to, and the strategy
//! of a pipelined rank ([`Staged`]): the data-parallel strategy of its stage's group, with what a step shares
//! across the stages (the fp16 overflow verdict, the gradient norm, the initial weights) widened to them.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::trace::StageTrace;
use crate::config::{AcceleratorConfig, PipelineSchedule};
use crate::distributed::DistributedType;
use crate::distributed::ProcessGroup;
use crate::distributed::comm::ReduceOp;
use crate::distributed::strategy::{
    Arriving, BlockPass, FinishReduce, FinishUnshard, ModuleParams, ParamFetcher, Split,
    StateScope, Strategy, for_group,
};
use crate::distributed::tensor_comm::{Checked, HostTensorComm, TensorComm};
use crate::error::{Error, Result};
use crate::grad::{GradientBuffer, NormType};

/// Where a rank sits in the pipeline × data mesh: rank `r` of `W` runs stage `r / (W / stages)` of data-parallel
/// replica `r % (W / stages)` (torchtitan's mesh, pipeline dimension outermost).
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
    /// The place of rank `rank` of `world` ranks cut into `stages` stages.
    ///
    /// # Errors
    /// `stages` does not divide `world`.
    pub(crate) fn of(rank: usize, world: usize, stages: usize) -> Result<Self> {
        if stages == 0 || !world.is_multiple_of(stages) {
            return Err(Error::InvalidArgument(format!(
                "pp_size {stages} does not divide the {world} rank(s) of this run: each stage needs the same \
                 number of ranks; launch a multiple of {stages} processes, or set pp_size to a divisor of {world}"
            )));
        }
        let replicas = world / stages;
        Ok(Self {
            stage: rank / replicas,
            stages,
            replica: rank % replicas,
            replicas,
        })
    }

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
    /// While `prepare_blocks` prepares a model: the stage that runs each parameter, by position (visiting order;
    /// `None` for those outside the blocks, which every stage keeps), and the position of the next to arrive.
    pub arrivals: Mutex<Option<(Vec<Option<usize>>, usize)>>,
    /// The parameters outside the blocks that more than one stage uses (a tied embedding and head), with their
    /// lengths: found at the first window's end.
    pub tied: Mutex<Option<Vec<(ParamId, usize)>>>,
    /// The first stage that trains each parameter outside the blocks (the one a save takes it from): found at the
    /// first window's end.
    pub rest_owner: Mutex<Option<HashMap<ParamId, usize>>>,
    /// The parameters outside the blocks that another stage trains and this one's passes never reach (the
    /// embedding on the last stage, the head on the first, both on the middle ones): found at the first window's
    /// end, then dropped to placeholders after the optimizer step (`dropped_rest` once done).
    pub rest_elsewhere: Mutex<Option<HashSet<ParamId>>>,
    /// Whether those were dropped.
    pub dropped_rest: std::sync::atomic::AtomicBool,
    /// The whole run's ranks (initial weights, a save's fetches).
    pub world: Arc<dyn TensorComm>,
    /// What a transfer of this stage is called in errors (a timeout, a peer that failed): it names the stage, the
    /// replica and the rank.
    pub transfer: &'static str,
}

impl Stages {
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
        let ranges = crate::pipeline::stage_blocks(model, self.layout.stages)?;
        *cut = Some(ranges.clone());
        Ok(ranges)
    }
}

/// The groups of a pipelined rank of `group` under `config`: its data-parallel group's strategy (the ranks of its
/// stage) wrapped in [`Staged`], and the data-parallel group itself (the shard of the data this rank reads).
///
/// # Errors
/// `pp_size` does not divide the ranks; a group cannot be split or its strategy built.
pub(crate) fn for_mesh(
    group: &Arc<ProcessGroup>,
    config: &AcceleratorConfig,
) -> Result<(Arc<dyn Strategy>, Arc<ProcessGroup>)> {
    let world = group.num_processes();
    let layout = PipelineLayout::of(group.process_index(), world, config.pipeline.pp_size)?;
    // Every rank splits in the same order: its stage's data-parallel group, then its replica's pipeline.
    let data = Arc::new(group.split(layout.stage, layout.replica)?);
    let pipe = Arc::new(group.split(layout.replica, layout.stage)?);
    let inner = for_group(&data, config)?;
    // Activations and their gradients go where the gradient transport goes: the device where it can (in-process
    // stages sharing a GPU hand each other the tensors), host memory otherwise.
    let (stage_comm, choice) = crate::distributed::tensor_comm::on_device::select(
        &pipe,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        false,
    )?;
    if group.is_main_process() {
        log::info!("activations cross pipeline stages through {choice}");
    }
    let world_comm: Arc<dyn TensorComm> = Arc::new(Checked::new(
        Arc::new(HostTensorComm::new(group.clone())),
        group.clone(),
    ));
    if group.is_main_process() {
        log::info!(
            "pipeline parallelism: {} stages × {} data-parallel replicas, {} micro-batches per batch, {} schedule; \
             each stage's group trains by {}",
            layout.stages,
            layout.replicas,
            config.pipeline.microbatches(),
            config.pipeline.pp_schedule,
            inner.name()
        );
    }
    let stages = Arc::new(Stages {
        layout,
        comm: stage_comm,
        schedule: config.pipeline.pp_schedule,
        micro_batches: config.pipeline.microbatches(),
        last_trace: Mutex::new(None),
        cut: Mutex::new(None),
        arrivals: Mutex::new(None),
        tied: Mutex::new(None),
        rest_owner: Mutex::new(None),
        rest_elsewhere: Mutex::new(None),
        dropped_rest: std::sync::atomic::AtomicBool::new(false),
        world: world_comm.clone(),
        // One name per accelerator, for the errors of its transfers.
        transfer: Box::leak(
            format!(
                "pipeline send/recv of stage {} of {} (replica {}, rank {})",
                layout.stage,
                layout.stages,
                layout.replica,
                group.process_index()
            )
            .into_boxed_str(),
        ),
    });
    Ok((
        Arc::new(Staged {
            inner,
            stages,
            world: world_comm,
        }),
        data,
    ))
}

/// The strategy of a pipelined rank: `inner`, its stage's data-parallel strategy, for everything a stage does
/// alone; across the stages, the fp16 verdict and the gradient norm are combined over the rank's pipeline, and
/// the initial weights come from rank 0 of the whole run.
#[derive(Debug)]
pub(crate) struct Staged {
    inner: Arc<dyn Strategy>,
    stages: Arc<Stages>,
    world: Arc<dyn TensorComm>,
}

impl Strategy for Staged {
    fn name(&self) -> String {
        let l = self.stages.layout;
        format!(
            "pipeline stage {} of {} ({} schedule, {} micro-batches), its group by {}",
            l.stage,
            l.stages,
            self.stages.schedule,
            self.stages.micro_batches,
            self.inner.name()
        )
    }

    /// The rank in the whole run: initial weights come from its rank 0 (see [`broadcast`](Self::broadcast)).
    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn stages(&self) -> Option<&Arc<Stages>> {
        Some(&self.stages)
    }

    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        self.inner.reduce_gradients(grads, params, scale)
    }

    fn reduces_to_itself(&self, scale: f32) -> bool {
        self.inner.reduces_to_itself(scale)
    }

    fn start_reduce(
        &self,
        grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<FinishReduce> {
        self.inner.start_reduce(grads, params, scale)
    }

    /// Rank `root` of the whole run (every stage starts from its weights).
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.world
            .broadcast(flat, root, "parameter broadcast")?
            .wait()
    }

    fn reduce_unbuffered(
        &self,
        grads: GradientsParams,
    ) -> std::result::Result<GradientsParams, GradientsParams> {
        Err(grads)
    }

    fn backward_reached_nothing(&self) -> Result<()> {
        self.inner.backward_reached_nothing()
    }

    fn no_gradients_held(&self, operation: &'static str) -> Result<()> {
        self.inner.no_gradients_held(operation)
    }

    /// The stage's norm, combined over the pipeline's stages.
    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        let stage = if norms.is_empty() {
            0.0
        } else {
            self.inner.gradient_norm(norms, norm_type)?
        };
        let comm = &self.stages.comm;
        Ok(match norm_type {
            NormType::Inf => comm.all_reduce_value(stage, ReduceOp::Max, "gradient norm")?,
            NormType::L2 => comm
                .all_reduce_value(stage * stage, ReduceOp::Sum, "gradient norm")?
                .sqrt(),
            NormType::P(p) => comm
                .all_reduce_value(stage.powf(p), ReduceOp::Sum, "gradient norm")?
                .powf(1.0 / p),
        })
    }

    /// A tied parameter's gradient (the same on every stage that uses it) counts on the first of them.
    fn counts_in_norm(&self, id: ParamId) -> bool {
        let tied = self.stages.tied.lock().unwrap_or_else(|e| e.into_inner());
        if !tied
            .as_ref()
            .is_some_and(|t| t.iter().any(|(t, _)| *t == id))
        {
            return self.inner.counts_in_norm(id);
        }
        let owners = self
            .stages
            .rest_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        owners
            .as_ref()
            .and_then(|o| o.get(&id))
            .is_none_or(|owner| *owner == self.stages.layout.stage)
    }

    fn any_rank(&self, local: bool) -> Result<bool> {
        let stage = self.inner.any_rank(local)?;
        let any = self.stages.comm.all_reduce_value(
            f64::from(u8::from(stage)),
            ReduceOp::Max,
            "overflow verdict",
        )?;
        Ok(any > 0.0)
    }

    fn block_pass(&self) -> BlockPass {
        self.inner.block_pass()
    }

    fn distributed_type(&self, launched: DistributedType) -> DistributedType {
        self.inner.distributed_type(launched)
    }

    /// Each rank writes its stage's (and, under sharding, its slices').
    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }

    /// Each rank writes its stage's blocks (the others are placeholders there).
    fn model_state(&self) -> StateScope {
        StateScope::PerRank
    }

    fn params_renamed(&self, renamed: &[(ParamId, ParamId)]) {
        self.inner.params_renamed(renamed)
    }

    fn split(&self, id: ParamId) -> Option<(Split, usize)> {
        self.inner.split(id)
    }

    fn splits(&self) -> Vec<(ParamId, Split)> {
        self.inner.splits()
    }

    fn check_optimizer(&self, optimizer: &str) -> Result<()> {
        self.inner.check_optimizer(optimizer)
    }

    /// Rank 0's value (the run's initial weights) on the ranks that keep it, then kept as the stage's strategy
    /// keeps it: a block's parameter is sent only to the ranks of the stage that runs it, and arrives elsewhere as
    /// an empty placeholder (no rank receives another stage's blocks); the others go to every rank.
    fn arrive(
        &self,
        id: ParamId,
        dims: &[usize],
        trains: bool,
        value: Arriving,
        root: usize,
    ) -> Result<(Tensor<1>, Vec<usize>)> {
        let owner = self
            .stages
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .and_then(|(owners, next)| {
                *next += 1;
                owners.get(*next - 1).copied().flatten()
            });
        let Some(stage) = owner else {
            let whole = self.broadcast(value.into_buffer(), root)?;
            return self
                .inner
                .arrive(id, dims, trains, Arriving::Value(whole), 0);
        };
        let replicas = self.stages.layout.replicas;
        let holders = stage * replicas..(stage + 1) * replicas;
        let me = self.world.rank();
        let (device, dtype) = value.place();
        let placeholder = || {
            let mut dims = dims.to_vec();
            if let Some(first) = dims.first_mut() {
                *first = 0;
            }
            (Tensor::<1>::zeros([0], (&device, dtype)), dims)
        };
        let whole = if me == root {
            let whole = value.into_buffer();
            let sends: Vec<(usize, Tensor<1>)> = holders
                .clone()
                .filter(|r| *r != me)
                .map(|r| (r, whole.clone()))
                .collect();
            if !sends.is_empty() {
                self.world
                    .send_recv(sends, Vec::new(), "stage parameter arrival")?
                    .wait()?;
            }
            whole
        } else if holders.contains(&me) {
            let incoming = crate::distributed::tensor_comm::Incoming {
                peer: root,
                len: dims.iter().product(),
                device: device.clone(),
                dtype,
            };
            self.world
                .send_recv(Vec::new(), vec![incoming], "stage parameter arrival")?
                .wait()?
                .remove(0)
        } else {
            drop(value);
            return Ok(placeholder());
        };
        if !holders.contains(&me) {
            return Ok(placeholder());
        }
        self.inner
            .arrive(id, dims, trains, Arriving::Value(whole), 0)
    }

    fn setup(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.setup(params)
    }

    fn unshard(&self, params: &mut ModuleParams<'_>, kept: &HashSet<ParamId>) -> Result<()> {
        self.inner.unshard(params, kept)
    }

    fn start_unshard(&self, params: &mut ModuleParams<'_>) -> Result<FinishUnshard> {
        self.inner.start_unshard(params)
    }

    fn before_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.before_step(params)
    }

    /// The stage's strategy's, then (once) the parameters outside the blocks that only other stages train become
    /// placeholders here: their copy on this stage would go stale, and take memory.
    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.inner.after_step(params)?;
        let elsewhere = self
            .stages
            .rest_elsewhere
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        if elsewhere.is_empty()
            || self
                .stages
                .dropped_rest
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        let table = params.table();
        let placeholders: Vec<_> = table
            .entries()
            .iter()
            // A parameter the stage's strategy splits keeps its slices (its gathers expect them).
            .filter(|e| {
                elsewhere.contains(&e.id)
                    && e.num_elements() > 0
                    && self.inner.split(e.id).is_none()
            })
            .map(|e| {
                let mut dims = e.dims.clone();
                if let Some(first) = dims.first_mut() {
                    *first = 0;
                }
                (e.id, dims, e.device.clone(), e.dtype, e.trainable)
            })
            .collect();
        for (id, dims, device, dtype, trains) in placeholders {
            table.replace(id, Tensor::<1>::zeros([0], (&device, dtype)), dims, trains);
        }
        Ok(())
    }

    /// None: a pipelined save fetches each parameter from its stage (`StageFetcher`), not from one group's
    /// slices.
    fn fetcher(&self, _params: &mut ModuleParams<'_>) -> Option<ParamFetcher> {
        None
    }

    fn check_learner(&self) -> Result<()> {
        Err(Error::InvalidArgument(format!(
            "the Learner cannot train with pp_size {}: it runs its own forward pass over the whole model, while a \
             pipeline runs each stage's blocks on its own ranks; train in your own loop with \
             `accelerator.backward_batch`, or set pp_size to 1 for the Learner",
            self.stages.layout.stages
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_fill_the_replicas_of_a_stage_first() {
        let places: Vec<(usize, usize)> = (0..6)
            .map(|r| {
                let l = PipelineLayout::of(r, 6, 3).unwrap();
                (l.stage, l.replica)
            })
            .collect();
        assert_eq!(places, vec![(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
        let err = PipelineLayout::of(0, 6, 4).unwrap_err().to_string();
        assert!(
            err.contains("pp_size 4 does not divide the 6 rank(s)"),
            "{err}"
        );
    }
}
