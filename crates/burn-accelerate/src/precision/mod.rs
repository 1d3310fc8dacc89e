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

mod scaler;
mod policy;

pub(crate) use policy::Precision;
pub use scaler::LossScaler;

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
/// [`impl_to_device!`](crate::impl_to_device) (also spelled [`impl_batch!`](crate::impl_batch)) for your own
/// structs, which implements both.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot go through `autocast`: it does not implement `CastFloats`",
    note = "for your own batch or output struct, `burn_accelerate::impl_batch!(Name {{ field, .. }})` (the same \
            macro as `impl_to_device!`) implements both `CastFloats` and `ToDevice`"
)]
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

/// Runs `f` under autocast in `precision` (see [`Accelerator::autocast`](crate::Accelerator::autocast)).
pub(crate) fn autocast<M: Module, I: CastFloats, O: CastFloats>(
    precision: MixedPrecision,
    model: &M,
    inputs: I,
    f: impl FnOnce(&M, I) -> O,
) -> O {
    match precision.dtype() {
        None => f(model, inputs),
        Some(dtype) => {
            let half = cast_module(model, dtype);
            f(&half, inputs.cast_floats(dtype)).cast_floats(FloatDType::F32)
        }
    }
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
