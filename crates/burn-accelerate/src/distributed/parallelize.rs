//! A rank's parallelisms composed on its mesh: the mesh built once from the settings, the data-parallel strategy
//! on its data-parallel group, and a pipeline stage where `pp` > 1. The facade keeps what this returns and
//! dispatches to it; nothing asks a strategy what it is.

use std::sync::Arc;

use crate::config::AcceleratorConfig;
use crate::distributed::ProcessGroup;
use crate::distributed::mesh::Mesh;
use crate::distributed::stages::mesh::{Stages, for_mesh};
use crate::distributed::strategy::{Strategy, for_data_parallel};
use crate::error::Result;

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
