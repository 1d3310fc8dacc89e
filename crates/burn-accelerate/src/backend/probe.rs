//! What a GPU backend needs at run time, checked before Burn is asked for a device.
//!
//! Burn's CUDA runtime loads the driver (`libcuda.so`) when the first tensor reaches the device, on a runtime
//! thread; when the library or the device is missing, that thread panics with a backtrace instead of saying
//! what is missing. [`probe`] asks first, without panicking: the driver library, `cuInit`, the devices, and the
//! libraries a run may need later (NCCL for the device all-reduce, `libdevice.10.bc` for math functions).
//! Device selection (the builder, [`default_device`](super::default_device)) turns a failed probe into
//! [`Error::BackendUnavailable`](crate::Error::BackendUnavailable), or skips to the next compiled backend when
//! the backend was not asked for by name; `burn-accelerate env` prints every fact probed.

use std::fmt;
use std::path::{Path, PathBuf};

use super::Backend;

/// What [`probe`] found for one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The backend probed.
    pub backend: Backend,
    /// Whether a device of it can be opened, and if not, why and how to fix it.
    pub status: Availability,
    /// Each fact checked, as `(what, finding)`, for `burn-accelerate env`.
    pub facts: Vec<(String, String)>,
    /// Whether the backend's device collective library loads (NCCL for CUDA), so gradients can be averaged
    /// in device memory.
    pub collectives: bool,
}

/// Whether a backend's devices can be used on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// Usable; `devices` is how many were found (1 for backends that do not count them).
    Ready {
        /// The number of devices found.
        devices: usize,
    },
    /// Not usable here.
    Unavailable {
        /// What is missing (a library, a device).
        missing: String,
        /// How to fix it.
        fix: String,
    },
}

impl Probe {
    /// Whether the backend can run here.
    pub fn is_ready(&self) -> bool {
        matches!(self.status, Availability::Ready { .. })
    }

    /// The number of usable devices (0 when unavailable).
    pub fn devices(&self) -> usize {
        match self.status {
            Availability::Ready { devices } => devices,
            Availability::Unavailable { .. } => 0,
        }
    }

    /// The fact recorded under `what`, if probed.
    pub fn fact(&self, what: &str) -> Option<&str> {
        self.facts
            .iter()
            .find(|(k, _)| k == what)
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.status {
            Availability::Ready { devices } => {
                write!(f, "{}: ready, {devices} device(s)", self.backend)?
            }
            Availability::Unavailable { missing, .. } => {
                write!(f, "{}: unavailable, {missing}", self.backend)?
            }
        }
        for (what, finding) in &self.facts {
            write!(f, "; {what}: {finding}")?;
        }
        Ok(())
    }
}

/// What the CUDA driver reported, or why it could not be asked: the input of [`cuda_probe`], gathered by the
/// real driver in CUDA builds and written by hand in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFacts {
    /// The driver library loaded, `cuInit` succeeded, and these devices (name, bytes of memory) were found;
    /// or why not.
    pub driver: Result<Vec<(String, u64)>, DriverProblem>,
    /// Whether NCCL (`libnccl.so`, the name Burn's CUDA runtime opens) loads.
    pub nccl: bool,
    /// Whether NCCL's versioned `libnccl.so.2` loads (what PyPI's and Debian's runtime packages install).
    pub nccl_versioned: bool,
    /// Where `libdevice.10.bc` is, when found.
    pub libdevice: Option<PathBuf>,
}

/// Why the CUDA driver could not list devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverProblem {
    /// `libcuda.so` is not on the library path.
    LibraryMissing,
    /// `cuInit` or the device query failed with this driver error.
    Driver(String),
}

/// The verdict on the CUDA backend from what the driver reported.
pub fn cuda_probe(facts: CudaFacts) -> Probe {
    let mut lines = Vec::new();
    let status = match &facts.driver {
        Err(DriverProblem::LibraryMissing) => {
            lines.push(("driver".into(), "libcuda.so not found".into()));
            Availability::Unavailable {
                missing: "the NVIDIA driver library libcuda.so could not be loaded (no NVIDIA driver on this \
                          machine, or not on the library path)"
                    .into(),
                fix: "install the NVIDIA driver, or add the folder holding libcuda.so.1 to LD_LIBRARY_PATH; to \
                      train on the CPU instead, build with the `flex` feature as well and set \
                      ACCELERATE_USE_CPU=1"
                    .into(),
            }
        }
        Err(DriverProblem::Driver(error)) => {
            lines.push(("driver".into(), format!("loaded; cuInit failed: {error}")));
            Availability::Unavailable {
                missing: format!("the CUDA driver found no usable device ({error})"),
                fix: "check `nvidia-smi` and CUDA_VISIBLE_DEVICES; to train on the CPU instead, build with the \
                      `flex` feature as well and set ACCELERATE_USE_CPU=1"
                    .into(),
            }
        }
        Ok(devices) if devices.is_empty() => {
            lines.push(("driver".into(), "loaded; 0 devices".into()));
            Availability::Unavailable {
                missing: "the CUDA driver reports no device".into(),
                fix: "check `nvidia-smi` and CUDA_VISIBLE_DEVICES (an empty value hides every GPU)"
                    .into(),
            }
        }
        Ok(devices) => {
            let list: Vec<String> = devices
                .iter()
                .enumerate()
                .map(|(i, (name, bytes))| {
                    format!(
                        "{i}: {name} ({:.1} GiB)",
                        *bytes as f64 / (1u64 << 30) as f64
                    )
                })
                .collect();
            lines.push(("driver".into(), format!("loaded; {}", list.join(", "))));
            Availability::Ready {
                devices: devices.len(),
            }
        }
    };
    lines.push((
        "nccl".into(),
        if facts.nccl {
            "libnccl.so loads (device all-reduce possible)".into()
        } else if facts.nccl_versioned {
            "libnccl.so.2 loads but libnccl.so (the name Burn's CUDA runtime opens) does not: add the link \
             `ln -s libnccl.so.2 libnccl.so` in a folder on LD_LIBRARY_PATH"
                .into()
        } else {
            "libnccl.so not found (gradients cross ranks through host memory; PyPI's nvidia-nccl-cu12 provides \
             it, add its lib folder to LD_LIBRARY_PATH)"
                .into()
        },
    ));
    lines.push((
        "libdevice".into(),
        match &facts.libdevice {
            Some(path) => path.display().to_string(),
            None => "libdevice.10.bc not found (kernels calling math functions such as exp or tanh fail to \
                     compile; set CUDA_PATH to a CUDA toolkit, or to the nvidia/cuda_nvcc folder of PyPI's \
                     nvidia-cuda-nvcc-cu12)"
                .into(),
        },
    ));
    Probe {
        backend: Backend::Cuda,
        status,
        facts: lines,
        collectives: facts.nccl,
    }
}

/// Where Burn's CUDA compiler finds `libdevice.10.bc`: `$CUDA_PATH/nvvm/libdevice/`, else the first of the
/// usual toolkit folders that has `nvvm/libdevice` (the same search as `cubecl-llvm`).
pub fn libdevice_path(cuda_path: Option<&Path>) -> Option<PathBuf> {
    let root = match cuda_path {
        Some(path) => path.to_path_buf(),
        None => ["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr"]
            .into_iter()
            .map(PathBuf::from)
            .find(|candidate| candidate.join("nvvm").join("libdevice").is_dir())?,
    };
    let file = root.join("nvvm").join("libdevice").join("libdevice.10.bc");
    file.is_file().then_some(file)
}

/// Probes `backend` on this machine. Backends without a run-time probe (CPU backends, wgpu, LibTorch, which
/// falls back to its CPU by itself) are reported ready with one device.
pub fn probe(backend: Backend) -> Probe {
    match backend {
        _ if !backend.is_compiled() => Probe {
            backend,
            status: Availability::Unavailable {
                missing: "this build does not contain it".into(),
                fix: format!(
                    "enable the cargo feature `{}` of burn-accelerate",
                    backend.feature()
                ),
            },
            facts: Vec::new(),
            collectives: false,
        },
        Backend::Cuda => cuda_probe(cuda_facts()),
        _ => Probe {
            backend,
            status: Availability::Ready { devices: 1 },
            facts: Vec::new(),
            collectives: false,
        },
    }
}

/// The CUDA driver's answers on this machine, asked once per process: device selection, `enumerate`, the
/// transport choice and `env` all probe, and the driver's answers do not change while the process runs.
#[cfg(feature = "cuda-bare")]
fn cuda_facts() -> CudaFacts {
    static FACTS: std::sync::OnceLock<CudaFacts> = std::sync::OnceLock::new();
    FACTS.get_or_init(ask_the_driver).clone()
}

/// Asks the CUDA driver through `cudarc` (which Burn's CUDA runtime also uses).
#[cfg(feature = "cuda-bare")]
fn ask_the_driver() -> CudaFacts {
    use cudarc::driver::result;
    // SAFETY: loading a shared library runs its initialisers; the driver and NCCL are the libraries Burn's
    // CUDA runtime loads too.
    let driver = if unsafe { cudarc::driver::sys::is_culib_present() } {
        result::init()
            .and_then(|()| {
                let count = result::device::get_count()?;
                (0..count)
                    .map(|ordinal| {
                        let device = result::device::get(ordinal)?;
                        let name = result::device::get_name(device)?;
                        // SAFETY: `device` was returned by the driver just above.
                        let bytes = unsafe { result::device::total_mem(device) }?;
                        Ok((name, bytes as u64))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(|e| DriverProblem::Driver(format!("{e:?}")))
    } else {
        Err(DriverProblem::LibraryMissing)
    };
    CudaFacts {
        driver,
        // SAFETY: as above.
        nccl: unsafe { cudarc::nccl::sys::is_culib_present() },
        // SAFETY: as above.
        nccl_versioned: unsafe { libloading::Library::new("libnccl.so.2") }.is_ok(),
        libdevice: libdevice_path(std::env::var_os("CUDA_PATH").as_deref().map(Path::new)),
    }
}

/// Without the CUDA backend compiled in there is nothing to ask ([`probe`] does not get here).
#[cfg(not(feature = "cuda-bare"))]
fn cuda_facts() -> CudaFacts {
    CudaFacts {
        driver: Err(DriverProblem::LibraryMissing),
        nccl: false,
        nccl_versioned: false,
        libdevice: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(driver: Result<Vec<(String, u64)>, DriverProblem>) -> CudaFacts {
        CudaFacts {
            driver,
            nccl: false,
            nccl_versioned: false,
            libdevice: None,
        }
    }

    #[test]
    fn a_missing_driver_says_which_library_and_how_to_train_anyway() {
        let probe = cuda_probe(facts(Err(DriverProblem::LibraryMissing)));
        let Availability::Unavailable { missing, fix } = &probe.status else {
            panic!("{probe}")
        };
        assert!(missing.contains("libcuda.so"), "{missing}");
        assert!(
            fix.contains("LD_LIBRARY_PATH") && fix.contains("ACCELERATE_USE_CPU"),
            "{fix}"
        );
        assert_eq!(probe.devices(), 0);
        assert_eq!(probe.fact("driver"), Some("libcuda.so not found"));
    }

    #[test]
    fn a_driver_without_devices_is_unavailable() {
        let probe = cuda_probe(facts(Err(DriverProblem::Driver(
            "CUDA_ERROR_NO_DEVICE".into(),
        ))));
        assert!(!probe.is_ready());
        assert!(
            probe.to_string().contains("CUDA_ERROR_NO_DEVICE"),
            "{probe}"
        );
        assert!(!cuda_probe(facts(Ok(Vec::new()))).is_ready());
    }

    #[test]
    fn devices_are_listed_with_their_memory_and_missing_extras_are_named() {
        let probe = cuda_probe(facts(Ok(vec![(
            "NVIDIA H100 80GB HBM3".into(),
            85_520_000_000,
        )])));
        assert_eq!(probe.devices(), 1);
        assert!(
            probe
                .fact("driver")
                .unwrap()
                .contains("0: NVIDIA H100 80GB HBM3 (79.6 GiB)")
        );
        assert!(probe.fact("nccl").unwrap().contains("not found"));
        assert!(probe.fact("libdevice").unwrap().contains("CUDA_PATH"));
        assert!(!probe.collectives);
        let versioned_only = cuda_probe(CudaFacts {
            nccl_versioned: true,
            ..facts(Ok(Vec::new()))
        });
        assert!(
            versioned_only
                .fact("nccl")
                .unwrap()
                .contains("ln -s libnccl.so.2 libnccl.so")
        );
    }

    #[test]
    fn libdevice_is_found_under_cuda_path() {
        let dir = std::env::temp_dir().join(format!("libdevice-probe-{}", std::process::id()));
        let folder = dir.join("nvvm").join("libdevice");
        std::fs::create_dir_all(&folder).unwrap();
        assert_eq!(libdevice_path(Some(&dir)), None);
        std::fs::write(folder.join("libdevice.10.bc"), b"BC").unwrap();
        assert_eq!(
            libdevice_path(Some(&dir)),
            Some(folder.join("libdevice.10.bc"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn backends_without_a_probe_are_ready() {
        assert!(probe(Backend::Flex).is_ready());
        // A backend this build lacks is unavailable, naming its feature.
        for backend in Backend::ALL.into_iter().filter(|b| !b.is_compiled()) {
            let probe = probe(backend);
            assert!(!probe.is_ready());
            assert!(probe.to_string().contains("does not contain it"), "{probe}");
        }
    }
}
