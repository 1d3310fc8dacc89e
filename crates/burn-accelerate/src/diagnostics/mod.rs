//! Diagnostics that train through the facade: what `burn-accelerate test` runs to check the device transport
//! (`Accelerator::check_gradient_transport`). They sit above the `accelerator`, so that the transport below
//! never builds one.

mod host_free;
mod transport;

#[cfg(test)]
pub(crate) use host_free::{ControlBudget, NoHostBuffers};
use transport::check_against_reference;
#[cfg(test)]
pub(crate) use transport::check_training_on_one_rank;

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::accelerator::Accelerator;
use crate::error::Result;

/// A linear layer `d_in` → `d_out` with weights drawn from `salt` by a formula (every run the same).
pub(crate) fn fixed_linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(d_in, d_out).init(device);
    let values: Vec<f32> = (0..d_in * d_out)
        .map(|i| (i as f32 * 0.37 + salt).sin() * 0.5)
        .collect();
    layer.weight = Param::from_tensor(
        Tensor::<1>::from_floats(values.as_slice(), device).reshape([d_in, d_out]),
    );
    layer.bias = Some(Param::from_tensor(Tensor::zeros([d_out], device)));
    layer
}

impl Accelerator {
    /// Checks the device gradient transport this run would use: every rank averages about a million values
    /// through it in f32, bf16 and f16 (where the device has them), and each compares the result with the exact
    /// mean of every rank's values, computed by itself in f64 (no collective, no shared summation order). Returns
    /// the transport (with why it was chosen) and each dtype's largest error against its rounding bound; `None`
    /// where gradients go through host memory anyway (CPU processes, `gradient_transport = host`). In-process
    /// ranks on one device check the shared device path; a single CUDA rank checks a one-rank NCCL communicator.
    /// Every rank must call it. `burn-accelerate test` runs it wherever a GPU is found.
    ///
    /// ```
    /// use burn_accelerate::{Accelerator, GradientTransport};
    ///
    /// // In-process ranks on the CPU share one device: their path is checked, and passes.
    /// let checks = burn_accelerate::launch(2, |acc| acc.check_gradient_transport())?;
    /// assert!(checks.iter().all(|c| c.as_ref().is_some_and(|c| c.passed())));
    /// // Through host memory there is no device path to check.
    /// let host = Accelerator::builder()
    ///     .gradient_transport(GradientTransport::Host)
    ///     .launch(2, |acc| acc.check_gradient_transport())?;
    /// assert_eq!(host, vec![None, None]);
    /// # Ok::<(), burn_accelerate::Error>(())
    /// ```
    ///
    /// # Errors
    /// A collective fails, or the device transport cannot start.
    pub fn check_gradient_transport(&self) -> Result<Option<crate::distributed::TransportCheck>> {
        check_against_reference(
            &self.group_arc(),
            self.config().distributed.gradient_transport,
            self.config().collective_timeout(),
        )
    }

    /// The GPU kit's checks of NCCL's communicator lifecycle on this run's ranks (one CUDA device each): `split`
    /// makes a sub-group's communicator from a fresh one (the parent polled, then the child), all-reduces on it,
    /// and ends both normally (finalize, then destroy); `failing-group` sends a batch of messages whose second
    /// call NCCL refuses, and checks that the communicator is then aborted and refused. `None` off CUDA (or in a
    /// build without it). Every rank must call it.
    ///
    /// # Errors
    /// NCCL cannot make a communicator on this rank's device.
    #[doc(hidden)]
    pub fn check_nccl_lifecycle(&self) -> Result<Option<Vec<crate::distributed::LifecycleCheck>>> {
        crate::distributed::tensor_comm::on_device::nccl_lifecycle_check(
            &self.group_arc(),
            self.config().collective_timeout(),
        )
    }
}
