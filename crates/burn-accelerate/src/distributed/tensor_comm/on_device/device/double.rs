//! A device collective library in host memory: every rank of a group deposits its values, the last one
//! combines them — in f64 and from the last rank to the first, so it rounds differently from the host
//! all-reduce, as a real library does — and gives each rank its result (the whole, its part, the gathered parts
//! or the root's values, by the call); a rank told to hang never deposits, so the others time out and
//! abort. Every call a communicator receives after it was aborted is counted (NCCL frees an aborted
//! communicator: such a call would use freed memory).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::Tensor;

use super::{DeviceCall, DeviceComm, DeviceCommLibrary};
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::on_device::{from_host, to_host};

#[derive(Default)]
struct Round {
    deposits: Vec<Option<Vec<f32>>>,
    /// Each rank's result.
    results: Option<Vec<Vec<f32>>>,
}

/// What a round computes: the call without its tensor.
#[derive(Debug, Clone, Copy)]
enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
}

/// Every rank's result of `kind` over `deposits` (all of length `n`), combining in f64 from the last rank to the
/// first; `sum_only` forgets a mean's division.
fn results(kind: Kind, deposits: &[Vec<f32>], sum_only: bool) -> Vec<Vec<f32>> {
    let world = deposits.len();
    let combine = |op: ReduceOp| -> Vec<f32> {
        let n = deposits[0].len();
        let mut acc: Vec<f64> = deposits[world - 1].iter().map(|&x| x as f64).collect();
        for d in deposits[..world - 1].iter().rev() {
            for (a, &x) in acc.iter_mut().zip(d) {
                let x = x as f64;
                *a = match op {
                    ReduceOp::Sum | ReduceOp::Mean => *a + x,
                    ReduceOp::Max => a.max(x),
                    ReduceOp::Min => a.min(x),
                };
            }
        }
        let divisor = if op == ReduceOp::Mean && !sum_only {
            world as f64
        } else {
            1.0
        };
        acc.truncate(n);
        acc.iter().map(|s| (s / divisor) as f32).collect()
    };
    match kind {
        Kind::AllReduce(op) => vec![combine(op); world],
        Kind::ReduceScatter(op) => {
            let whole = combine(op);
            let part = whole.len() / world;
            (0..world)
                .map(|r| whole[r * part..(r + 1) * part].to_vec())
                .collect()
        }
        Kind::AllGather => vec![deposits.concat(); world],
        Kind::Broadcast(root) => vec![deposits[root].clone(); world],
    }
}

#[derive(Default)]
struct Shared {
    world: usize,
    connected: usize,
    rounds: Vec<Round>,
    aborted: bool,
}

/// Every group formed so far, by id.
type Groups = Mutex<HashMap<Vec<u8>, Arc<Mutex<Shared>>>>;

fn groups() -> &'static Groups {
    static GROUPS: OnceLock<Groups> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

/// The library; `hang_rank` never takes part in collectives (a stuck peer), `fail_connect` cannot connect,
/// `sum_only` forgets to divide by the number of ranks (a broken library, for checks that must fail).
#[derive(Debug, Default, Clone)]
pub struct HostLibrary {
    pub hang_rank: Option<usize>,
    pub fail_connect: Option<usize>,
    pub sum_only: bool,
    /// Calls made on a communicator after it was aborted, over every communicator of this library.
    pub uses_after_abort: Arc<AtomicUsize>,
    /// Collectives started, over every communicator of this library.
    pub started: Arc<AtomicUsize>,
}

impl DeviceCommLibrary for HostLibrary {
    fn name(&self) -> &'static str {
        "NCCL"
    }

    fn new_id(&self) -> Result<Vec<u8>, String> {
        use std::sync::atomic::AtomicU64;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let mut id = vec![0u8; 128];
        let n = NEXT.fetch_add(1, Ordering::Relaxed) ^ (std::process::id() as u64) << 32;
        id[..8].copy_from_slice(&n.to_le_bytes());
        Ok(id)
    }

    fn connect(&self, id: &[u8], rank: usize, world: usize) -> Result<Box<dyn DeviceComm>, String> {
        if self.fail_connect == Some(rank) {
            return Err("ncclSystemError: no route to peer".into());
        }
        super::group_id(id)?;
        let shared = groups()
            .lock()
            .unwrap()
            .entry(id.to_vec())
            .or_insert_with(|| {
                Arc::new(Mutex::new(Shared {
                    world,
                    ..Default::default()
                }))
            })
            .clone();
        shared.lock().unwrap().connected += 1;
        Ok(Box::new(HostComm {
            shared,
            rank,
            hang: self.hang_rank == Some(rank),
            sum_only: self.sum_only,
            state: Mutex::new(State::default()),
            aborted: AtomicBool::new(false),
            uses_after_abort: self.uses_after_abort.clone(),
            started: self.started.clone(),
        }))
    }
}

#[derive(Debug, Default)]
struct State {
    round: usize,
    pending: Option<(usize, Tensor<1>)>,
}

pub struct HostComm {
    shared: Arc<Mutex<Shared>>,
    rank: usize,
    hang: bool,
    sum_only: bool,
    state: Mutex<State>,
    aborted: AtomicBool,
    uses_after_abort: Arc<AtomicUsize>,
    started: Arc<AtomicUsize>,
}

impl std::fmt::Debug for HostComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostComm(rank {})", self.rank)
    }
}

impl HostComm {
    /// Counts a call on this communicator after its abort (NCCL would read freed memory).
    fn check_live(&self) -> Result<(), String> {
        if self.aborted.load(Ordering::Acquire) {
            self.uses_after_abort.fetch_add(1, Ordering::Relaxed);
            return Err("use after ncclCommAbort".into());
        }
        Ok(())
    }
}

impl DeviceComm for HostComm {
    fn start(&self, call: DeviceCall) -> Result<(), String> {
        self.check_live()?;
        self.started.fetch_add(1, Ordering::Relaxed);
        let kind = match &call {
            DeviceCall::AllReduce { op, .. } => Kind::AllReduce(*op),
            DeviceCall::ReduceScatter { op, .. } => Kind::ReduceScatter(*op),
            DeviceCall::AllGather { .. } => Kind::AllGather,
            DeviceCall::Broadcast { root, .. } => Kind::Broadcast(*root),
        };
        let flat = call.input().clone();
        let mut state = self.state.lock().unwrap();
        let round = state.round;
        state.round += 1;
        let values = to_host(flat.clone(), "double").map_err(|e| e.to_string())?;
        if !self.hang {
            let mut shared = self.shared.lock().unwrap();
            let world = shared.world;
            if shared.rounds.len() <= round {
                shared.rounds.resize_with(round + 1, Round::default);
            }
            let r = &mut shared.rounds[round];
            r.deposits.resize(world, None);
            r.deposits[self.rank] = Some(values);
            if r.deposits.iter().all(Option::is_some) {
                let deposits: Vec<Vec<f32>> = r.deposits.iter().flatten().cloned().collect();
                let n = deposits[0].len();
                if let Some(d) = deposits.iter().find(|d| d.len() != n) {
                    return Err(format!(
                        "ncclInvalidUsage: counts differ ({} vs {n})",
                        d.len()
                    ));
                }
                r.results = Some(results(kind, &deposits, self.sum_only));
            }
        }
        state.pending = Some((round, flat));
        Ok(())
    }

    fn finish(&self) -> Result<Tensor<1>, String> {
        self.check_live()?;
        let mut state = self.state.lock().unwrap();
        let (round, flat) = state.pending.take().ok_or("nothing was started")?;
        let shared = self.shared.lock().unwrap();
        let values = shared
            .rounds
            .get(round)
            .and_then(|r| r.results.as_ref())
            .map(|results| results[self.rank].clone())
            .ok_or("the round has not completed")?;
        from_host(values, (&flat.device(), flat.dtype()), "double").map_err(|e| e.to_string())
    }

    fn poll(&self) -> Result<bool, String> {
        self.check_live()?;
        let shared = self.shared.lock().unwrap();
        if shared.aborted {
            return Err("ncclRemoteError: a peer aborted the communicator".into());
        }
        if shared.connected < shared.world {
            return Ok(false);
        }
        let state = self.state.lock().unwrap();
        Ok(match &state.pending {
            None => true,
            Some((round, _)) => shared
                .rounds
                .get(*round)
                .is_some_and(|r| r.results.is_some()),
        })
    }

    fn abort(&self) {
        // NCCL's abort of an aborted communicator is itself a use after free.
        self.check_live().ok();
        self.aborted.store(true, Ordering::Release);
        self.shared.lock().unwrap().aborted = true;
    }
}
