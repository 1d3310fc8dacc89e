//! Every public path the guide, the examples, the benches and the tests name compiles: a module that moves keeps
//! its old path as a deprecated alias (`distributed::stages` → `pipeline_parallel`), so a program written against
//! an earlier release still builds, with a warning that says where the name went. Adding a path here is cheap;
//! removing one is a breaking change.
#![allow(deprecated, unused_imports)]

// The crate root.
use burn_accelerate::{
    AcceleratedOptimizer, AcceleratedScheduler, Accelerator, AcceleratorBuilder, AcceleratorConfig,
    Backend, Blocks, CastFloats, DistributedType, Error, Gatherable, GradientTransport,
    LoadOptions, LossScaler, MeshCoords, MixedPrecision, ParallelDims, PipelineLayout,
    PipelineSchedule, ProcessGroup, ProjectConfiguration, ReduceOp, Result, SchedulerRule,
    ShardDtype, ShardingStrategy, Split, StageTrace, StateToSave, StepPhases, ToDevice, launch,
};
// Macros.
use burn_accelerate::{
    acc_debug, acc_info, acc_trace, impl_batch, impl_gatherable, impl_to_device,
};
// Modules and their items.
use burn_accelerate::accelerator::internals::sync_flat_gradients;
use burn_accelerate::backend::{self, default_device, enumerate, sys};
use burn_accelerate::checkpoint::{
    KeyRemap, LoadOptions as _, SaveOptions, WeightLayout, merge_weights,
};
use burn_accelerate::config::env::parse_bool;
use burn_accelerate::config::{
    self, AcceleratorConfig as _, Key, LossNormalization, MAX_COLLECTIVE_TIMEOUT, PipelineSettings,
    RESTART_COUNT_VARS, Source, config_file,
};
use burn_accelerate::data::{
    DataLoaderBuilder, PreparedDataLoader, ShardSpec, StreamLoader, shard_stream,
};
use burn_accelerate::distributed::cluster::{InProcess, Launcher, LauncherVars, launched_by_mpi};
use burn_accelerate::distributed::collectives::{broadcast, gather, reduce};
use burn_accelerate::distributed::comm::{
    CommResult, Communicator, InProcessGroup, ReduceBuffer, STATUS_DIR_VAR, TIMEOUT_REASON,
};
use burn_accelerate::distributed::{describe_gradient_transport, describe_transport_per_call};
#[cfg(feature = "train")]
use burn_accelerate::learner::{
    self, AcceleratedStrategy, LearnerLoader, QuietRenderer, backward,
    burn_train::{
        InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    },
};
use burn_accelerate::logging::{get_logger, init};
use burn_accelerate::memory::{
    BatchSizeError, BatchSizeFinder, ModelSize, Shrink, find_executable_batch_size,
    is_out_of_memory_message,
};
#[cfg(feature = "mpi")]
use burn_accelerate::mpi::MpiComm;
use burn_accelerate::optim::{FusedAdamWConfig, FusedAdamWUpdates};
use burn_accelerate::pipeline_parallel::{
    SpanKind, StageTrace as _, TraceSpan, chrome_trace, measure_block_costs, stage_blocks_for,
    svg_trace,
};
use burn_accelerate::tracking::tensorboard::read_events;
use burn_accelerate::tracking::{LogWith, Record, Tracker, Value};

/// The paths that moved, under their old names: deprecated aliases of the new home.
mod moved {
    pub use burn_accelerate::distributed::stages::{
        PipelineLayout, SpanKind, StageTrace, TraceSpan, chrome_trace, measure_block_costs,
        stage_blocks_for, svg_trace,
    };
}

#[test]
fn a_moved_path_names_the_same_item_as_its_new_home() {
    // A type alias is the type itself; a deprecated function gives what the new one gives.
    let layout: moved::PipelineLayout = PipelineLayout {
        stage: 1,
        stages: 2,
        replica: 0,
        replicas: 1,
    };
    assert_eq!(layout.stage, 1);
    assert_eq!(
        moved::stage_blocks_for(&[1.0, 1.0, 1.0, 5.0], 2).unwrap(),
        vec![3, 1]
    );
    assert_eq!(
        moved::stage_blocks_for(&[1.0, 1.0, 1.0, 5.0], 2).unwrap(),
        stage_blocks_for(&[1.0, 1.0, 1.0, 5.0], 2).unwrap()
    );
    let trace = StageTrace {
        stage: 0,
        stages: 1,
        replica: 0,
        micro_batches: 1,
        step_us: 10.0,
        spans: vec![TraceSpan {
            kind: SpanKind::Forward,
            micro_batch: 0,
            start_us: 0.0,
            duration_us: 5.0,
        }],
    };
    assert_eq!(
        moved::chrome_trace(std::slice::from_ref(&trace)),
        chrome_trace(std::slice::from_ref(&trace))
    );
    assert_eq!(
        moved::svg_trace(std::slice::from_ref(&trace)),
        svg_trace(std::slice::from_ref(&trace))
    );
    let kind: moved::SpanKind = moved::SpanKind::Backward;
    assert_eq!(kind, SpanKind::Backward);
}
