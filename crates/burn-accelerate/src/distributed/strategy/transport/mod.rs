//! How flat gradients cross ranks: the gradient-transport seam of data parallelism.
//!
//! A [`GradientTransport`] averages one flat buffer across ranks and broadcasts one from a root. [`HostAllReduce`]
//! copies the buffer to host memory and goes through [`collectives::all_reduce_host`] (so debug mode, call
//! headers and timeouts see every gradient all-reduce); a device all-reduce (Burn's in-process CUDA collective,
//! NCCL) is another implementation that keeps the buffer on the device. Bucketing is the strategy's business,
//! not the transport's.

use std::fmt;
use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::{ReduceBuffer, ReduceOp};
use crate::error::{Error, Result};

/// Moves flat gradient buffers between ranks.
pub(crate) trait GradientTransport: Send + Sync + fmt::Debug {
    /// A short name for messages and `env` (`host all-reduce`, ...).
    fn name(&self) -> &'static str;

    /// This rank's index in the group the transport connects.
    fn rank(&self) -> usize;

    /// The mean of `flat` over the ranks, times `scale`, in `flat`'s dtype and on its device.
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>>;

    /// Rank `root`'s `flat` on every rank.
    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>>;
}

/// `flat`'s values in host memory, as f32 (half-precision values are widened exactly).
pub(crate) fn to_host(flat: Tensor<1>, operation: &'static str) -> Result<Vec<f32>> {
    let device = flat.device();
    let data = flat.try_into_data().map_err(|e| Error::Execution {
        operation,
        device: format!("{device:?}"),
        reason: e.to_string(),
    })?;
    match data.dtype() {
        DType::F32 => data.try_into_vec::<f32>(),
        _ => data
            .try_cast_as::<f32>()
            .and_then(|d| d.try_into_vec::<f32>()),
    }
    .map_err(|e| Error::InvalidArgument(format!("{operation}: {e}")))
}

/// A flat tensor of `values` in `dtype` on `device`.
pub(crate) fn from_host(
    values: Vec<f32>,
    (device, dtype): (&Device, DType),
    operation: &'static str,
) -> Result<Tensor<1>> {
    let len = values.len();
    let data = TensorData::new(values, [len])
        .try_cast(dtype)
        .map_err(|e| Error::InvalidArgument(format!("{operation}: {e}")))?;
    Ok(Tensor::<1>::from_data(data, (device, dtype)))
}

/// Host copies of the gradients, all-reduced through the rank's communicator.
#[derive(Debug)]
pub(crate) struct HostAllReduce {
    group: Arc<ProcessGroup>,
}

impl HostAllReduce {
    /// The transport of `group`'s rank.
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        Self { group }
    }
}

impl GradientTransport for HostAllReduce {
    fn name(&self) -> &'static str {
        "host all-reduce"
    }

    fn rank(&self) -> usize {
        self.group.process_index()
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let (device, dtype) = (flat.device(), flat.dtype());
        let host = to_host(flat, "gradient all-reduce")?;
        let len = host.len();
        // Unscaled: the engine's mean. Scaled: the engine's sum, then one pass multiplying by scale / ranks
        // (instead of a division pass and a multiplication pass).
        let op = if scale == 1.0 {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let reduced = collectives::all_reduce_host(
            &self.group,
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
            let factor = scale / self.group.num_processes() as f32;
            reduced.iter_mut().for_each(|x| *x *= factor);
        }
        from_host(reduced, (&device, dtype), "gradient all-reduce")
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        collectives::broadcast(&self.group, flat, root)
    }
}
