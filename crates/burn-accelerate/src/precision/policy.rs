//! The one owner of a rank's precision: the mixed-precision setting, the fp16 loss scaler, and the
//! step-or-skip verdict that follows from it (Lightning Fabric's precision plugins are the model: scale the
//! loss, unscale the gradients, decide whether the step is taken, and hand over the state to save).

use burn::tensor::Tensor;

use super::{LossScaler, MixedPrecision};
use crate::error::{Error, Result};

/// Precision of one rank: `no` and `bf16` leave the loss and gradients alone; `fp16` scales the loss up before
/// `backward`, divides the gradients back down on the window's last micro-batch, and skips the step (shrinking
/// the scale) when they overflowed.
#[derive(Debug, Clone)]
pub(crate) struct Precision {
    mode: MixedPrecision,
    scaler: Option<LossScaler>,
}

impl Precision {
    /// The precision for `mode`; fp16 starts its scaler from `scaler`.
    pub fn new(mode: MixedPrecision, scaler: LossScaler) -> Self {
        Self {
            mode,
            scaler: (mode == MixedPrecision::Fp16).then_some(scaler),
        }
    }

    /// Multiplies the loss by the current loss scale (fp16), or returns it as it is.
    pub fn scale_loss<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        match &self.scaler {
            Some(scaler) => loss.mul_scalar(scaler.scale as f32),
            None => loss,
        }
    }

    /// `factor` with the loss scale taken back out: what the gradients of a scaled loss must be multiplied by.
    pub fn unscaled(&self, factor: f32) -> f32 {
        match &self.scaler {
            Some(scaler) => factor / scaler.scale as f32,
            None => factor,
        }
    }

    /// Decides, after the window's gradients were averaged and unscaled, whether the step is skipped. With fp16,
    /// `overflowed` is asked whether any gradient holds an inf or NaN (an overflow on any rank reaches every rank
    /// through the averaged gradients, so all ranks agree); an overflow skips the step and the scale follows
    /// torch's rules. Without a scaler nothing is checked and the step is taken.
    pub fn verdict(&mut self, overflowed: impl FnOnce() -> Result<bool>) -> Result<bool> {
        let Some(scaler) = self.scaler.as_mut() else {
            return Ok(false);
        };
        let overflow = overflowed()?;
        scaler.update(overflow);
        Ok(overflow)
    }

    /// The current loss scale (`None` unless fp16).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale)
    }

    /// The scaler's state, for checkpoints.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Restores the scaler's state; an error when this precision has no scaler.
    pub fn set_scaler(&mut self, scaler: LossScaler) -> Result<()> {
        scaler.validate()?;
        match self.scaler.as_mut() {
            Some(current) => {
                *current = scaler;
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "set_loss_scaler: this accelerator runs with mixed_precision={}, which has no loss scaler",
                self.mode
            ))),
        }
    }

    /// Restores a checkpoint's scaler when this precision has one (a checkpoint saved under fp16 and resumed
    /// under another precision keeps its scaler unused).
    pub fn restore_scaler(&mut self, scaler: &LossScaler) {
        if let Some(current) = self.scaler.as_mut() {
            *current = scaler.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn fp16_scales_unscales_and_skips_on_overflow() {
        let mut fp16 = Precision::new(MixedPrecision::Fp16, LossScaler::with_init_scale(8.0));
        let device = Device::default();
        let loss = fp16.scale_loss(Tensor::<1>::from_floats([0.5], &device));
        assert_eq!(loss.into_scalar::<f32>(), 4.0);
        assert_eq!(fp16.unscaled(0.5), 0.0625);

        assert!(fp16.verdict(|| Ok(true)).unwrap(), "overflow skips");
        assert_eq!(fp16.loss_scale(), Some(4.0), "the scale backs off");
        assert!(!fp16.verdict(|| Ok(false)).unwrap());

        let mut bf16 = Precision::new(MixedPrecision::Bf16, LossScaler::default());
        assert_eq!(bf16.unscaled(0.5), 0.5);
        let never = || -> Result<bool> { panic!("no scaler: nothing to check") };
        assert!(!bf16.verdict(never).unwrap(), "no scaler, no skip");
        assert!(bf16.set_scaler(LossScaler::default()).is_err());
    }
}
