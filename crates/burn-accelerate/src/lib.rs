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
//! `rocm`, `tch`); see [`Backend`].

#![warn(missing_docs)]

pub mod accelerator;
pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod env;
pub mod error;
pub mod grad;
mod launch;
pub mod logging;
pub mod ops;
pub mod optim;
pub mod placement;
pub mod precision;
pub mod state;
mod step_state;
pub mod sys;
mod traverse;

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use backend::Backend;
pub use checkpoint::{LoadOptions, LoadReport, LoadedState, ProjectConfiguration, StateToSave};
pub use comm::ReduceOp;
pub use config::AcceleratorConfig;
pub use error::{Error, Result};
pub use grad::NormType;
pub use launch::launch;
pub use optim::{AcceleratedOptimizer, AcceleratedScheduler};
pub use placement::ToDevice;
pub use precision::{CastFloats, LossScaler, MixedPrecision};
pub use state::{DistributedType, ProcessState};
pub use step_state::GradientState;

/// The MPI engine (feature `mpi`).
#[cfg(feature = "mpi")]
pub use burn_accelerate_mpi as mpi;

/// The Burn version this crate is built against, re-exported so that macros and users share it.
pub use burn;
#[doc(hidden)]
pub use log;
