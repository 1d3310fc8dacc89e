//! A rank's parallelisms composed on its mesh: the mesh built once from the settings, the data-parallel strategy
//! on its data-parallel group, the tensor-parallel strategy over it where `tp` > 1, and a pipeline stage over
//! either where `pp` > 1 (`Staged` → `TensorParallel` → a data-parallel strategy, torchtitan's 3-D mesh). The
//! facade keeps what this returns and dispatches to it; nothing asks a strategy what it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::AcceleratorConfig;
use crate::context_parallel::group::CpContext;
use crate::distributed::ProcessGroup;
use crate::distributed::mesh::Mesh;
use crate::distributed::strategy::{Strategy, for_data_parallel};
use crate::error::{Error, Result};
use crate::pipeline_parallel::{PipelineLayout, Staged, Stages};
use crate::tensor_parallel::context::TpContext;
use crate::tensor_parallel::strategy::TensorParallel;

/// What a rank trains with: its mesh, the strategy its steps go through, and its pipeline stage under pipeline
/// parallelism.
#[derive(Debug, Clone)]
pub(crate) struct Parallelized {
    /// The mesh and this rank's sub-groups.
    pub mesh: Mesh,
    /// The strategy of every step (under a pipeline, the stage's, wrapping its data-parallel group's).
    pub strategy: Arc<dyn Strategy>,
    /// This rank's pipeline stage, with `pp` > 1.
    pub stages: Option<Arc<Stages>>,
    /// This rank's tensor-parallel strategy, with `tp` > 1: `strategy` itself, or under a pipeline the stage's.
    pub tensor: Option<Arc<TensorParallel>>,
    /// This rank's context group, with `cp` > 1.
    pub context: Option<Arc<CpContext>>,
}

impl Parallelized {
    /// The parallelisms `config` asks of `world`'s rank.
    ///
    /// # Errors
    /// A mesh that does not fit the ranks (each error names its setting); a group that cannot be split; a
    /// strategy that cannot be built (`gradient_transport = device` where the device path is not available).
    pub fn build(world: &Arc<ProcessGroup>, config: &AcceleratorConfig) -> Result<Self> {
        let mesh = Mesh::build(world, config)?;
        let context = match &mesh.cp {
            Some(cp) => Some(for_context_parallel(&mesh, cp, config)?),
            None => None,
        };
        let mut built = Self::strategies(mesh, config)?;
        built.context = context;
        Ok(built)
    }

    /// The strategies of `mesh`'s rank: a pipeline's, a tensor-parallel one's, or a data-parallel one's.
    fn strategies(mesh: Mesh, config: &AcceleratorConfig) -> Result<Self> {
        if mesh.dims.pp > 1 {
            // Each stage's ranks tensor-parallel groups where `tp` > 1, the stage's strategy theirs.
            let tensor = match mesh.tp.clone() {
                Some(tp) => Some(Arc::new(for_tensor_parallel(&mesh, &tp, config)?)),
                None => None,
            };
            let (strategy, stages) = for_mesh(&mesh, config, tensor.clone())?;
            return Ok(Self {
                mesh,
                strategy,
                stages: Some(stages),
                tensor,
                context: None,
            });
        }
        if let Some(tp) = mesh.tp.clone() {
            let tensor = Arc::new(for_tensor_parallel(&mesh, &tp, config)?);
            return Ok(Self {
                strategy: tensor.clone(),
                mesh,
                stages: None,
                tensor: Some(tensor),
                context: None,
            });
        }
        Ok(Self {
            strategy: for_data_parallel(&mesh, config)?,
            mesh,
            stages: None,
            tensor: None,
            context: None,
        })
    }

    /// A strategy the user (or a test) made for `world`'s rank: plain data parallelism on the mesh.
    pub fn with_strategy(world: &Arc<ProcessGroup>, strategy: Arc<dyn Strategy>) -> Self {
        Self {
            mesh: Mesh::data_parallel(world),
            strategy,
            stages: None,
            tensor: None,
            context: None,
        }
    }
}

/// The context group of a rank of `mesh` (its group `cp`): the collectives of its attention on the device path
/// where the ranks have one.
///
/// # Errors
/// A transport that cannot be built.
fn for_context_parallel(
    mesh: &Mesh,
    cp: &Arc<ProcessGroup>,
    config: &AcceleratorConfig,
) -> Result<Arc<CpContext>> {
    let (comm, choice) = crate::distributed::tensor_comm::select_transport(
        cp,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        crate::distributed::tensor_comm::on_device::Exchanges::Shards,
    )?;
    if mesh.world.is_main_process() {
        log::info!(
            "context parallelism: {} ranks per context group ({} attention, {}), their keys and values through \
             {choice}; gradients reduced over {} ranks (dp {} × cp {})",
            mesh.dims.cp,
            config.distributed.cp_comm_strategy,
            match config.distributed.cp_load_balance {
                true => "head-tail balanced",
                false => "contiguous",
            },
            mesh.grad.num_processes(),
            mesh.dims.dp(),
            mesh.dims.cp
        );
    }
    Ok(Arc::new(CpContext {
        rank: mesh.coords.cp,
        size: mesh.dims.cp,
        comm,
        mode: config.distributed.cp_comm_strategy,
        balanced: config.distributed.cp_load_balance,
    }))
}

/// The strategy of a tensor-parallel rank of `mesh` (its group `tp`): its data-parallel group's strategy, with
/// the collectives of the tensor-parallel regions on the device path where the ranks have one (in-process ranks
/// sharing a device hand each other the tensors), and the initial weights from rank 0 of the whole run (of its
/// stage, under a pipeline: the stage's strategy hands them on to it).
///
/// # Errors
/// A strategy or a transport that cannot be built.
fn for_tensor_parallel(
    mesh: &Mesh,
    tp: &Arc<ProcessGroup>,
    config: &AcceleratorConfig,
) -> Result<TensorParallel> {
    let inner = for_data_parallel(mesh, config)?;
    let (comm, choice) = crate::distributed::tensor_comm::select_transport(
        tp,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        crate::distributed::tensor_comm::on_device::Exchanges::Shards,
    )?;
    let (world, _) = crate::distributed::tensor_comm::select_transport(
        mesh.stage.as_ref().unwrap_or(&mesh.world),
        config.distributed.gradient_transport,
        config.collective_timeout(),
        crate::distributed::tensor_comm::on_device::Exchanges::Messages,
    )?;
    if mesh.world.is_main_process() {
        log::info!(
            "tensor parallelism: {} ranks per group × {} data-parallel replicas; the regions' collectives go \
             through {choice}; each group's data-parallel ranks train by {}",
            mesh.dims.tp,
            mesh.dims.dp(),
            inner.name()
        );
    }
    let context = Arc::new(TpContext {
        rank: mesh.coords.tp,
        size: mesh.dims.tp,
        comm,
        dp_index: mesh.coords.dp(&mesh.dims),
        sequence: config.distributed.sequence_parallel,
    });
    Ok(TensorParallel {
        inner,
        world,
        context,
        splits: Mutex::new(None),
        whole_dims: Mutex::new(std::collections::HashMap::new()),
    })
}

/// The strategy of a pipelined rank of `mesh` under `config`: its stage's strategy (its data-parallel group's, or
/// `tensor`, its tensor-parallel one's over the data-parallel group) wrapped in `Staged`, and what its pipelined
/// steps share.
///
/// # Errors
/// A mesh without a pipeline; a strategy that cannot be built.
pub(crate) fn for_mesh(
    mesh: &Mesh,
    config: &AcceleratorConfig,
    tensor: Option<Arc<TensorParallel>>,
) -> Result<(Arc<dyn Strategy>, Arc<Stages>)> {
    let group = &mesh.world;
    let pipe = mesh.pp.clone().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "pipeline parallelism on the mesh {}, which has one stage: set pp_size above 1",
            mesh.dims
        ))
    })?;
    let layout = PipelineLayout {
        stage: mesh.coords.pp,
        stages: mesh.dims.pp,
        replica: mesh.coords.dp(&mesh.dims),
        replicas: mesh.dims.dp(),
    };
    let inner: Arc<dyn Strategy> = match tensor {
        Some(tensor) => tensor,
        None => for_data_parallel(mesh, config)?,
    };
    // Activations and their gradients go where the gradient transport goes: the device where it can (in-process
    // stages sharing a GPU hand each other the tensors), host memory otherwise.
    let (stage_comm, choice) = crate::distributed::tensor_comm::select_transport(
        &pipe,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        crate::distributed::tensor_comm::on_device::Exchanges::Messages,
    )?;
    if group.is_main_process() {
        log::info!("activations cross pipeline stages through {choice}");
    }
    // The whole run's exchanges (the initial weights, each stage's parameters arriving from the rank that
    // loaded them) take the device path too.
    let (world_comm, _) = crate::distributed::tensor_comm::select_transport(
        group,
        config.distributed.gradient_transport,
        config.collective_timeout(),
        crate::distributed::tensor_comm::on_device::Exchanges::Messages,
    )?;
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
        stage_ranks: mesh.dims.dp() * mesh.dims.tp,
        comm: stage_comm,
        schedule: config.pipeline.pp_schedule,
        micro_batches: config.pipeline.microbatches(),
        last_trace: Mutex::new(None),
        cut: Mutex::new(None),
        stage_blocks: config.pipeline.pp_stage_blocks.clone(),
        arrivals: Mutex::new(None),
        rest_lens: Mutex::new(HashMap::new()),
        tied: Mutex::new(None),
        rest_owner: Mutex::new(None),
        rest_reached: Mutex::new(None),
        rest_elsewhere: Mutex::new(None),
        dropped_rest: std::sync::atomic::AtomicBool::new(false),
        keeps_rest: std::sync::atomic::AtomicBool::new(false),
        world: world_comm.clone(),
        pipe: pipe.clone(),
        // One name per accelerator, for the errors of its transfers.
        transfer: format!(
            "pipeline send/recv of stage {} of {} (replica {}, rank {})",
            layout.stage,
            layout.stages,
            layout.replica,
            group.process_index()
        ),
    });
    let strategy = Arc::new(Staged {
        inner,
        stages: stages.clone(),
        world: world_comm,
    });
    Ok((strategy, stages))
}
