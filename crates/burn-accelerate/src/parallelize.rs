//! A rank's parallelisms composed on its mesh: the mesh built once from the settings, the data-parallel strategy
//! on its data-parallel group, and a pipeline stage where `pp` > 1. The facade keeps what this returns and
//! dispatches to it; nothing asks a strategy what it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::distributed::mesh::Mesh;
use crate::distributed::strategy::{Strategy, for_data_parallel};
use crate::error::{Error, Result};
use crate::pipeline_parallel::{PipelineLayout, Staged, Stages};

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
}

impl Parallelized {
    /// The parallelisms `config` asks of `world`'s rank.
    ///
    /// # Errors
    /// A mesh that does not fit the ranks (each error names its setting); a group that cannot be split; a
    /// strategy that cannot be built (`gradient_transport = device` where the device path is not available).
    pub fn build(world: &Arc<ProcessGroup>, config: &AcceleratorConfig) -> Result<Self> {
        let mesh = Mesh::build(world, config)?;
        if mesh.dims.pp > 1 {
            let (strategy, stages) = for_mesh(&mesh, config)?;
            return Ok(Self {
                mesh,
                strategy,
                stages: Some(stages),
            });
        }
        Ok(Self {
            strategy: for_data_parallel(&mesh, config)?,
            mesh,
            stages: None,
        })
    }

    /// A strategy the user (or a test) made for `world`'s rank: plain data parallelism on the mesh.
    pub fn with_strategy(world: &Arc<ProcessGroup>, strategy: Arc<dyn Strategy>) -> Self {
        Self {
            mesh: Mesh::data_parallel(world),
            strategy,
            stages: None,
        }
    }
}

/// The strategy of a pipelined rank of `mesh` under `config`: its data-parallel group's strategy (the ranks of its
/// stage) wrapped in `Staged`, and what its pipelined steps share.
///
/// # Errors
/// A mesh without a pipeline; a strategy that cannot be built.
pub(crate) fn for_mesh(
    mesh: &Mesh,
    config: &AcceleratorConfig,
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
    let inner = for_data_parallel(mesh, config)?;
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
