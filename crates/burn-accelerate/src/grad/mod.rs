//! Gradients owned by the accelerator, from `backward` to the optimizer step.
//!
//! Burn returns gradients as values, so the accelerator keeps them between `backward` and the optimizer step, in
//! a gradient buffer keyed by parameter id. The [`step`](self::step) pipeline moves them through loss scaling,
//! collection, normalisation, cross-rank averaging ([`sync`](self::sync)), unscaling and the step verdict;
//! clipping works on the same buffer.

mod buffer;
mod clip;
pub(crate) mod window;

pub(crate) use buffer::{GradSource, GradientBuffer, param_ids};
pub use clip::NormType;
pub(crate) use clip::{
    ShardNorms, check_executed, clip_grad_norm, clip_grad_value, has_non_finite,
};
pub use window::GradientState;
