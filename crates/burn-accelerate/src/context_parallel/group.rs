//! The context group a rank's attention talks over ([`CpContext`]), installed for the thread an
//! [`Accelerator`](crate::Accelerator) is created on, and what the attention counts ([`ContextStats`]).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use burn::tensor::Tensor;

use super::split::ContextSplit;
use crate::config::ContextAttention;
use crate::distributed::tensor_comm::{TensorComm, along};
use crate::error::Result;

/// This rank's context group: its index in it, its size, the collectives over it, and how its attention runs.
#[derive(Debug)]
pub(crate) struct CpContext {
    /// This rank's context index (the mesh's `cp` coordinate).
    pub rank: usize,
    /// The ranks of the group (`cp_size`).
    pub size: usize,
    /// Collectives over the group: the device path where there is one, host memory otherwise.
    pub comm: Arc<dyn TensorComm>,
    /// All-gather or ring.
    pub mode: ContextAttention,
    /// Head-tail balanced chunks.
    pub balanced: bool,
}

impl CpContext {
    /// The split of a sequence of which this rank holds `local` positions.
    pub fn split_of_local(&self, local: usize) -> Result<ContextSplit> {
        ContextSplit::new(local * self.size, self.rank, self.size, self.balanced)
    }

    /// Every rank's `part` (the same shape on each) concatenated along `dim`, in rank order.
    ///
    /// # Errors
    /// The collective's.
    pub fn all_gather<const D: usize>(
        &self,
        part: Tensor<D>,
        dim: usize,
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        along::all_gather(self.comm.as_ref(), part, dim, operation)
    }

    /// `whole` summed over the group, this rank's equal share of it along `dim`.
    ///
    /// # Errors
    /// The collective's.
    pub fn reduce_scatter<const D: usize>(
        &self,
        whole: Tensor<D>,
        dim: usize,
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        let rows = vec![whole.dims()[dim] / self.size; self.size];
        along::reduce_scatter_rows(self.comm.as_ref(), whole, dim, &rows, operation)
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<CpContext>>> = const { RefCell::new(None) };
    static STATS: Cell<ContextStats> = const { Cell::new(ContextStats::ZERO) };
    /// Whether this thread's accelerator has a context group and no attention has gone through it yet.
    static UNROUTED: Cell<bool> = const { Cell::new(false) };
}

/// Makes `context` the one this thread's attention uses (`None`: every sequence whole, as on one rank).
pub(crate) fn install(context: Option<Arc<CpContext>>) {
    UNROUTED.with(|u| u.set(context.is_some()));
    let check: crate::graph_cut::Check = unrouted_attention;
    crate::graph_cut::set_backward_check(context.is_some().then_some(check));
    CURRENT.with(|slot| *slot.borrow_mut() = context);
}

/// The context group of this thread, where it has more than one rank.
pub(crate) fn active() -> Option<Arc<CpContext>> {
    CURRENT.with(|slot| slot.borrow().clone())
}

/// An attention went through [`attention`](super::attention) on this thread.
pub(crate) fn routed() {
    UNROUTED.with(|u| u.set(false));
}

/// Before a backward pass: a context group's forward pass that ran no attention through the building block
/// attended (if at all) to this rank's positions alone.
fn unrouted_attention() -> Option<String> {
    UNROUTED.with(Cell::get).then(|| {
        "context parallelism: the forward pass ran no attention through `context_parallel::attention` (nor a \
         `ParallelTransformerLayer::forward_causal`), so each rank attended only to its own slice of the sequence: \
         route the model's attention through it, or set cp_size 1"
            .to_string()
    })
}

/// The context-parallel rank and size this thread's attention runs with: `(0, 1)` without a group.
pub fn cp_rank_and_size() -> (usize, usize) {
    active().map_or((0, 1), |c| (c.rank, c.size))
}

/// What this thread's context-parallel attention computed and sent since the last [`reset_stats`]: counted as it
/// runs, not timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextStats {
    /// Attention score elements computed in forward passes (query × key pairs of every head and sequence; blocks
    /// a causal mask hides entirely are not computed by the ring).
    pub score_elements: u64,
    /// Bytes this rank sent around the ring (keys and values forward; keys, values and their gradients back).
    pub ring_bytes_sent: u64,
    /// Attention calls through [`attention`](super::attention).
    pub attention_calls: u64,
}

impl ContextStats {
    const ZERO: Self = Self {
        score_elements: 0,
        ring_bytes_sent: 0,
        attention_calls: 0,
    };
}

/// This thread's [`ContextStats`] so far.
pub fn stats() -> ContextStats {
    STATS.with(Cell::get)
}

/// Sets this thread's [`ContextStats`] back to zero.
pub fn reset_stats() {
    STATS.with(|s| s.set(ContextStats::ZERO));
}

/// Adds to this thread's counters.
pub(crate) fn count(scores: u64, bytes: u64, calls: u64) {
    STATS.with(|s| {
        let mut v = s.get();
        v.score_elements += scores;
        v.ring_bytes_sent += bytes;
        v.attention_calls += calls;
        s.set(v);
    });
}
