//! A device collective library in host memory: every rank of a group deposits its values, the last one
//! combines them — in f64 and from the last rank to the first, so it rounds differently from the host
//! all-reduce, as a real library does — and gives each rank its result (the whole, its part, the gathered parts
//! or the root's values, by the call); point-to-point messages queue per pair of ranks, in order, as NCCL's do; a
//! split forms a group per colour, as `ncclCommSplit`. A rank told to hang never deposits nor sends, so the
//! others time out and abort. Every call a communicator receives after it was aborted is counted (NCCL frees an
//! aborted communicator: such a call would use freed memory).
//!
//! It behaves as NCCL's non-blocking communicators do where the code could get them wrong: a split child has no
//! handle (a null `ncclComm_t`) until its parent's poll reports the split done, and the parent takes no other
//! call meanwhile; a normal end is a finalize, polled, then a destroy; a batch of messages can be made to fail at
//! one of its calls, as `ncclSend` does on a bad argument, the sends before it going out (a partial batch) and its
//! buffers kept until the abort. What each communicator went through is written in the library's
//! [`lifecycle`](HostLibrary::lifecycle).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Device, Tensor};

use super::{DeviceCall, DeviceComm, DeviceCommLibrary};
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::on_device::{from_host, to_host};

#[derive(Debug, Default)]
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

#[derive(Debug, Default)]
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
/// connect, `fail_split` cannot split, `fail_message` `(rank, k)` refuses the `k`-th call (sends first, then
/// receives, from 0) of that rank's next batch of messages, `defect` computes something wrong (for checks that
/// must fail).
#[derive(Debug, Default, Clone)]
pub struct HostLibrary {
    pub hang_rank: Option<usize>,
    pub fail_connect: Option<usize>,
    pub fail_split: Option<usize>,
    pub fail_message: Option<(usize, usize)>,
    pub defect: Defect,
    /// What each communicator went through, in order: `(its group's id, its rank, what)`, `what` one of
    /// `finalize`, `destroy`, `abort`, `released` (the buffers of a batch that failed), `destroy before its
    /// finalize completed` (a misuse).
    pub lifecycle: Lifecycle,
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
        let handle = OnceLock::new();
        let _ = handle.set(join(id, world));
        Ok(Box::new(HostComm {
            handle: Arc::new(handle),
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

/// What communicators went through, in order: `(their group's id, their rank, what)`.
pub type Lifecycle = Arc<Mutex<Vec<(Vec<u8>, usize, &'static str)>>>;

/// Where a split child's group lands once its parent's poll completes the split (NCCL's `*newcomm`).
type Handle = Arc<OnceLock<Arc<Mutex<Shared>>>>;

/// The buffers of a batch that failed part way, kept until the abort; dropping them says so in the lifecycle.
struct Kept {
    _buffers: Vec<Tensor<1>>,
    lifecycle: Lifecycle,
    id: Vec<u8>,
    rank: usize,
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.lifecycle
            .lock()
            .unwrap()
            .push((self.id.clone(), self.rank, "released"));
    }
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kept")
    }
}

#[derive(Debug, Default)]
struct State {
    round: usize,
    splits: usize,
    pending: Option<Started>,
    /// A split not yet completed by this communicator's poll: the child's handle, its group's id and size.
    splitting: Option<(Handle, Vec<u8>, usize)>,
    /// `finalize` was called (and completes at the next poll).
    finalized: bool,
    /// A failed batch's buffers, until the abort.
    kept: Option<Kept>,
}

pub struct HostComm {
    /// The group this communicator belongs to: empty for a split child until its parent's poll completes the
    /// split, as NCCL leaves `*newcomm` unwritten until then.
    handle: Handle,
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

    /// The group, once this communicator has one: a child polled or used before its parent completed the split
    /// is a null communicator to NCCL.
    fn shared(&self) -> Result<&Arc<Mutex<Shared>>, String> {
        self.handle.get().ok_or_else(|| {
            "ncclInvalidArgument: a NULL communicator (ncclCommSplit writes it once the parent communicator's \
             poll reports the split done)"
                .to_string()
        })
    }

    fn note(&self, what: &'static str) {
        self.library
            .lifecycle
            .lock()
            .unwrap()
            .push((self.id.clone(), self.rank, what));
    }

    /// Posts every send of a batch; what to receive is kept for `poll` and `finish`.
    fn start_messages(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: &[crate::distributed::tensor_comm::Incoming],
    ) -> Result<Started, String> {
        let failing = match self.library.fail_message {
            Some((rank, k)) if rank == self.rank => Some(k),
            _ => None,
        };
        if let Some(k) = failing.filter(|k| *k < sends.len() + recvs.len()) {
            // The calls before the `k`-th were posted (the sends among them go out: a partial batch); the rest
            // never is. Every buffer stays with the communicator until it is aborted.
            let buffers: Vec<Tensor<1>> = sends.iter().map(|(_, t)| t.clone()).collect();
            let mut shared = self.shared()?.lock().unwrap();
            for (peer, flat) in sends.iter().take(k) {
                let values = to_host(flat.clone(), "double").map_err(|e| e.to_string())?;
                shared
                    .mail
                    .entry((self.rank, *peer))
                    .or_default()
                    .push_back(values);
            }
            drop(shared);
            self.state.lock().unwrap().kept = Some(Kept {
                _buffers: buffers,
                lifecycle: self.library.lifecycle.clone(),
                id: self.id.clone(),
                rank: self.rank,
            });
            let what = match sends.get(k) {
                Some((peer, t)) => format!("ncclSend of {} values to rank {peer}", t.dims()[0]),
                None => {
                    let r = &recvs[k - sends.len()];
                    format!("ncclRecv of {} values from rank {}", r.len, r.peer)
                }
            };
            return Err(format!(
                "ncclInvalidArgument: {what} (call {k} of the batch)"
            ));
        }
        if !self.hangs() {
            let values = sends
                .into_iter()
                .map(|(peer, flat)| Ok((peer, to_host(flat, "double").map_err(|e| e.to_string())?)))
                .collect::<Result<Vec<_>, String>>()?;
            let mut shared = self.shared()?.lock().unwrap();
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
            let mut shared = self.shared()?.lock().unwrap();
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
        self.shared()?;
        self.library.started.fetch_add(1, Ordering::Relaxed);
        if self.state.lock().unwrap().splitting.is_some() {
            return Err(
                "ncclInvalidUsage: a call on a communicator whose split is still in progress"
                    .into(),
            );
        }
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
                let round = {
                    let mut state = self.state.lock().unwrap();
                    state.round += 1;
                    state.round - 1
                };
                self.start_round(kind, flat, round)?
            }
        };
        self.state.lock().unwrap().pending = Some(started);
        Ok(())
    }

    fn finish(&self) -> Result<Vec<Tensor<1>>, String> {
        self.check_live()?;
        let mut state = self.state.lock().unwrap();
        let started = state.pending.take().ok_or("nothing was started")?;
        let mut shared = self.shared()?.lock().unwrap();
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
        let shared = self.shared()?.lock().unwrap();
        if shared.aborted {
            return Err("ncclRemoteError: a peer aborted the communicator".into());
        }
        if shared.connected < shared.world {
            return Ok(false);
        }
        drop(shared);
        let mut state = self.state.lock().unwrap();
        // A split is this communicator's operation: it completes here, where NCCL writes the child's handle.
        if let Some((child, id, world)) = state.splitting.take() {
            let _ = child.set(join(&id, world));
            return Ok(true);
        }
        if state.finalized {
            return Ok(true);
        }
        let shared = self.shared()?.lock().unwrap();
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
        self.shared()?;
        if self.library.fail_split == Some(self.rank) {
            return Err("ncclInternalError: the split could not be set up".into());
        }
        self.library.splits.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().unwrap();
        state.splits += 1;
        // The child's id: the parent's, which split of it, and the colour.
        let mut id = self.id.clone();
        id.extend_from_slice(&(state.splits as u64).to_le_bytes());
        id.extend_from_slice(&(color as u64).to_le_bytes());
        // No group yet: the parent's next poll completes the split.
        let handle: Handle = Arc::new(OnceLock::new());
        state.splitting = Some((handle.clone(), id.clone(), world));
        Ok(Box::new(HostComm {
            handle,
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

    fn finalize(&self) -> Result<(), String> {
        self.check_live()?;
        self.shared()?;
        self.note("finalize");
        self.state.lock().unwrap().finalized = true;
        Ok(())
    }

    fn destroy(&self) -> Result<(), String> {
        self.check_live()?;
        let finalized = self.state.lock().unwrap().finalized;
        self.note(if finalized {
            "destroy"
        } else {
            "destroy before its finalize completed"
        });
        // Freed: any later call is a use after free, as after an abort.
        self.aborted.store(true, Ordering::Release);
        Ok(())
    }

    fn abort(&self) {
        // NCCL's abort of an aborted communicator is itself a use after free.
        self.check_live().ok();
        self.note("abort");
        self.aborted.store(true, Ordering::Release);
        if let Ok(shared) = self.shared() {
            shared.lock().unwrap().aborted = true;
        }
        // Only now may the buffers of a batch that failed part way go.
        let kept = self.state.lock().unwrap().kept.take();
        drop(kept);
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
