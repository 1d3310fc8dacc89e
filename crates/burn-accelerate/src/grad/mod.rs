//! Gradients owned by the accelerator: collection from `backward`, accumulation, clipping, and hand-off to the
//! optimizer.
//!
//! Burn returns gradients as values, so the accelerator keeps them between `backward` and the optimizer step, in
//! a [`GradientBuffer`] keyed by parameter id. Each gradient is stored flat (`Tensor<1>`) with its shape, so that
//! norms, clipping and (with several ranks) bucketed all-reduce treat every parameter alike.

mod buffer;
mod clip;
mod sync;

pub use buffer::GradientBuffer;
pub(crate) use buffer::param_ids;
pub(crate) use clip::has_non_finite;
pub use clip::{NormType, clip_grad_norm, clip_grad_value};
pub(crate) use sync::{all_reduce_mean, broadcast_params, trainable_params};
