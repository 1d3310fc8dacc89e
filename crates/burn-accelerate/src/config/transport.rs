//! Which path tensors take between ranks (gradients, the parameter slices of sharded training, a pipeline's
//! activations): device memory when the backend and the machine allow it, host memory otherwise.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable that chooses the [`GradientTransport`].
pub const TRANSPORT_VAR: &str = "ACCELERATE_GRADIENT_TRANSPORT";

/// Which path every tensor between ranks takes: gradients, the parameter slices sharded training gathers and
/// reduce-scatters, and a pipeline's activations. (The name is data parallelism's, where gradients are the only
/// traffic; one setting governs all of it.)
///
/// | value | gradients cross ranks through |
/// |---|---|
/// | `Auto` (default) | the device when every rank is a CUDA device and NCCL loads (Burn's collective for in-process ranks, NCCL under `launch`/mpirun), host memory otherwise |
/// | `Host` | host memory and the rank's communicator, on every backend |
/// | `Device` | the device, or an error from [`Accelerator::build`](crate::Accelerator) saying why it cannot |
///
/// `burn-accelerate env` and the start-up line say which one runs and why. Set it with
/// [`AcceleratorBuilder::gradient_transport`](crate::AcceleratorBuilder::gradient_transport) or
/// `ACCELERATE_GRADIENT_TRANSPORT=auto|host|device`.
///
/// ```
/// use burn_accelerate::GradientTransport;
/// assert_eq!("host".parse::<GradientTransport>()?, GradientTransport::Host);
/// assert_eq!(GradientTransport::default(), GradientTransport::Auto);
/// assert!("pcie".parse::<GradientTransport>().is_err());
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradientTransport {
    /// The device where it can, host memory elsewhere.
    #[default]
    Auto,
    /// Always host memory (the path every backend has; a way around a misbehaving device collective).
    Host,
    /// Always the device; building the accelerator fails where it cannot.
    Device,
}

impl GradientTransport {
    /// The setting's spelling (`auto`, `host`, `device`).
    pub fn name(self) -> &'static str {
        match self {
            GradientTransport::Auto => "auto",
            GradientTransport::Host => "host",
            GradientTransport::Device => "device",
        }
    }
}

impl fmt::Display for GradientTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GradientTransport {
    type Err = Error;

    /// `auto`, `host` or `device`, in any case.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(GradientTransport::Auto),
            "host" => Ok(GradientTransport::Host),
            "device" => Ok(GradientTransport::Device),
            _ => Err(Error::config(
                "gradient_transport",
                s.trim(),
                "configuration",
                "auto, host or device",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in [
            GradientTransport::Auto,
            GradientTransport::Host,
            GradientTransport::Device,
        ] {
            assert_eq!(t.name().parse::<GradientTransport>().unwrap(), t);
            assert_eq!(
                t.name()
                    .to_uppercase()
                    .parse::<GradientTransport>()
                    .unwrap(),
                t
            );
        }
        let err = "nvlink"
            .parse::<GradientTransport>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nvlink") && err.contains("auto, host or device"),
            "{err}"
        );
    }
}
