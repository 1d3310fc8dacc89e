//! Compute backends: which are compiled in, and how a [`Device`] is chosen.
//!
//! Burn 0.22 carries the backend in the runtime [`Device`] value, so a backend here is just a name, the cargo
//! feature that compiles it, and the `Device` constructor to call. Resolution order (highest first): an explicit
//! device or backend from the builder, `ACCELERATE_USE_CPU` (forces a CPU backend), `BURN_DEVICE`, then Burn's
//! own priority order (CUDA, Metal, ROCm, Vulkan, WebGPU, wgpu, LibTorch, Flex, NdArray).

mod placement;
pub mod probe;
pub mod sys;

pub use placement::ToDevice;

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;

use crate::config::env;
use crate::error::{Error, Result};

/// A compute backend burn-accelerate can run on. Each one is a cargo feature of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Burn's pure-Rust CPU backend (`flex`, the default). f32, f16 and bf16.
    Flex,
    /// The deprecated ndarray CPU backend (`ndarray`). f32 only.
    NdArray,
    /// wgpu with the graphics API chosen automatically (`wgpu`).
    Wgpu,
    /// wgpu pinned to Vulkan (`vulkan`).
    Vulkan,
    /// wgpu pinned to Metal (`metal`).
    Metal,
    /// wgpu pinned to WebGPU (`webgpu`).
    WebGpu,
    /// NVIDIA CUDA (`cuda`).
    Cuda,
    /// AMD ROCm (`rocm`).
    Rocm,
    /// LibTorch through tch (`tch`), CPU or CUDA.
    LibTorch,
}

impl Backend {
    /// Every backend, in Burn's default priority order.
    pub const ALL: [Backend; 9] = [
        Backend::Cuda,
        Backend::Metal,
        Backend::Rocm,
        Backend::Vulkan,
        Backend::WebGpu,
        Backend::Wgpu,
        Backend::LibTorch,
        Backend::Flex,
        Backend::NdArray,
    ];

    /// The cargo feature that compiles this backend in.
    pub fn feature(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::NdArray => "ndarray",
            Backend::Wgpu => "wgpu",
            Backend::Vulkan => "vulkan",
            Backend::Metal => "metal",
            Backend::WebGpu => "webgpu",
            Backend::Cuda => "cuda",
            Backend::Rocm => "rocm",
            Backend::LibTorch => "tch",
        }
    }

    /// Whether this build contains the backend.
    pub fn is_compiled(self) -> bool {
        match self {
            Backend::Flex => cfg!(feature = "flex"),
            Backend::NdArray => cfg!(feature = "ndarray"),
            Backend::Wgpu => cfg!(feature = "wgpu-bare"),
            Backend::Vulkan => cfg!(feature = "vulkan-bare"),
            Backend::Metal => cfg!(feature = "metal-bare"),
            Backend::WebGpu => cfg!(feature = "webgpu-bare"),
            Backend::Cuda => cfg!(feature = "cuda-bare"),
            Backend::Rocm => cfg!(feature = "rocm-bare"),
            Backend::LibTorch => cfg!(feature = "tch"),
        }
    }

    /// Whether the backend computes on the host CPU.
    pub fn is_cpu(self) -> bool {
        matches!(self, Backend::Flex | Backend::NdArray)
    }

    /// The backends this build contains, in priority order.
    pub fn compiled() -> Vec<Backend> {
        Self::ALL.into_iter().filter(|b| b.is_compiled()).collect()
    }

    /// The device of this backend with the given index (ignored by single-device CPU backends).
    ///
    /// # Errors
    /// [`Error::BackendNotCompiled`] when the feature is off.
    pub fn device(self, index: usize) -> Result<Device> {
        self.device_from(index, "requested explicitly")
    }

    pub(crate) fn device_from(self, index: usize, origin: &str) -> Result<Device> {
        let _ = index;
        let missing = || Error::BackendNotCompiled {
            backend: self.to_string(),
            origin: origin.to_string(),
            feature: self.feature(),
        };
        match self {
            #[cfg(feature = "flex")]
            Backend::Flex => Ok(Device::flex()),
            #[cfg(feature = "ndarray")]
            #[allow(deprecated)]
            Backend::NdArray => Ok(Device::ndarray()),
            #[cfg(feature = "wgpu-bare")]
            Backend::Wgpu => Ok(Device::wgpu(wgpu_kind(index))),
            #[cfg(feature = "vulkan-bare")]
            Backend::Vulkan => Ok(Device::vulkan(wgpu_kind(index))),
            #[cfg(feature = "metal-bare")]
            Backend::Metal => Ok(Device::metal(wgpu_kind(index))),
            #[cfg(feature = "webgpu-bare")]
            Backend::WebGpu => Ok(Device::webgpu(wgpu_kind(index))),
            #[cfg(feature = "cuda-bare")]
            Backend::Cuda => Ok(Device::cuda(index)),
            #[cfg(feature = "rocm-bare")]
            Backend::Rocm => Ok(Device::rocm(index)),
            #[cfg(feature = "tch")]
            #[allow(deprecated)]
            Backend::LibTorch => Ok(match libtorch_device(libtorch_cuda_devices(), index) {
                LibTorchDevice::Cuda(i) => Device::libtorch_cuda(i),
                LibTorchDevice::Cpu => Device::libtorch(),
            }),
            #[allow(unreachable_patterns)]
            _ => Err(missing()),
        }
    }
}

/// Where a LibTorch rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibTorchDevice {
    /// The host CPU.
    Cpu,
    /// The CUDA device with this index.
    Cuda(usize),
}

/// The LibTorch device of local rank `local_rank` when LibTorch sees `cuda_devices` CUDA devices: CUDA device
/// `local_rank % cuda_devices` when there is one (as Accelerate gives each local process its own GPU), else the
/// CPU.
///
/// ```
/// use burn_accelerate::backend::{LibTorchDevice, libtorch_device};
/// assert_eq!(libtorch_device(0, 3), LibTorchDevice::Cpu);
/// assert_eq!(libtorch_device(2, 3), LibTorchDevice::Cuda(1));
/// ```
pub fn libtorch_device(cuda_devices: usize, local_rank: usize) -> LibTorchDevice {
    if cuda_devices == 0 {
        LibTorchDevice::Cpu
    } else {
        LibTorchDevice::Cuda(local_rank % cuda_devices)
    }
}

/// The CUDA devices LibTorch sees (0 with a CPU-only LibTorch).
#[cfg(feature = "tch")]
fn libtorch_cuda_devices() -> usize {
    usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
}

/// Whether ranks on `backend` and `device` compute on the host CPU: the CPU backends, and LibTorch on its CPU
/// device (LibTorch may run on either).
pub fn runs_on_cpu(backend: Option<Backend>, device: &Device) -> bool {
    let _ = device;
    match backend {
        Some(b) if b.is_cpu() => true,
        #[cfg(feature = "tch")]
        #[allow(deprecated)]
        Some(Backend::LibTorch) => {
            let cpu = Device::libtorch();
            device == &cpu || device == &cpu.clone().autodiff()
        }
        _ => false,
    }
}

/// The wgpu adapter for local rank `index`: the default adapter for rank 0, the `index`-th discrete GPU otherwise.
#[cfg(any(
    feature = "wgpu-bare",
    feature = "vulkan-bare",
    feature = "metal-bare",
    feature = "webgpu-bare"
))]
fn wgpu_kind(index: usize) -> burn::tensor::DeviceKind {
    if index == 0 {
        burn::tensor::DeviceKind::DefaultDevice
    } else {
        burn::tensor::DeviceKind::DiscreteGpu(index)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.feature())
    }
}

impl FromStr for Backend {
    type Err = Error;

    /// Parses the names `BURN_DEVICE` accepts (`flex`, `ndarray`, `wgpu`, `vulkan`, `metal`, `webgpu`, `cuda`,
    /// `rocm`, `tch`), case-insensitively; `libtorch` is accepted for `tch`.
    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|b| b.feature() == name)
            .or((name == "libtorch").then_some(Backend::LibTorch))
            .ok_or_else(|| {
                Error::config(
                    "backend",
                    s,
                    "backend name",
                    "one of flex, ndarray, wgpu, vulkan, metal, webgpu, cuda, rocm, tch",
                )
            })
    }
}

/// The devices of `backend` that Burn finds on this machine (empty when the backend is not compiled in, or
/// its [probe](probe::probe) finds it cannot run here). GPU backends open each device to list it.
pub fn enumerate(backend: Backend) -> Vec<Device> {
    if !probe::probe(backend).is_ready() {
        return Vec::new();
    }
    use burn::tensor::DeviceType;
    let kind: Option<DeviceType> = match backend {
        #[cfg(feature = "flex")]
        Backend::Flex => Some(DeviceType::Flex),
        #[cfg(feature = "ndarray")]
        Backend::NdArray => Some(DeviceType::NdArray),
        #[cfg(feature = "wgpu-bare")]
        Backend::Wgpu => Some(DeviceType::Wgpu),
        #[cfg(feature = "vulkan-bare")]
        Backend::Vulkan => Some(DeviceType::Vulkan),
        #[cfg(feature = "metal-bare")]
        Backend::Metal => Some(DeviceType::Metal),
        #[cfg(feature = "webgpu-bare")]
        Backend::WebGpu => Some(DeviceType::WebGpu),
        #[cfg(feature = "cuda-bare")]
        Backend::Cuda => Some(DeviceType::Cuda),
        #[cfg(feature = "rocm-bare")]
        Backend::Rocm => Some(DeviceType::Rocm),
        #[cfg(feature = "tch")]
        Backend::LibTorch => Some(DeviceType::LibTorch),
        #[allow(unreachable_patterns)]
        _ => None,
    };
    kind.map(|k| Device::enumerate(k).into_vec())
        .unwrap_or_default()
}

/// What the user asked for when choosing a device.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceRequest {
    /// An explicit device from the builder.
    pub device: Option<Device>,
    /// An explicit backend from the builder.
    pub backend: Option<Backend>,
    /// `cpu=true` from the builder or config.
    pub cpu: bool,
}

/// Chooses the device of local rank `local_index` (without autodiff), following the resolution order of this
/// module. Returns the device and the backend it belongs to, when known.
pub(crate) fn select_device(
    request: &DeviceRequest,
    local_index: usize,
) -> Result<(Device, Option<Backend>)> {
    if let Some(device) = &request.device {
        return Ok((device.clone(), None));
    }
    if let Some(backend) = request.backend {
        return Ok((rank_device(backend, local_index, "builder")?, Some(backend)));
    }
    if request.cpu || env::flag("ACCELERATE_USE_CPU")?.unwrap_or(false) {
        let origin = if request.cpu {
            "cpu=true"
        } else {
            "ACCELERATE_USE_CPU"
        };
        let backend = cpu_backend().ok_or_else(|| Error::BackendNotCompiled {
            backend: "cpu (flex or ndarray)".into(),
            origin: origin.into(),
            feature: "flex",
        })?;
        return Ok((backend.device_from(0, origin)?, Some(backend)));
    }
    if let Some(name) = env::var("BURN_DEVICE") {
        let backend: Backend = name.parse().map_err(|_| {
            Error::config(
                "BURN_DEVICE",
                &name,
                "environment",
                "one of flex, ndarray, wgpu, vulkan, metal, webgpu, cuda, rocm, tch",
            )
        })?;
        return Ok((
            rank_device(backend, local_index, "BURN_DEVICE")?,
            Some(backend),
        ));
    }
    let backend = default_backend(Backend::compiled(), probe::probe)?;
    Ok((rank_device(backend, local_index, "default")?, Some(backend)))
}

/// The device runs of this build use when nothing is given to the builder (local rank 0's): `ACCELERATE_USE_CPU`,
/// then `BURN_DEVICE`, then the first compiled backend that can run here (a GPU backend without its driver is
/// skipped, with a warning).
///
/// Use it rather than Burn's `Device::default()` for values made before the accelerator, such as initial
/// weights drawn once and handed to every rank: Burn's default takes CUDA whenever it is compiled in, and
/// Burn's CUDA runtime panics on a machine without the driver, where this returns the next backend or an error
/// saying what is missing.
///
/// ```
/// let device = burn_accelerate::backend::default_device()?;
/// let x = burn::tensor::Tensor::<1>::ones([3], &device);
/// assert_eq!(x.sum().into_scalar::<f32>(), 3.0);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
///
/// # Errors
/// A malformed `ACCELERATE_USE_CPU` or `BURN_DEVICE`, or no compiled backend can run here.
pub fn default_device() -> Result<Device> {
    select_device(&DeviceRequest::default(), 0).map(|(device, _)| device)
}

/// The first of `compiled` (in priority order) that `probe` finds usable; a GPU backend that cannot run here
/// is skipped with a warning naming what is missing (as Accelerate falls back to the CPU without a GPU). When
/// none can run, the first one's reason.
fn default_backend(
    compiled: Vec<Backend>,
    probe: impl Fn(Backend) -> probe::Probe,
) -> Result<Backend> {
    // The warning below once per process: every rank and `default_device` make this choice.
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let mut first_problem = None;
    for backend in compiled {
        let found = probe(backend);
        match found.status {
            probe::Availability::Ready { .. } => {
                if let Some(Error::BackendUnavailable {
                    backend: skipped,
                    missing,
                    ..
                }) = &first_problem
                    && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    crate::notice::warn_visibly(&format!(
                        "the `{skipped}` backend is compiled in but cannot run here ({missing}); using `{backend}`"
                    ));
                }
                return Ok(backend);
            }
            probe::Availability::Unavailable { missing, fix } => {
                first_problem.get_or_insert(Error::BackendUnavailable {
                    backend: backend.to_string(),
                    origin: "default".into(),
                    missing,
                    fix,
                });
            }
        }
    }
    Err(first_problem.unwrap_or(Error::NoBackend {
        available: "flex, ndarray, wgpu, vulkan, metal, webgpu, cuda, rocm, tch",
    }))
}

/// [`Error::BackendUnavailable`] when `backend`'s probe finds it cannot run here.
fn ensure_usable(backend: Backend, origin: &str) -> Result<()> {
    match probe::probe(backend).status {
        probe::Availability::Ready { .. } => Ok(()),
        probe::Availability::Unavailable { missing, fix } if backend.is_compiled() => {
            Err(Error::BackendUnavailable {
                backend: backend.to_string(),
                origin: origin.to_string(),
                missing,
                fix,
            })
        }
        // Not compiled in: the device constructor reports the missing feature.
        probe::Availability::Unavailable { .. } => Ok(()),
    }
}

/// The device of local rank `local_index` on `backend`: device `local_index` when the machine has several,
/// else the backend's one device (CPU backends, or one GPU shared by in-process ranks).
fn rank_device(backend: Backend, local_index: usize, origin: &str) -> Result<Device> {
    ensure_usable(backend, origin)?;
    if local_index == 0 || backend.is_cpu() {
        return backend.device_from(0, origin);
    }
    let devices = enumerate(backend);
    if devices.len() > 1 {
        Ok(devices[local_index % devices.len()].clone())
    } else {
        backend.device_from(0, origin)
    }
}

/// The CPU backend this build prefers: flex, else ndarray.
fn cpu_backend() -> Option<Backend> {
    [Backend::Flex, Backend::NdArray]
        .into_iter()
        .find(|b| b.is_compiled())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for backend in Backend::ALL {
            assert_eq!(backend.to_string().parse::<Backend>().unwrap(), backend);
        }
        assert_eq!("LibTorch".parse::<Backend>().unwrap(), Backend::LibTorch);
        assert!("tpu".parse::<Backend>().is_err());
    }

    #[test]
    fn missing_backend_names_its_feature() {
        // No build compiles every backend in (Metal and CUDA do not build on the same machine).
        let absent: Vec<Backend> = Backend::ALL
            .into_iter()
            .filter(|b| !b.is_compiled())
            .collect();
        assert!(!absent.is_empty());
        for backend in absent {
            let err = backend.device(0).unwrap_err().to_string();
            assert!(err.contains(backend.feature()), "{err}");
            assert!(err.contains("cargo feature"), "{err}");
        }
    }

    #[test]
    fn an_unusable_gpu_backend_is_skipped_for_the_next_compiled_one() {
        let fake = |backend: Backend| probe::Probe {
            backend,
            status: if backend == Backend::Cuda {
                probe::Availability::Unavailable {
                    missing: "no libcuda.so".into(),
                    fix: "install the driver".into(),
                }
            } else {
                probe::Availability::Ready { devices: 1 }
            },
            facts: Vec::new(),
            collectives: false,
        };
        assert_eq!(
            default_backend(vec![Backend::Cuda, Backend::Flex], fake).unwrap(),
            Backend::Flex
        );
        let err = default_backend(vec![Backend::Cuda], fake)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "`cuda` backend cannot run here (default): no libcuda.so; install the driver"
            ),
            "{err}"
        );
        assert!(matches!(
            default_backend(Vec::new(), fake),
            Err(Error::NoBackend { .. })
        ));
    }

    #[test]
    fn explicit_backend_wins() {
        let backend = Backend::compiled()[0];
        let request = DeviceRequest {
            backend: Some(backend),
            ..Default::default()
        };
        let (_, chosen) = select_device(&request, 0).unwrap();
        assert_eq!(chosen, Some(backend));
    }

    #[test]
    fn libtorch_uses_one_cuda_device_per_local_rank_when_it_sees_cuda() {
        assert_eq!(libtorch_device(0, 0), LibTorchDevice::Cpu);
        assert_eq!(libtorch_device(0, 5), LibTorchDevice::Cpu);
        assert_eq!(libtorch_device(1, 0), LibTorchDevice::Cuda(0));
        assert_eq!(libtorch_device(4, 2), LibTorchDevice::Cuda(2));
        // More local ranks than GPUs: they share them round-robin.
        assert_eq!(libtorch_device(4, 6), LibTorchDevice::Cuda(2));
    }

    #[test]
    fn cpu_ranks_are_multi_cpu_and_gpu_ranks_multi_gpu() {
        use crate::distributed::DistributedType;
        let device = Device::default();
        for (backend, cpu) in [
            (Some(Backend::Flex), true),
            (Some(Backend::NdArray), true),
            (Some(Backend::Wgpu), false),
            (Some(Backend::Cuda), false),
            (None, false),
        ] {
            assert_eq!(runs_on_cpu(backend, &device), cpu, "{backend:?}");
            let expected = if cpu {
                DistributedType::MultiCpu
            } else {
                DistributedType::MultiGpu
            };
            assert_eq!(DistributedType::for_device(2, cpu), expected);
        }
        assert_eq!(DistributedType::for_device(1, false), DistributedType::No);
    }

    /// LibTorch on its CPU counts as a CPU run (it reported MULTI_GPU before); on CUDA as a GPU run.
    #[cfg(feature = "tch")]
    #[test]
    #[allow(deprecated)]
    fn libtorch_on_the_cpu_is_multi_cpu() {
        assert!(runs_on_cpu(Some(Backend::LibTorch), &Device::libtorch()));
        assert!(runs_on_cpu(
            Some(Backend::LibTorch),
            &Device::libtorch().autodiff()
        ));
        assert!(!runs_on_cpu(
            Some(Backend::LibTorch),
            &Device::libtorch_cuda(0)
        ));
    }
}
