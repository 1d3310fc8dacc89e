//! The tensor-parallel group a rank's modules talk over ([`TpContext`]): installed for the thread an
//! [`Accelerator`](crate::Accelerator) is created on (each in-process rank is a thread of its own), and found by
//! the tensor-parallel modules in their forward pass and by the backward pass at each region's cut.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};

use burn::tensor::Tensor;

use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::TensorComm;
use crate::distributed::tensor_comm::along;
use crate::error::Result;

/// This rank's tensor-parallel group: its index in it, its size, and the collectives over it.
#[derive(Debug)]
pub(crate) struct TpContext {
    /// This rank's tensor-parallel index (the mesh's `tp` coordinate).
    pub rank: usize,
    /// The ranks of the group (`tp_size`).
    pub size: usize,
    /// Collectives over the group: the device path where there is one, host memory otherwise.
    pub comm: Arc<dyn TensorComm>,
    /// Its data-parallel index: dropout masks differ between data-parallel ranks.
    pub dp_index: usize,
    /// Sequence parallelism: between the regions each rank holds its part of the sequence.
    pub sequence: bool,
}

thread_local! {
    /// `None` until an accelerator is created on this thread; then its group, or `Some(None)` without one.
    static CURRENT: RefCell<Option<Option<Arc<TpContext>>>> = const { RefCell::new(None) };
}

/// Every context of this process, for a thread that has none installed (a process of one rank that runs its
/// forward pass on a thread of its own).
static LIVE: Mutex<Vec<Weak<TpContext>>> = Mutex::new(Vec::new());

/// Makes `context` the one this thread's tensor-parallel modules use (`None`: every module whole, as on one
/// rank).
pub(crate) fn install(context: Option<Arc<TpContext>>) {
    if let Some(c) = &context {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        if !live.iter().any(|w| w.as_ptr() == Arc::as_ptr(c)) {
            live.push(Arc::downgrade(c));
        }
    }
    CURRENT.with(|slot| *slot.borrow_mut() = Some(context));
}

/// The context of this thread: the one its accelerator installed; on a thread that created none, the only one
/// alive in the process (a process of one rank).
pub(crate) fn current() -> Option<Arc<TpContext>> {
    if let Some(installed) = CURRENT.with(|slot| slot.borrow().clone()) {
        return installed;
    }
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let mut alive = live.iter().filter_map(Weak::upgrade);
    match (alive.next(), alive.next()) {
        (Some(only), None) => Some(only),
        _ => None,
    }
}

/// The tensor-parallel rank and size this thread's modules run with: `(0, 1)` without a group.
pub fn tp_rank_and_size() -> (usize, usize) {
    current().map_or((0, 1), |c| (c.rank, c.size))
}

impl TpContext {
    /// `t` summed over the group, in its shape, dtype and device.
    ///
    /// # Errors
    /// The collective's (a timeout, a peer that failed).
    pub fn all_reduce_sum<const D: usize>(
        &self,
        t: Tensor<D>,
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        self.all_reduce(t, ReduceOp::Sum, operation)
    }

    /// `t` combined element-wise by `op` over the group, in its shape, dtype and device.
    ///
    /// # Errors
    /// The collective's.
    pub fn all_reduce<const D: usize>(
        &self,
        t: Tensor<D>,
        op: ReduceOp,
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        along::all_reduce(self.comm.as_ref(), t, op, operation)
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

    /// Every rank's `part` (rank `r`'s `rows[r]` long along `dim`, the other dimensions alike) concatenated
    /// along `dim`, in rank order.
    ///
    /// # Errors
    /// The collective's.
    pub fn all_gather_rows<const D: usize>(
        &self,
        part: Tensor<D>,
        dim: usize,
        rows: &[usize],
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        along::all_gather_rows(self.comm.as_ref(), part, dim, rows, operation)
    }

    /// `whole` summed over the group, this rank's rows `rows[rank]` of it along `dim` only (the rows before
    /// it belong to the ranks before).
    ///
    /// # Errors
    /// The collective's.
    pub fn reduce_scatter_rows<const D: usize>(
        &self,
        whole: Tensor<D>,
        dim: usize,
        rows: &[usize],
        operation: &'static str,
    ) -> Result<Tensor<D>> {
        along::reduce_scatter_rows(self.comm.as_ref(), whole, dim, rows, operation)
    }
}

/// How `len` positions split over `ranks`: the first `len % ranks` ranks one more than the rest.
pub(crate) fn split_rows(len: usize, ranks: usize) -> Vec<usize> {
    let ranks = ranks.max(1);
    (0..ranks)
        .map(|r| len / ranks + usize::from(r < len % ranks))
        .collect()
}
