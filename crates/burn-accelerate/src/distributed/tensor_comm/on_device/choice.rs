//! Which [`GradientTransport`](super::GradientTransport) a run uses, and why: decided from facts every rank
//! can gather (the backend, the ranks, the CUDA devices, whether NCCL loads), so that the choice is a pure
//! function the tests and `burn-accelerate env` share with the run.

use std::fmt;

use crate::config::GradientTransport as Preference;
use crate::error::{Error, Result};

/// A gradient path between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// Host copies through the rank's communicator (every backend).
    Host,
    /// Burn's in-process collective between the CUDA devices of one process (NCCL underneath).
    BurnCollective,
    /// NCCL between processes, one CUDA device each, its id exchanged over the communicator.
    Nccl,
    /// In-process ranks on one device hand each other the device tensors themselves, for every call (any
    /// backend, sharded or not).
    SharedDevice,
}

impl TransportKind {
    /// How `env` and the start-up line name it.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Host => "host all-reduce",
            TransportKind::BurnCollective => "device all-reduce (Burn's CUDA collective)",
            TransportKind::Nccl => "device collectives (NCCL)",
            TransportKind::SharedDevice => crate::distributed::tensor_comm::shared_device::NAME,
        }
    }

    /// Whether gradients stay in device memory.
    pub fn on_device(self) -> bool {
        self != TransportKind::Host
    }

    /// Where each call of the tensor interface goes on this path, for `env`: `(call, path)` pairs.
    pub fn per_call(self) -> Vec<(&'static str, &'static str)> {
        const CALLS: [&str; 6] = [
            "all-reduce",
            "reduce-scatter, all-gather (uneven parts padded)",
            "reduce, broadcast",
            "send/recv",
            "sub-groups",
            "single values (verdicts, norms)",
        ];
        let paths: [&'static str; 6] = match self {
            TransportKind::Host => ["host"; 6],
            TransportKind::BurnCollective => [
                "device (mean), host (other reductions)",
                "host",
                "host",
                "host",
                "host",
                "host",
            ],
            TransportKind::Nccl => [
                "device",
                "device",
                "device",
                "device (one group call)",
                "device (ncclCommSplit)",
                "host",
            ],
            TransportKind::SharedDevice => ["device"; 6],
        };
        CALLS.into_iter().zip(paths).collect()
    }
}

/// What a group's transport carries: the engines differ in the calls they have, so it decides between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exchanges {
    /// Data parallelism: gradient all-reduces.
    Gradients,
    /// Sharded training: reduce-scatters, all-gathers, reductions to one rank, broadcasts, sub-groups.
    Shards,
    /// A pipeline's activations and their gradients: point-to-point batches.
    Messages,
}

/// What the choice depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportFacts {
    /// The number of ranks.
    pub world: usize,
    /// The ranks on this machine (every rank, for in-process ranks).
    pub local_world: usize,
    /// Whether the ranks are threads of this process (else one process each, under `launch`/mpirun).
    pub in_process: bool,
    /// Whether the ranks compute on CUDA devices, and the backend's name otherwise.
    pub backend: std::result::Result<(), String>,
    /// The CUDA devices this machine shows.
    pub cuda_devices: usize,
    /// Whether NCCL (`libnccl.so`) loads.
    pub nccl: bool,
    /// What the transport carries (Burn's in-process collective all-reduces only).
    pub exchanges: Exchanges,
    /// Whether the ranks are threads of this process computing on one device (they can hand each other
    /// tensors).
    pub shared_device: bool,
}

/// The transport chosen and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportChoice {
    /// The path gradients take.
    pub kind: TransportKind,
    /// Why, in words (`env` and the start-up line show it).
    pub reason: String,
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.kind.name(), self.reason)
    }
}

/// Chooses the transport `preference` allows on a run described by `facts`.
///
/// # Errors
/// [`Preference::Device`] where no device path exists, with the reason.
pub fn choose(preference: Preference, facts: &TransportFacts) -> Result<TransportChoice> {
    let host = |reason: String| TransportChoice {
        kind: TransportKind::Host,
        reason,
    };
    if facts.world <= 1 {
        return Ok(host("one rank: no gradient crosses ranks".into()));
    }
    if preference == Preference::Host {
        return Ok(host("gradient_transport = host".into()));
    }
    let device = device_path(facts);
    match (device, preference) {
        (Ok(choice), _) => Ok(choice),
        (Err(reason), Preference::Device) => Err(Error::config(
            "gradient_transport",
            "device",
            "configuration",
            format!("auto or host: no device path between these ranks, {reason}"),
        )),
        (Err(reason), _) => Ok(host(reason)),
    }
}

/// The device transport these ranks can use, or why none.
fn device_path(facts: &TransportFacts) -> std::result::Result<TransportChoice, String> {
    if facts.shared_device {
        return Ok(TransportChoice {
            kind: TransportKind::SharedDevice,
            reason: format!(
                "{} in-process ranks on one device: tensors pass between them as they are",
                facts.world
            ),
        });
    }
    if let Err(backend) = &facts.backend {
        return Err(format!(
            "the ranks run on {backend} in separate processes (or on separate devices); Burn 0.22 has device \
             collectives between them on CUDA only"
        ));
    }
    if !facts.nccl {
        return Err("libnccl.so does not load on this machine".into());
    }
    if facts.cuda_devices < facts.local_world {
        return Err(format!(
            "{} ranks on this machine share {} CUDA device(s), and NCCL needs one device per rank",
            facts.local_world, facts.cuda_devices
        ));
    }
    Ok(
        if facts.in_process && facts.exchanges == Exchanges::Gradients {
            TransportChoice {
                kind: TransportKind::BurnCollective,
                reason: format!(
                    "{} in-process ranks on {} CUDA devices",
                    facts.world, facts.local_world
                ),
            }
        } else if facts.in_process {
            TransportChoice {
                kind: TransportKind::Nccl,
                reason: format!(
                    "{} in-process ranks on {} CUDA devices, one NCCL communicator each (Burn's collective \
                 all-reduces only)",
                    facts.world, facts.local_world
                ),
            }
        } else {
            TransportChoice {
                kind: TransportKind::Nccl,
                reason: format!("{} processes, one CUDA device each", facts.world),
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(world: usize, local_world: usize, in_process: bool) -> TransportFacts {
        TransportFacts {
            world,
            local_world,
            in_process,
            backend: Ok(()),
            cuda_devices: 8,
            nccl: true,
            exchanges: Exchanges::Gradients,
            shared_device: false,
        }
    }

    #[test]
    fn in_process_ranks_on_one_device_share_tensors_whatever_the_backend_or_sharding() {
        for facts in [
            TransportFacts {
                shared_device: true,
                cuda_devices: 1,
                ..cuda(2, 2, true)
            },
            TransportFacts {
                shared_device: true,
                backend: Err("flex".into()),
                exchanges: Exchanges::Shards,
                nccl: false,
                ..cuda(4, 4, true)
            },
        ] {
            let choice = choose(Preference::Auto, &facts).unwrap();
            assert_eq!(choice.kind, TransportKind::SharedDevice);
            assert!(choice.kind.on_device());
            assert_eq!(
                choose(Preference::Device, &facts).unwrap().kind,
                TransportKind::SharedDevice
            );
            assert_eq!(
                choose(Preference::Host, &facts).unwrap().kind,
                TransportKind::Host
            );
        }
    }

    #[test]
    fn cuda_ranks_with_nccl_stay_on_the_device() {
        let choice = choose(Preference::Auto, &cuda(4, 4, true)).unwrap();
        assert_eq!(choice.kind, TransportKind::BurnCollective);
        let choice = choose(Preference::Auto, &cuda(16, 8, false)).unwrap();
        assert_eq!(choice.kind, TransportKind::Nccl);
        assert_eq!(
            choice.to_string(),
            "device collectives (NCCL) (16 processes, one CUDA device each)"
        );
        // Sharded training and pipelines take NCCL too, between processes and between the devices of one
        // process, where Burn's collective (all-reduce only) would send every other call through host memory.
        for exchanges in [Exchanges::Shards, Exchanges::Messages] {
            for in_process in [true, false] {
                let facts = TransportFacts {
                    exchanges,
                    ..cuda(4, 4, in_process)
                };
                let choice = choose(Preference::Auto, &facts).unwrap();
                assert_eq!(choice.kind, TransportKind::Nccl, "{facts:?}");
                assert!(
                    choice
                        .kind
                        .per_call()
                        .iter()
                        .take(5)
                        .all(|(_, path)| path.starts_with("device")),
                    "{:?}",
                    choice.kind.per_call()
                );
            }
        }
        assert_eq!(
            choose(Preference::Device, &cuda(2, 2, false)).unwrap().kind,
            TransportKind::Nccl
        );
    }

    #[test]
    fn host_memory_elsewhere_with_the_reason() {
        let cases: [(TransportFacts, &str); 4] = [
            (
                TransportFacts {
                    backend: Err("flex".into()),
                    ..cuda(2, 2, true)
                },
                "the ranks run on flex in separate processes (or on separate devices); Burn 0.22 has device \
                 collectives between them on CUDA only",
            ),
            (
                TransportFacts {
                    nccl: false,
                    ..cuda(2, 2, false)
                },
                "libnccl.so does not load on this machine",
            ),
            (
                TransportFacts {
                    cuda_devices: 1,
                    ..cuda(2, 2, true)
                },
                "2 ranks on this machine share 1 CUDA device(s), and NCCL needs one device per rank",
            ),
            (cuda(1, 1, true), "one rank: no gradient crosses ranks"),
        ];
        for (facts, reason) in cases {
            let choice = choose(Preference::Auto, &facts).unwrap();
            assert_eq!(choice.kind, TransportKind::Host, "{facts:?}");
            assert_eq!(choice.reason, reason);
            if facts.world > 1 {
                let err = choose(Preference::Device, &facts).unwrap_err().to_string();
                assert!(
                    err.contains("gradient_transport") && err.contains(reason),
                    "{err}"
                );
            }
        }
    }

    #[test]
    fn host_can_be_forced() {
        let choice = choose(Preference::Host, &cuda(4, 4, false)).unwrap();
        assert_eq!(choice.kind, TransportKind::Host);
        assert_eq!(choice.reason, "gradient_transport = host");
        assert!(!choice.kind.on_device());
    }
}
