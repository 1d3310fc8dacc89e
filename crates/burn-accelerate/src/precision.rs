//! Mixed precision: autocast with f32 master weights, and torch's dynamic loss scaling for fp16.
//!
//! Burn has no autocast and mixed-dtype operations panic, so the accelerator casts explicitly: inside
//! [`Accelerator::autocast`](crate::Accelerator::autocast) the model's float parameters and the inputs' float
//! tensors are cast to the half dtype through differentiable casts, and float outputs come back as f32. The
//! model itself keeps f32 parameters (the master weights), so gradients arrive in f32 and the optimizer state
//! stays f32.
//!
//! Keep in f32 (outside the autocast closure, or with [`float32`] inside it): losses and reductions over many
//! elements (sums, means, softmax normalisers), normalisation statistics (`LayerNorm`, `BatchNorm` running
//! stats) when values are large, and anything compared against small thresholds. `Linear`, `Conv*`,
//! `Embedding` and attention matmuls are what benefit.

use std::fmt;
use std::str::FromStr;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Bool, Device, FloatDType, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The precision of the forward pass (Accelerate's `mixed_precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Everything in f32.
    #[default]
    No,
    /// Forward in f16, with dynamic loss scaling.
    Fp16,
    /// Forward in bf16 (no loss scaling: bf16 has f32's range).
    Bf16,
}

impl MixedPrecision {
    /// The half dtype, if any.
    pub fn dtype(self) -> Option<FloatDType> {
        match self {
            MixedPrecision::No => None,
            MixedPrecision::Fp16 => Some(FloatDType::F16),
            MixedPrecision::Bf16 => Some(FloatDType::BF16),
        }
    }

    /// Accelerate's spelling: `no`, `fp16`, `bf16`.
    pub fn as_str(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
        }
    }

    /// Checks that `device` can compute in this precision (`supports` answers for a dtype).
    pub(crate) fn check(
        self,
        device: &Device,
        supports: impl Fn(FloatDType) -> bool,
    ) -> Result<()> {
        match self.dtype() {
            Some(dtype) if !supports(dtype) => Err(Error::UnsupportedDtype {
                device: format!("{device:?}"),
                dtype: format!("{dtype:?}"),
                precision: self.as_str(),
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MixedPrecision {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "none" | "fp32" | "" => Ok(MixedPrecision::No),
            "fp16" => Ok(MixedPrecision::Fp16),
            "bf16" => Ok(MixedPrecision::Bf16),
            _ => Err(Error::config(
                "mixed_precision",
                s,
                "mixed precision",
                "one of no, fp16, bf16",
            )),
        }
    }
}

/// Values whose float tensors can be cast to another float dtype (int and bool tensors, and non-tensor
/// values, are left as they are). Implemented like [`ToDevice`](crate::ToDevice); use
/// [`impl_to_device!`](crate::impl_to_device) for your own structs, which implements both.
pub trait CastFloats: Sized {
    /// Returns the value with every float tensor in `dtype`.
    fn cast_floats(self, dtype: FloatDType) -> Self;
}

impl<const D: usize> CastFloats for Tensor<D> {
    fn cast_floats(self, dtype: FloatDType) -> Self {
        self.cast(dtype)
    }
}

impl<const D: usize> CastFloats for Tensor<D, Int> {
    fn cast_floats(self, _dtype: FloatDType) -> Self {
        self
    }
}

impl<const D: usize> CastFloats for Tensor<D, Bool> {
    fn cast_floats(self, _dtype: FloatDType) -> Self {
        self
    }
}

crate::traverse::traverse_impls!(CastFloats, cast_floats, FloatDType);

/// Casts a value's float tensors back to f32 inside an autocast closure, for a part that must run in full
/// precision (Accelerate's nested `autocast(enabled=False)`).
pub fn float32<T: CastFloats>(value: T) -> T {
    value.cast_floats(FloatDType::F32)
}

/// A copy of `module` whose float parameters are `dtype` casts of the originals: computing with it builds a
/// graph whose gradients flow back, in f32, to the original (master) parameters.
pub(crate) fn cast_module<M: Module>(module: &M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| t.cast(dtype))
        }
    }
    module.clone().map(&mut Cast(dtype))
}

/// torch's `GradScaler`: dynamic loss scaling for fp16.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Factor applied after `growth_interval` steps without overflow (torch: 2).
    pub growth_factor: f64,
    /// Factor applied after an overflow (torch: 0.5).
    pub backoff_factor: f64,
    /// Steps without overflow before the scale grows (torch: 2000).
    pub growth_interval: u64,
    /// Steps without overflow since the last change.
    pub growth_tracker: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
        }
    }
}

impl LossScaler {
    /// A scaler starting at `init_scale` with torch's other defaults.
    pub fn with_init_scale(init_scale: f64) -> Self {
        Self {
            scale: init_scale,
            ..Self::default()
        }
    }

    /// Records the outcome of a step (`found_inf`: some gradient was inf or NaN, and the step is skipped) and
    /// adjusts the scale as torch's `GradScaler.update` does. Returns whether the step is skipped.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        found_inf
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let ok = self.scale.is_finite()
            && self.scale > 0.0
            && self.growth_factor > 1.0
            && self.backoff_factor > 0.0
            && self.backoff_factor < 1.0
            && self.growth_interval > 0;
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "loss scaler {self:?}: the scale must be finite and positive, growth_factor > 1, \
                 0 < backoff_factor < 1 and growth_interval > 0"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_precision() {
        assert_eq!(
            "BF16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Bf16
        );
        assert_eq!("no".parse::<MixedPrecision>().unwrap(), MixedPrecision::No);
        let err = "fp8".parse::<MixedPrecision>().unwrap_err().to_string();
        assert!(err.contains("one of no, fp16, bf16"), "{err}");
    }

    /// The sequence torch's GradScaler produces (its `_amp_update_scale_` rules), with growth_interval 3.
    #[test]
    fn scaler_sequence_matches_torch() {
        let mut scaler = LossScaler {
            growth_interval: 3,
            ..LossScaler::default()
        };
        // finite/inf pattern -> (skipped, scale after update)
        let pattern = [
            (false, false, 65536.0),
            (true, true, 32768.0),
            (true, true, 16384.0),
            (false, false, 16384.0),
            (false, false, 16384.0),
            (false, false, 32768.0),
            (false, false, 32768.0),
            (true, true, 16384.0),
            (false, false, 16384.0),
        ];
        for (i, (inf, skipped, scale)) in pattern.into_iter().enumerate() {
            assert_eq!(scaler.update(inf), skipped, "step {i}");
            assert_eq!(scaler.scale, scale, "step {i}");
        }
        // Accelerate's test_optimizer: good, NaN, NaN, good -> skipped F, T, T, F.
        let mut scaler = LossScaler::default();
        let skipped: Vec<bool> = [false, true, true, false]
            .into_iter()
            .map(|f| scaler.update(f))
            .collect();
        assert_eq!(skipped, vec![false, true, true, false]);
        assert!(
            LossScaler {
                backoff_factor: 2.0,
                ..LossScaler::default()
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn unsupported_dtype_is_an_error_naming_device_and_dtype() {
        let device = Device::default();
        let err = MixedPrecision::Bf16
            .check(&device, |_| false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("BF16") && err.contains("bf16") && err.contains(&format!("{device:?}")),
            "{err}"
        );
        assert!(MixedPrecision::No.check(&device, |_| false).is_ok());
    }
}
