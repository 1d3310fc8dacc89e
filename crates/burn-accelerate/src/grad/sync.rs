//! The gradient-sync seam: how gradients cross ranks, and how every rank starts from rank 0's weights.
//!
//! [`GradientSync`] has one implementation per case: [`NoSync`] for a single rank, and [`HostAllReduce`],
//! which averages gradients in buckets through [`ops::all_reduce_host`](crate::ops) over the rank's
//! communicator (so debug mode checks gradient all-reduces like any other collective). This is where a
//! device-side all-reduce plugs in — Burn's in-process CUDA collective, or NCCL — as a third implementation
//! that averages the flat gradients on the device instead of copying them to the host; the step pipeline
//! ([`super::step`]) and the training strategies built on it do not change.

use std::fmt;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorData};

use super::GradientBuffer;
use crate::comm::{ReduceBuffer, ReduceOp};
use crate::error::{Error, Result};
use crate::ops;
use crate::state::ProcessState;

/// How a rank's gradients are averaged with the other ranks', and how initial weights are shared.
pub(crate) trait GradientSync: Send + Sync + fmt::Debug {
    /// A short name for messages.
    fn name(&self) -> &'static str;

    /// Whether other ranks take part (a single rank never communicates).
    fn is_distributed(&self) -> bool;

    /// Replaces every stored gradient of `params` (`(id, number of elements)`, in the same order on every
    /// rank) with its mean over the ranks, times `scale`. A parameter without a gradient on this rank
    /// contributes zeros.
    fn average(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()>;

    /// Returns rank 0's value of one flattened parameter on every rank.
    fn broadcast_from_root(&self, flat: Tensor<1>) -> Result<Tensor<1>>;
}

/// The implementation for a rank's state: [`NoSync`] with one rank, else [`HostAllReduce`] with buckets of at
/// most `bucket_bytes`.
pub(crate) fn for_rank(state: &Arc<ProcessState>, bucket_bytes: usize) -> Box<dyn GradientSync> {
    if state.num_processes() > 1 {
        Box::new(HostAllReduce {
            state: state.clone(),
            bucket_bytes,
        })
    } else {
        Box::new(NoSync)
    }
}

/// A single rank: averaging is only the scaling.
#[derive(Debug)]
pub(crate) struct NoSync;

impl GradientSync for NoSync {
    fn name(&self) -> &'static str {
        "none"
    }

    fn is_distributed(&self) -> bool {
        false
    }

    fn average(
        &self,
        grads: &mut GradientBuffer,
        _: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        if scale != 1.0 {
            grads.scale_all(scale);
        }
        Ok(())
    }

    fn broadcast_from_root(&self, flat: Tensor<1>) -> Result<Tensor<1>> {
        Ok(flat)
    }
}

/// Gradients with at least this many elements (1 MiB of f32) are all-reduced on their own (see [`buckets`]).
const ALONE_ELEMENTS: usize = 1 << 18;

/// Bucketed all-reduce of host copies of the gradients through the rank's communicator.
#[derive(Debug)]
pub(crate) struct HostAllReduce {
    state: Arc<ProcessState>,
    bucket_bytes: usize,
}

impl HostAllReduce {
    /// All-reduces one bucket. A bucket of one gradient is moved to the host (no copy on CPU backends),
    /// reduced in place and moved back; a larger one is concatenated, reduced and split.
    fn average_bucket(
        &self,
        grads: &mut GradientBuffer,
        bucket: &[(ParamId, usize)],
        scale: f32,
        (device, dtype): (&burn::tensor::Device, DType),
    ) -> Result<()> {
        // A gradient this rank lacks (its parameter was unused here) takes part as zeros.
        let zeros = |n: usize| Tensor::zeros([n], (device, dtype));
        if let [(id, n)] = bucket {
            if !grads.replace_flat(*id, |flat| self.average_flat(flat, scale))? {
                grads.set_flat(*id, self.average_flat(zeros(*n), scale)?);
            }
            return Ok(());
        }
        let parts: Vec<Tensor<1>> = bucket
            .iter()
            .map(|(id, n)| grads.flat(&[*id]).pop().unwrap_or_else(|| zeros(*n)))
            .collect();
        let all = self.average_flat(Tensor::cat(parts, 0), scale)?;
        let sizes: Vec<usize> = bucket.iter().map(|(_, n)| *n).collect();
        for ((id, _), grad) in bucket.iter().zip(all.split_with_sizes(sizes, 0)) {
            grads.set_flat(*id, grad);
        }
        Ok(())
    }

    /// Averages one flat gradient across ranks (scaled by `scale`) through the host.
    fn average_flat(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let (device, dtype) = (flat.device(), flat.dtype());
        let data = flat.try_into_data().map_err(|e| Error::Execution {
            operation: "gradient all-reduce",
            device: format!("{device:?}"),
            reason: e.to_string(),
        })?;
        let host = match data.dtype() {
            DType::F32 => data.try_into_vec::<f32>(),
            _ => data
                .try_cast_as::<f32>()
                .and_then(|d| d.try_into_vec::<f32>()),
        }
        .map_err(|e| Error::InvalidArgument(format!("gradient all-reduce: {e}")))?;
        let len = host.len();
        // Unscaled: the engine's mean. Scaled: the engine's sum, then one pass multiplying by scale / ranks
        // (instead of a division pass and a multiplication pass).
        let op = if scale == 1.0 {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let reduced = ops::all_reduce_host(
            &self.state,
            "gradient_all_reduce",
            (DType::F32, &[len]),
            ReduceBuffer::F32(host),
            op,
        )?;
        let ReduceBuffer::F32(mut reduced) = reduced else {
            return Err(Error::InvalidArgument(format!(
                "gradient all-reduce: the engine returned {} values",
                reduced.kind()
            )));
        };
        if scale != 1.0 {
            let factor = scale / self.state.num_processes() as f32;
            reduced.iter_mut().for_each(|x| *x *= factor);
        }
        let data = TensorData::new(reduced, [len])
            .try_cast(dtype)
            .map_err(|e| Error::InvalidArgument(format!("gradient all-reduce: {e}")))?;
        Ok(Tensor::<1>::from_data(data, (&device, dtype)))
    }
}

impl GradientSync for HostAllReduce {
    fn name(&self) -> &'static str {
        "host all-reduce"
    }

    fn is_distributed(&self) -> bool {
        true
    }

    fn average(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        // Only the device and dtype of a gradient: a clone of it kept here would share its memory, and moving
        // that gradient to the host would then copy it instead of taking it.
        let Some((device, dtype)) = params.iter().find_map(|(id, _)| {
            grads
                .flat(&[*id])
                .pop()
                .map(|like| (like.device(), like.dtype()))
        }) else {
            return Ok(());
        };
        let max_elems = (self.bucket_bytes / 4).max(1);
        for bucket in buckets(params, max_elems, ALONE_ELEMENTS.min(max_elems)) {
            self.average_bucket(grads, bucket, scale, (&device, dtype))?;
        }
        Ok(())
    }

    fn broadcast_from_root(&self, flat: Tensor<1>) -> Result<Tensor<1>> {
        ops::broadcast(&self.state, flat, 0)
    }
}

/// Consecutive groups of `params` holding at most `max_elems` elements each; a parameter of `alone_elems` or
/// more is a group of its own (reduced without a copy into a bucket, which would cost more than the extra
/// collective saves). Every rank forms the same groups, so they call the same collectives.
fn buckets(
    params: &[(ParamId, usize)],
    max_elems: usize,
    alone_elems: usize,
) -> impl Iterator<Item = &[(ParamId, usize)]> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= params.len() {
            return None;
        }
        let (mut end, mut elems) = (start, 0);
        let first_alone = params[start].1 >= alone_elems;
        let joins =
            |n: usize, elems: usize| !first_alone && n < alone_elems && elems + n <= max_elems;
        while end < params.len() && (end == start || joins(params[end].1, elems)) {
            elems += params[end].1;
            end += 1;
        }
        let bucket = &params[start..end];
        start = end;
        Some(bucket)
    })
}

/// `(id, number of elements)` of every float parameter of `module` that requires a gradient, in visiting order
/// (the same on every rank for the same model).
pub(crate) fn trainable_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Params(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.push((param.id, param.shape().num_elements()));
            }
        }
    }
    let mut params = Params(Vec::new());
    module.visit(&mut params);
    params.0
}

/// Returns `module` with every float parameter replaced by rank 0's value (Accelerate's DDP wrapping does the
/// same), keeping ids and gradient settings. A single rank gets its module back untouched.
pub(crate) fn broadcast_module<M: Module>(sync: &dyn GradientSync, module: M) -> Result<M> {
    if !sync.is_distributed() {
        return Ok(module);
    }
    struct FromRoot<'a> {
        sync: &'a dyn GradientSync,
        error: Option<Error>,
    }
    impl ModuleMapper for FromRoot<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.error.is_some() {
                return param;
            }
            param.map(|tensor| {
                let device = tensor.device();
                let shape = tensor.shape();
                let fallback = tensor.clone();
                let flat = tensor.inner().reshape([shape.num_elements()]);
                match self.sync.broadcast_from_root(flat) {
                    Ok(root) => Tensor::from_inner(root.reshape(shape)).to_device(&device),
                    Err(e) => {
                        self.error = Some(e);
                        fallback
                    }
                }
            })
        }
    }
    let mut mapper = FromRoot { sync, error: None };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_respect_the_size_and_keep_large_parameters_whole() {
        let ids: Vec<ParamId> = (0..4).map(|_| ParamId::new()).collect();
        let params = vec![(ids[0], 3), (ids[1], 3), (ids[2], 10), (ids[3], 1)];
        let sizes: Vec<Vec<usize>> = buckets(&params, 6, 6)
            .map(|b| b.iter().map(|(_, n)| *n).collect())
            .collect();
        assert_eq!(sizes, vec![vec![3, 3], vec![10], vec![1]]);
        // Parameters of `alone_elems` or more get a bucket of their own, even when they would fit.
        let params = vec![(ids[0], 1), (ids[1], 4), (ids[2], 1), (ids[3], 1)];
        let sizes: Vec<Vec<usize>> = buckets(&params, 100, 4)
            .map(|b| b.iter().map(|(_, n)| *n).collect())
            .collect();
        assert_eq!(sizes, vec![vec![1], vec![4], vec![1, 1]]);
        // Small ones still fill a bucket up to its size, past `alone_elems` in total.
        let params = vec![(ids[0], 1), (ids[1], 1), (ids[2], 1), (ids[3], 1)];
        assert_eq!(buckets(&params, 100, 2).count(), 1);
    }
}
