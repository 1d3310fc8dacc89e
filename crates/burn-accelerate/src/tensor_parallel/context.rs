//! The tensor-parallel group a rank's modules talk over ([`TpContext`]): installed for the thread an
//! [`Accelerator`](crate::Accelerator) is created on (each in-process rank is a thread of its own), and found by
//! the tensor-parallel modules in their forward pass and by the backward pass at each region's cut.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};

use burn::tensor::Tensor;

use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::{Reduction, TensorComm};
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
        let shape = t.shape();
        let n = shape.num_elements();
        let flat = t.reshape([n]);
        let summed = self
            .comm
            .all_reduce(flat, Reduction::Op(ReduceOp::Sum), operation)?
            .wait()?;
        Ok(summed.reshape(shape))
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
        let n = part.shape().num_elements();
        // Gathered flat in rank order: each rank's part whole, so the split dimension goes first and back.
        let moved = part.swap_dims(0, dim);
        let moved_dims = moved.dims();
        let flat = moved.reshape([n]);
        let counts = vec![n; self.size];
        let all = self.comm.all_gather(flat, &counts, operation)?.wait()?;
        let mut whole = moved_dims;
        whole[0] *= self.size;
        Ok(all.reshape(whole).swap_dims(0, dim))
    }
}
