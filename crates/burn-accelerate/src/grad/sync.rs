//! Averaging gradients across ranks: bucketed all-reduce of the gradient store through the communicator.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorData};

use super::GradientBuffer;
use crate::comm::{Communicator, ReduceBuffer, ReduceOp};
use crate::error::{Error, Result};

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

/// Replaces every stored gradient of `params` with its mean over the ranks of `comm`, times `scale`, moving at
/// most `bucket_bytes` per all-reduce. A parameter without a gradient on this rank contributes zeros (and gets
/// the averaged gradient of the others).
pub(crate) fn all_reduce_mean(
    comm: &dyn Communicator,
    buffer: &mut GradientBuffer,
    params: &[(ParamId, usize)],
    scale: f32,
    bucket_bytes: usize,
) -> Result<()> {
    let Some(template) = params.iter().find_map(|(id, _)| buffer.flat(&[*id]).pop()) else {
        return Ok(());
    };
    let device = template.device();
    let dtype = template.dtype();
    let max_elems = (bucket_bytes / 4).max(1);
    let mut start = 0;
    while start < params.len() {
        let mut end = start;
        let mut elems = 0;
        while end < params.len() && (end == start || elems + params[end].1 <= max_elems) {
            elems += params[end].1;
            end += 1;
        }
        let bucket = &params[start..end];
        let parts: Vec<Tensor<1>> = bucket
            .iter()
            .map(|(id, n)| {
                buffer
                    .flat(&[*id])
                    .pop()
                    .unwrap_or_else(|| Tensor::zeros([*n], (&device, dtype)))
            })
            .collect();
        let data = Tensor::cat(parts, 0)
            .try_into_data()
            .map_err(|e| Error::Execution {
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
        let mut reduced = match comm.all_reduce(ReduceBuffer::F32(host), ReduceOp::Mean)? {
            ReduceBuffer::F32(v) => v,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "gradient all-reduce: the engine returned {} values",
                    other.kind()
                )));
            }
        };
        if scale != 1.0 {
            reduced.iter_mut().for_each(|x| *x *= scale);
        }
        let n = reduced.len();
        let data = TensorData::new(reduced, [n])
            .try_cast(dtype)
            .map_err(|e| Error::InvalidArgument(format!("gradient all-reduce: {e}")))?;
        let all = Tensor::<1>::from_data(data, (&device, dtype));
        let sizes: Vec<usize> = bucket.iter().map(|(_, n)| *n).collect();
        for ((id, _), grad) in bucket.iter().zip(all.split_with_sizes(sizes, 0)) {
            buffer.set_flat(*id, grad);
        }
        start = end;
    }
    Ok(())
}

/// Returns `module` with every float parameter replaced by rank 0's value (Accelerate's DDP wrapping does the
/// same), keeping ids and gradient settings.
pub(crate) fn broadcast_params<M: Module>(
    state: &crate::state::ProcessState,
    module: M,
) -> Result<M> {
    use burn::module::ModuleMapper;
    struct FromRoot<'a> {
        state: &'a crate::state::ProcessState,
        error: Option<Error>,
    }
    impl ModuleMapper for FromRoot<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.error.is_some() {
                return param;
            }
            param.map(|tensor| {
                let device = tensor.device();
                let fallback = tensor.clone();
                match crate::ops::broadcast(self.state, tensor.inner(), 0) {
                    Ok(root) => Tensor::from_inner(root).to_device(&device),
                    Err(e) => {
                        self.error = Some(e);
                        fallback
                    }
                }
            })
        }
    }
    let mut mapper = FromRoot { state, error: None };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}
