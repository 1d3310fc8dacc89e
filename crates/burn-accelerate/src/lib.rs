//! # burn-accelerate
//!
//! The Hugging Face Accelerate workflow for [Burn](https://burn.dev): keep your own training loop, add an
//! [`Accelerator`], and the same program runs on one CPU, one GPU, several devices or several processes.
//!
//! ```
//! use burn::nn::{Linear, LinearConfig, loss::{MseLoss, Reduction}};
//! use burn::optim::AdamConfig;
//! use burn::tensor::Tensor;
//! use burn_accelerate::Accelerator;
//!
//! let accelerator = Accelerator::new()?;                                   // 1. create it
//! let model: Linear = LinearConfig::new(3, 1).init(&Default::default());
//! let model = accelerator.prepare_model(model)?;                          // 2. prepare (no manual moves)
//! let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 1e-2);
//! for _ in 0..3 {
//!     let x = Tensor::<2>::ones([4, 3], accelerator.device());
//!     let y = Tensor::<2>::zeros([4, 1], accelerator.device());
//!     let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
//!     accelerator.backward(loss, &model)?;                                // 3. backward through it
//!     # let model_ref = &model; let _ = model_ref;
//! }
//! # Ok::<(), burn_accelerate::Error>(())
//! ```
//!
//! The backend is a cargo feature (`flex` by default; `ndarray`, `wgpu`, `vulkan`, `metal`, `webgpu`, `cuda`,
//! `rocm`, `tch`); see [`Backend`]. The GPU backends come with Burn's kernel fusion and autotuning, as Burn ships
//! them; `wgpu-bare`, `cuda-bare`, … leave both off.
//!
//! ## How a step flows
//!
//! The [`Accelerator`] is a facade; every call forwards to one of the parts below. Follow a tensor in order:
//!
//! 1. **Who am I** — [`AcceleratorBuilder::build`] resolves the [`AcceleratorConfig`] (builder, then
//!    `ACCELERATE_*` variables, then the config file, then defaults); [`distributed::cluster::detect`] tells how
//!    the process was started (single, in-process threads from [`launch`], MPI) and hands over its
//!    [`Communicator`](distributed::comm::Communicator); [`backend`] picks the device of the local rank; the
//!    [`ProcessGroup`] holds rank, device and communicator. The builder then picks the rank's distribution
//!    strategy (`distributed::strategy`: one device, data parallelism over a gradient transport (the host
//!    all-reduce, the device itself for in-process ranks sharing one, or NCCL on CUDA), or sharded data parallelism under a [`ShardingStrategy`], the
//!    hybrid ones over sub-groups of the communicator), and the
//!    accelerator composes a step pipeline, a checkpointer and a trigger for that rank.
//! 2. **`prepare_model`** — every rank takes rank 0's parameter ids (checkpoints key optimizer state by id); the
//!    main process draws the lazily initialised parameters one at a time as it sends them (after every rank
//!    arrived, in module order), and the strategy gives every rank rank 0's weights (the others receive lazy
//!    parameters without drawing them); under `FULL_SHARD` each parameter is scattered, so that every other rank
//!    receives only its dim-0 slice and the model is never whole on any rank ([`Accelerator::unshard`] gathers it for the forward
//!    pass). Then the model is forked onto the device with autodiff on (batches go there through
//!    [`backend::ToDevice`]).
//! 3. **`prepare_dataloader`** — [`data`] takes the shuffle seed from rank 0 (a collective), deals this rank its
//!    shard of every epoch ([`data::shard`]), and builds batches on the device; the checkpointer tracks its
//!    [`data::DataPosition`]. Each `iter()` and each batch tell the step window where the epoch stands.
//! 4. **`accumulate`** — the step window (`grad::window`, a small state machine) decides whether this
//!    micro-batch ends the accumulation window (every `gradient_accumulation_steps`, or the epoch's last batch).
//! 5. **`autocast`** — [`precision`] casts the model's parameters and the inputs to f16/bf16 through
//!    differentiable casts and the outputs back to f32; the f32 parameters stay the master weights.
//! 6. **`backward(loss, &model)`** — the step pipeline (`pipeline`) runs, in order: the precision scales the
//!    loss (fp16), Burn back-propagates, the model's gradients are collected into the gradient buffer, the
//!    window says whether it ends; if it does, the gradients are normalised by the micro-batches the window had,
//!    unscaled, reduced across ranks by the strategy (bucketed, through a gradient transport: the host all-reduce
//!    of [`distributed::collectives`], or NCCL / Burn's collective on CUDA, each checked first in debug mode;
//!    sharded: reduce-scattered so that each parameter's owner alone keeps it, every collective checked in debug
//!    mode too, and under a hybrid strategy averaged across the shard groups), and the precision returns its
//!    verdict (skip on an fp16 overflow on any rank).
//! 7. **`clip_grad_norm`** — the global norm over the buffer's gradients, torch's formula (sharded: every
//!    rank's part combined).
//! 8. **`optimizer.step(model)`** — [`AcceleratedOptimizer`] takes the pipeline's outcome: *accumulate* keeps
//!    the gradients, *skip* drops them, *apply* hands them to Burn's optimizer (and, under a strategy whose
//!    ranks step only their slices of the parameters, gathers the stepped values where the model is kept whole). burn-train's Learner
//!    (`learner`, feature `train`) consumes the same outcome through the same pipeline.
//! 9. **`scheduler.step()`** — [`AcceleratedScheduler`] advances only after a real optimizer step (the same
//!    skip record), as many times as the [`SchedulerRule`] says (once by default).
//! 10. **`save_state` / `load_state`** — the checkpointer ([`checkpoint`]) writes the models, optimizers (one
//!     state, or each rank's slice, as the strategy says) and schedulers the loop passes in, the loss scaler,
//!     every dataloader's position and the registered objects, atomically, every rank agreeing on the outcome;
//!     loading puts the dataloaders back mid-epoch. Weights alone go through [`checkpoint::safetensors`].
//!
//! ## The layers
//!
//! Each module uses only modules of its own or a lower layer (the module list in this file's source is the same
//! order, lowest first):
//!
//! | layer | modules | may use |
//! |---|---|---|
//! | base | `error`, `notice`, `fs`, `heap`, `named_params`, `model` ([`Blocks`], [`Split`], the cut into stages), `grad` (gradient buffer, clipping, step window), [`precision`], [`config`], [`backend`], [`tracking`] | each other in this order |
//! | distribution | [`distributed`]: `comm`, `cluster`, `collectives`, `mesh` (the one mesh: [`ParallelDims`], [`MeshCoords`]), `tensor_comm`, `strategy` | the base |
//! | step | `step` (the step pipeline, block-wise passes), [`pipeline_parallel`] (a rank's stage, schedules, the pipelined step, traces), `parallelize` (a rank's parallelisms on its mesh), [`logging`], [`data`], [`optim`] | the base, `distributed`, each other in this order |
//! | persistence and search | [`checkpoint`], [`memory`] | everything above, in this order |
//! | facade | [`accelerator`] | everything above |
//! | above the facade | `diagnostics` (what `burn-accelerate test` trains to check the device transport), `learner` (feature `train`) | the facade and everything above |
//!
//! The same holds among the children of each module (each declares its children lowest first).
//! `scripts/module-graph.py` prints the import graph of the code (levels, two-way ties, long files); with `--check`
//! (run by CI) it fails on any of them.

#![warn(missing_docs)]

// The layers, lowest first: a module uses only modules declared above it (scripts/module-graph.py checks it).
mod error; // Error, Result
mod notice; // warnings that reach the user without a logger
pub(crate) mod fs; // durable file writes, folder locks, scratch files
pub(crate) mod heap; // returning freed heap memory, telling out-of-memory failures apart
mod host_data; // tensor data built in place
mod named_params; // one walk over a module's parameters, with their names
mod model; // what a model and its batches provide: blocks, micro-batches, the cut into stages
mod traverse; // walking a batch value's tensors
pub(crate) mod grad; // gradient buffer, clipping, the step window
pub(crate) mod graph_cut; // cutting the autodiff graph by hand where a collective sits in the forward pass
pub mod precision; // autocast, loss scaler, the precision policy
pub mod config; // settings: builder > ACCELERATE_* > config file > defaults; environment spelling
pub mod backend; // compiled backends, device choice, moving values to a device, machine facts
pub mod tracking; // trackers and progress bars
pub mod distributed; // process group, cluster, collectives, launching, distribution strategies
pub mod logging; // rank-aware logging
pub mod data; // prepared dataloaders: sharding, positions
pub mod context_parallel; // context parallelism: the sequence split, attention across ranks (all-gather, ring)
pub mod tensor_parallel; // tensor parallelism: plans, split modules, regions, reproducible dropout
pub(crate) mod step; // the step pipeline: one backward's path to the optimizer, block-wise passes
pub mod pipeline_parallel; // pipeline parallelism: stages, schedules, the pipelined step, traces
mod parallelize; // a rank's parallelisms composed on its mesh
pub mod optim; // the prepared optimizer and scheduler
pub mod checkpoint; // safetensors weights, training state, the checkpointer
pub mod memory; // out-of-memory batch-size search, memory estimate
pub mod accelerator; // the facade and its builder
mod diagnostics; // what `burn-accelerate test` trains through the facade to check the device transport
// burn-train's Learner through the facade.
#[cfg(feature = "train")]
pub mod learner;
pub use accelerator::{Accelerator, AcceleratorBuilder, launch};
pub use backend::{Backend, ToDevice};
pub use checkpoint::{LoadOptions, LoadReport, LoadedState, ProjectConfiguration, StateToSave};
pub use config::{
    AcceleratorConfig, GradientTransport, PipelineSchedule, PipelineSettings, SchedulerRule,
    ShardDtype, ShardingStrategy,
};
pub use distributed::comm::ReduceOp;
pub use distributed::{DistributedType, Gatherable, MeshCoords, ParallelDims, ProcessGroup};
pub use error::{Error, Result};
pub use grad::{GradientState, NormType, StepPhases};
pub use model::{Blocks, Split};
pub use optim::{AcceleratedOptimizer, AcceleratedScheduler};
pub use pipeline_parallel::{PipelineLayout, StageTrace};
pub use precision::{CastFloats, LossScaler, MixedPrecision};

/// The MPI engine (feature `mpi`).
#[cfg(feature = "mpi")]
pub use burn_accelerate_mpi as mpi;

/// The Burn version this crate is built against, re-exported so that macros and users share it.
pub use burn;
#[doc(hidden)]
pub use log;

/// Unit tests start from the clean environment every test binary of the workspace starts from (no developer
/// settings, a scratch folder of the process's own; `tests/support/isolation.rs` describes it and includes this
/// module's file).
#[cfg(test)]
mod test_isolation;
