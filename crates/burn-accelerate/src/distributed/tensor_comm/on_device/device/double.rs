//! A device collective library in host memory: every rank of a group deposits its values, the last one
//! combines them — in f64 and from the last rank to the first, so it rounds differently from the host
//! all-reduce, as a real library does — and gives each rank its result (the whole, its part, the gathered parts
//! or the root's values, by the call); point-to-point messages queue per pair of ranks, in order, as NCCL's do; a
//! split forms a group per colour, as `ncclCommSplit`. A rank told to hang never deposits nor sends, so the
//! others time out and abort. Every call a communicator receives after it was aborted is counted (NCCL frees an
//! aborted communicator: such a call would use freed memory).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Device, Tensor};

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
    Reduce(ReduceOp, usize),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
}

/// What the double does wrong on purpose, for checks that must fail.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// None: a correct library.
    #[default]
    None,
    /// A mean that forgets the division by the number of ranks.
    SumOnly,
    /// NCCL's one-rank mean kernel (`oneRankReduce`): a grid of `min(32, ceil(bytes / 16 KiB))` blocks, each of
    /// `alignUp(n / blocks, 16 bytes)` elements, so that the last `n mod blocks` elements stay unwritten when
    /// `n / blocks` is already a whole number of 16-byte packs.
    OneRankMeanTail,
}

/// The elements NCCL's one-rank mean kernel writes of `n` elements of `bytes` each (see
/// [`Defect::OneRankMeanTail`]).
fn one_rank_mean_written(n: usize, bytes: usize) -> usize {
    let blocks = (n * bytes).div_ceil(16 << 10).clamp(1, 32);
    let per_pack = 16 / bytes;
    (blocks * (n / blocks).div_ceil(per_pack) * per_pack).min(n)
}

/// Every rank's result of `kind` over `deposits` (all of length `n`), combining in f64 from the last rank to the
/// first; `defect` breaks it as asked.
fn results(kind: Kind, deposits: &[Vec<f32>], defect: Defect) -> Vec<Vec<f32>> {
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
        let divisor = if op == ReduceOp::Mean && defect != Defect::SumOnly {
            world as f64
        } else {
            1.0
        };
        acc.truncate(n);
        let mut out: Vec<f32> = acc.iter().map(|s| (s / divisor) as f32).collect();
        if defect == Defect::OneRankMeanTail && world == 1 && op == ReduceOp::Mean {
            // The elements the kernel never reaches keep what the fresh output held.
            for value in &mut out[one_rank_mean_written(n, 4)..] {
                *value = f32::NAN;
            }
        }
        out
    };
    match kind {
        Kind::AllReduce(op) => vec![combine(op); world],
        Kind::Reduce(op, root) => (0..world)
            .map(|r| {
                if r == root {
                    combine(op)
                } else {
                    // NCCL leaves a non-root's output alone: what it held.
                    vec![f32::NAN; deposits[r].len()]
                }
            })
            .collect(),
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
    /// Messages in flight, by (from, to), in the order they were sent.
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
    aborted: bool,
}

/// Every group formed so far, by id.
type Groups = Mutex<HashMap<Vec<u8>, Arc<Mutex<Shared>>>>;

fn groups() -> &'static Groups {
    static GROUPS: OnceLock<Groups> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

/// The shared state of the group `id` of `world` ranks, made by its first member; one more member connected.
fn join(id: &[u8], world: usize) -> Arc<Mutex<Shared>> {
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
    shared
}

/// The library; `hang_rank` never takes part in collectives nor sends (a stuck peer), `fail_connect` cannot
/// connect, `defect` computes something wrong (for checks that must fail).
#[derive(Debug, Default, Clone)]
pub struct HostLibrary {
    pub hang_rank: Option<usize>,
    pub fail_connect: Option<usize>,
    pub defect: Defect,
    /// Calls made on a communicator after it was aborted, over every communicator of this library.
    pub uses_after_abort: Arc<AtomicUsize>,
    /// Calls started (collectives and point-to-point batches), over every communicator of this library.
    pub started: Arc<AtomicUsize>,
    /// Communicators split from others, over this library.
    pub splits: Arc<AtomicUsize>,
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
        Ok(Box::new(HostComm {
            shared: join(id, world),
            id: id.to_vec(),
            rank,
            library: self.clone(),
            state: Mutex::new(State::default()),
            aborted: AtomicBool::new(false),
        }))
    }
}

/// A call started and not yet finished.
#[derive(Debug)]
enum Started {
    /// A collective: its round, and its input (the output's device and dtype).
    Round(usize, Box<Tensor<1>>),
    /// A point-to-point batch: each receive's peer, length, device and dtype.
    Messages(Vec<(usize, usize, Device, DType)>),
}

#[derive(Debug, Default)]
struct State {
    round: usize,
    splits: usize,
    pending: Option<Started>,
}

pub struct HostComm {
    shared: Arc<Mutex<Shared>>,
    id: Vec<u8>,
    rank: usize,
    library: HostLibrary,
    state: Mutex<State>,
    aborted: AtomicBool,
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
            self.library
                .uses_after_abort
                .fetch_add(1, Ordering::Relaxed);
            return Err("use after ncclCommAbort".into());
        }
        Ok(())
    }

    fn hangs(&self) -> bool {
        self.library.hang_rank == Some(self.rank)
    }

    /// Posts every send of a batch; what to receive is kept for `poll` and `finish`.
    fn start_messages(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: &[crate::distributed::tensor_comm::Incoming],
    ) -> Result<Started, String> {
        if !self.hangs() {
            let values = sends
                .into_iter()
                .map(|(peer, flat)| Ok((peer, to_host(flat, "double").map_err(|e| e.to_string())?)))
                .collect::<Result<Vec<_>, String>>()?;
            let mut shared = self.shared.lock().unwrap();
            for (peer, values) in values {
                shared
                    .mail
                    .entry((self.rank, peer))
                    .or_default()
                    .push_back(values);
            }
        }
        Ok(Started::Messages(
            recvs
                .iter()
                .map(|r| (r.peer, r.len, r.device.clone(), r.dtype))
                .collect(),
        ))
    }

    /// Deposits a collective's values in its round; the last rank to deposit computes every rank's result.
    fn start_round(&self, kind: Kind, flat: Tensor<1>, round: usize) -> Result<Started, String> {
        let values = to_host(flat.clone(), "double").map_err(|e| e.to_string())?;
        if !self.hangs() {
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
                r.results = Some(results(kind, &deposits, self.library.defect));
            }
        }
        Ok(Started::Round(round, Box::new(flat)))
    }
}

impl DeviceComm for HostComm {
    fn start(&self, call: DeviceCall) -> Result<(), String> {
        self.check_live()?;
        self.library.started.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().unwrap();
        let started = match call {
            DeviceCall::SendRecv { sends, recvs } => self.start_messages(sends, &recvs)?,
            collective => {
                let kind = match &collective {
                    DeviceCall::AllReduce { op, .. } => Kind::AllReduce(*op),
                    DeviceCall::Reduce { op, root, .. } => Kind::Reduce(*op, *root),
                    DeviceCall::ReduceScatter { op, .. } => Kind::ReduceScatter(*op),
                    DeviceCall::AllGather { .. } => Kind::AllGather,
                    DeviceCall::Broadcast { root, .. } => Kind::Broadcast(*root),
                    DeviceCall::SendRecv { .. } => unreachable!("matched above"),
                };
                let flat = collective.input().ok_or("no input")?.clone();
                let round = state.round;
                state.round += 1;
                self.start_round(kind, flat, round)?
            }
        };
        state.pending = Some(started);
        Ok(())
    }

    fn finish(&self) -> Result<Vec<Tensor<1>>, String> {
        self.check_live()?;
        let mut state = self.state.lock().unwrap();
        let started = state.pending.take().ok_or("nothing was started")?;
        let mut shared = self.shared.lock().unwrap();
        match started {
            Started::Round(round, flat) => {
                let values = shared
                    .rounds
                    .get(round)
                    .and_then(|r| r.results.as_ref())
                    .map(|results| results[self.rank].clone())
                    .ok_or("the round has not completed")?;
                Ok(vec![
                    from_host(values, (&flat.device(), flat.dtype()), "double")
                        .map_err(|e| e.to_string())?,
                ])
            }
            Started::Messages(recvs) => recvs
                .into_iter()
                .map(|(peer, len, device, dtype)| {
                    let values = shared
                        .mail
                        .get_mut(&(peer, self.rank))
                        .and_then(VecDeque::pop_front)
                        .ok_or("a message has not arrived")?;
                    if values.len() != len {
                        return Err(format!(
                            "ncclInvalidUsage: {} values from rank {peer}, {len} expected",
                            values.len()
                        ));
                    }
                    from_host(values, (&device, dtype), "double").map_err(|e| e.to_string())
                })
                .collect(),
        }
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
            Some(Started::Round(round, _)) => shared
                .rounds
                .get(*round)
                .is_some_and(|r| r.results.is_some()),
            Some(Started::Messages(recvs)) => {
                let mut wanted: HashMap<usize, usize> = HashMap::new();
                for (peer, ..) in recvs {
                    *wanted.entry(*peer).or_default() += 1;
                }
                wanted.into_iter().all(|(peer, n)| {
                    shared
                        .mail
                        .get(&(peer, self.rank))
                        .is_some_and(|queue| queue.len() >= n)
                })
            }
        })
    }

    fn split(&self, color: usize, key: usize, world: usize) -> Result<Box<dyn DeviceComm>, String> {
        self.check_live()?;
        self.library.splits.fetch_add(1, Ordering::Relaxed);
        let n = {
            let mut state = self.state.lock().unwrap();
            state.splits += 1;
            state.splits
        };
        // The child's id: the parent's, which split of it, and the colour.
        let mut id = self.id.clone();
        id.extend_from_slice(&(n as u64).to_le_bytes());
        id.extend_from_slice(&(color as u64).to_le_bytes());
        Ok(Box::new(HostComm {
            shared: join(&id, world),
            id,
            rank: key,
            library: HostLibrary {
                // The child of a hanging rank hangs too; its other defects carry over.
                hang_rank: self.hangs().then_some(key),
                ..self.library.clone()
            },
            state: Mutex::new(State::default()),
            aborted: AtomicBool::new(false),
        }))
    }

    fn abort(&self) {
        // NCCL's abort of an aborted communicator is itself a use after free.
        self.check_live().ok();
        self.aborted.store(true, Ordering::Release);
        self.shared.lock().unwrap().aborted = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_rank_mean_kernel_misses_the_tail_the_first_gpu_run_saw() {
        // 2^20 + 3 f32 values: 32 blocks of 32768, the last 3 never written (as on the H100).
        assert_eq!(one_rank_mean_written((1 << 20) + 3, 4), 1 << 20);
        // A part of 2^18 + 1 values: the last one missed.
        assert_eq!(one_rank_mean_written((1 << 18) + 1, 4), 1 << 18);
        // Lengths that are a whole number of packs per block are written whole.
        assert_eq!(one_rank_mean_written(1 << 20, 4), 1 << 20);
        assert_eq!(one_rank_mean_written(7, 4), 7);
    }
}
