//! Burn's own collective between the CUDA devices of one process (`burn::tensor::distributed::all_reduce`,
//! NCCL underneath, its group formed inside the process): the device transport of in-process ranks.
//!
//! Every rank thread calls the all-reduce with the same list of devices, in the same order of buckets (the
//! data-parallel strategy guarantees it); the first call forms the NCCL group of those devices.

use std::sync::Arc;

use burn::tensor::distributed::{ReduceOperation, all_reduce};
use burn::tensor::{Device, Tensor};

use super::GradientTransport;
use super::device::wire_type;
use super::nccl::cuda_ordinal;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::error::{Error, Result};

/// Averages gradients with Burn's in-process CUDA collective.
#[derive(Debug)]
pub(crate) struct BurnCollective {
    group: Arc<ProcessGroup>,
    devices: Vec<Device>,
}

impl BurnCollective {
    /// The transport of `group`'s rank, whose ranks are threads of this process on CUDA devices `0..world`
    /// (rank `i` on device `i`, as in-process launching places them).
    ///
    /// # Errors
    /// This rank's device is not CUDA device `rank`.
    pub fn new(group: Arc<ProcessGroup>) -> Result<Self> {
        let rank = group.process_index();
        if cuda_ordinal(group.device()) != Some(rank) {
            return Err(Error::InvalidArgument(format!(
                "Burn's CUDA collective needs in-process rank {rank} on CUDA device {rank}, it runs on {:?}",
                group.device()
            )));
        }
        let devices = (0..group.num_processes()).map(Device::cuda).collect();
        Ok(Self { group, devices })
    }
}

impl GradientTransport for BurnCollective {
    fn name(&self) -> &'static str {
        "device all-reduce (Burn's CUDA collective)"
    }

    fn rank(&self) -> usize {
        self.group.process_index()
    }

    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        wire_type(flat.dtype()).map_err(Error::InvalidArgument)?;
        collectives::verify_call(
            &self.group,
            "gradient_all_reduce",
            flat.dtype(),
            &flat.dims(),
        )?;
        // Burn's collective has no timeout: every rank first meets at the communicator's barrier, which has one
        // (and learns there of a rank that failed), so a missing rank is an error rather than a hang in NCCL.
        self.group.comm().barrier()?;
        let autodiff = flat.is_autodiff();
        let averaged = all_reduce(
            flat.without_autodiff(),
            ReduceOperation::Mean,
            self.devices.clone(),
        )
        .resolve();
        let averaged = if scale == 1.0 {
            averaged
        } else {
            averaged.mul_scalar(scale)
        };
        Ok(if autodiff {
            averaged.autodiff()
        } else {
            averaged
        })
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        collectives::broadcast(&self.group, flat, root)
    }
}
