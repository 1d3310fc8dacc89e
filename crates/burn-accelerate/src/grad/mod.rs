//! Gradients owned by the accelerator, from `backward` to the optimizer step.
//!
//! Burn returns gradients as values, so the accelerator keeps them between `backward` and the optimizer step, in
//! a gradient buffer keyed by parameter id (`buffer`). The step pipeline (`crate::pipeline`) moves them through
//! loss scaling, collection, normalisation, cross-rank reduction (by the distribution strategy), unscaling and the
//! step verdict; the accumulation window (`window`) says when a step ends; clipping (`clip`) works on the same
//! buffer.

mod buffer;
mod clip;
mod phases;
pub(crate) mod window;

pub(crate) use buffer::{GradSource, GradientBuffer, param_ids};
pub use clip::NormType;
pub(crate) use clip::{
    check_executed, clip_grad_norm, clip_grad_norm_counting, clip_grad_value, combined_norm,
    has_non_finite, local_norm,
};
pub use phases::StepPhases;
pub use window::GradientState;
