//! FSDP2's mixed-precision policy for sharded strategies: the dtype the blocks are gathered in and the dtype
//! gradients are reduced in, apart from the dtype each rank keeps its slices in.

use std::fmt;
use std::str::FromStr;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A float dtype for the traffic of a sharded strategy (FSDP2's `MixedPrecisionPolicy`): `param_dtype`, the
/// dtype a block-wise pass gathers each block's parameters in, and `reduce_dtype`, the dtype gradients are
/// reduce-scattered in. Each rank keeps its slices and their optimizer state in the parameters' own dtype (the
/// master weights) either way.
///
/// Set with [`AcceleratorBuilder::fsdp_param_dtype`](crate::AcceleratorBuilder::fsdp_param_dtype) and
/// [`fsdp_reduce_dtype`](crate::AcceleratorBuilder::fsdp_reduce_dtype), the config file's
/// `fsdp_config: {fsdp_param_dtype: bf16, fsdp_reduce_dtype: fp32}`, `FSDP_PARAM_DTYPE` / `FSDP_REDUCE_DTYPE`, or
/// `burn-accelerate launch --fsdp_param_dtype bf16 --fsdp_reduce_dtype fp32`.
///
/// ```
/// use burn_accelerate::ShardDtype;
/// assert_eq!("bf16".parse::<ShardDtype>()?, ShardDtype::Bf16);
/// assert_eq!("float32".parse::<ShardDtype>()?, ShardDtype::Fp32);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardDtype {
    /// 32-bit floats.
    Fp32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    Fp16,
}

impl ShardDtype {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            ShardDtype::Fp32 => DType::F32,
            ShardDtype::Bf16 => DType::BF16,
            ShardDtype::Fp16 => DType::F16,
        }
    }
}

impl fmt::Display for ShardDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ShardDtype::Fp32 => "fp32",
            ShardDtype::Bf16 => "bf16",
            ShardDtype::Fp16 => "fp16",
        })
    }
}

impl FromStr for ShardDtype {
    type Err = Error;

    /// `fp32`, `bf16` or `fp16` (also `f32`, `float32`, `bfloat16`, `f16`, `float16`), in any case.
    fn from_str(s: &str) -> Result<Self> {
        let text = s.trim();
        match text.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(ShardDtype::Fp32),
            "bf16" | "bfloat16" => Ok(ShardDtype::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(ShardDtype::Fp16),
            _ => Err(Error::config(
                "fsdp_param_dtype / fsdp_reduce_dtype",
                text,
                "configuration",
                "fp32, bf16 or fp16",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for d in [ShardDtype::Fp32, ShardDtype::Bf16, ShardDtype::Fp16] {
            assert_eq!(d.to_string().parse::<ShardDtype>().unwrap(), d);
        }
        assert_eq!(
            " BFloat16 ".parse::<ShardDtype>().unwrap(),
            ShardDtype::Bf16
        );
        let err = "fp8".parse::<ShardDtype>().unwrap_err().to_string();
        assert!(err.contains("fp32, bf16 or fp16"), "{err}");
    }
}
