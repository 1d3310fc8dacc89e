//! Data parallelism: every rank holds the whole model and steps every parameter; gradients are averaged across
//! ranks in buckets through the tensor interface ([`TensorComm`]: host memory, or the device), and every rank
//! starts from rank 0's weights.

use std::sync::Arc;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};

use super::{GradientSync, ParamPlacement, StateScopes, StrategyInfo};
use crate::distributed::tensor_comm::bucket::{
    ALONE_ELEMENTS, buckets, concat, in_dtype, max_elements,
};
use crate::distributed::tensor_comm::{Reduction, TensorComm};
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;

/// One rank and one device: averaging is only the scaling, and nothing crosses ranks.
#[derive(Debug)]
pub(crate) struct SingleDevice;

impl StrategyInfo for SingleDevice {
    fn name(&self) -> String {
        "single device".into()
    }

    fn rank(&self) -> usize {
        0
    }
}

impl GradientSync for SingleDevice {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        if scale != 1.0 {
            let ids: Vec<ParamId> = params.iter().map(|(id, _)| *id).collect();
            grads.map_flat(&ids, |g| g.mul_scalar(scale));
        }
        Ok(())
    }

    fn reduces_to_itself(&self, scale: f32) -> bool {
        scale == 1.0
    }

    fn broadcast(&self, flat: Tensor<1>, _root: usize) -> Result<Tensor<1>> {
        Ok(flat)
    }

    fn reduce_unbuffered(
        &self,
        grads: GradientsParams,
    ) -> std::result::Result<GradientsParams, GradientsParams> {
        // Alone, the mean over the ranks at scale 1 is the gradients themselves.
        Ok(grads)
    }

    fn backward_reached_nothing(&self) -> Result<()> {
        Err(Error::InvalidArgument(
            "backward: none of the model's parameters received a gradient; pass the model the loss was \
             computed with"
                .into(),
        ))
    }
}

impl ParamPlacement for SingleDevice {}

impl StateScopes for SingleDevice {}

/// Data parallelism over `comm`, in buckets of at most `bucket_bytes`.
#[derive(Debug)]
pub(crate) struct DataParallel {
    comm: Arc<dyn TensorComm>,
    bucket_bytes: usize,
}

impl DataParallel {
    /// Data parallelism whose gradients cross ranks through `comm`.
    pub fn new(comm: Arc<dyn TensorComm>, bucket_bytes: usize) -> Self {
        Self { comm, bucket_bytes }
    }

    /// The mean of `flat` over the ranks, times `scale`.
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        self.comm
            .all_reduce(flat, Reduction::Average(scale), "gradient_all_reduce")?
            .wait()
    }

    /// Averages one bucket. A bucket of one gradient goes to the transport as it is (no copy on CPU backends);
    /// a larger one is concatenated, averaged and split.
    fn average_bucket(
        &self,
        grads: &mut GradientBuffer,
        bucket: &[(ParamId, usize)],
        scale: f32,
        (device, dtype): (&Device, DType),
    ) -> Result<()> {
        // A gradient this rank lacks (its parameter was unused here) takes part as zeros.
        let zeros = |n: usize| Tensor::zeros([n], (device, dtype));
        if let [(id, n)] = bucket {
            if !grads.replace_flat(*id, |flat| self.average(flat, scale))? {
                grads.set_flat(*id, self.average(zeros(*n), scale)?);
            }
            return Ok(());
        }
        // A model may mix dtypes (f32 and f16 parameters): a bucket travels in their common dtype (nothing
        // narrowed) and each gradient comes back in its own.
        let (parts, dtypes): (Vec<Tensor<1>>, Vec<DType>) = bucket
            .iter()
            .map(|(id, n)| {
                let part = grads.flat(&[*id]).pop().unwrap_or_else(|| zeros(*n));
                let own = part.dtype();
                (part, own)
            })
            .unzip();
        let all = self.average(concat(parts, (device, dtype)), scale)?;
        let sizes: Vec<usize> = bucket.iter().map(|(_, n)| *n).collect();
        for (((id, _), grad), own) in bucket
            .iter()
            .zip(all.split_with_sizes(sizes, 0))
            .zip(dtypes)
        {
            grads.set_flat(*id, in_dtype(grad, own));
        }
        Ok(())
    }
}

impl StrategyInfo for DataParallel {
    fn name(&self) -> String {
        format!("data parallel over {}", self.comm.name())
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }
}

impl GradientSync for DataParallel {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        let Some((device, dtype)) = grads.device_and_dtype(params.iter().map(|(id, _)| *id)) else {
            return Ok(());
        };
        let max_elems = max_elements(self.bucket_bytes);
        for bucket in buckets(params, max_elems, ALONE_ELEMENTS.min(max_elems)) {
            self.average_bucket(grads, bucket, scale, (&device, dtype))?;
        }
        Ok(())
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.comm
            .broadcast(flat, root, "parameter broadcast")?
            .wait()
    }
}

impl ParamPlacement for DataParallel {}

impl StateScopes for DataParallel {}
