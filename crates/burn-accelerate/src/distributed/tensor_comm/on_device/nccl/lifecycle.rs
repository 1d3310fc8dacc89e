//! The GPU kit's checks of NCCL's communicator lifecycle (`burn-accelerate test --nccl-lifecycle`): a split
//! from a non-blocking communicator, and a group call that fails half way.

use super::*;

/// The GPU kit's checks of NCCL's communicator lifecycle on `group`'s ranks (one GPU each; one rank will do):
/// `split`, a sub-group split from a fresh communicator (the parent polled, then the child, within one budget),
/// its all-reduce, then both finalized and destroyed; `failing-group`, a batch of messages whose second call NCCL
/// refuses, after which the communicator is aborted and the next call refused.
///
/// # Errors
/// A communicator cannot be made at all (no NCCL, no CUDA device).
pub(crate) fn lifecycle_check(
    group: &Arc<crate::distributed::ProcessGroup>,
    timeout: std::time::Duration,
) -> crate::error::Result<Vec<super::super::LifecycleCheck>> {
    use super::super::DeviceEngine;
    use super::super::device::DeviceCollectives;
    let device = group.device().clone();
    let world = group.num_processes();
    let mut checks = Vec::new();

    let parent = DeviceCollectives::connect(group.clone(), &Nccl::new(&device), timeout)?;
    let sub = Arc::new(group.split(0, group.process_index())?);
    let split = parent.split_for(sub).and_then(|child| {
        let sum = child
            .all_reduce(Tensor::<1>::ones([5], &device), ReduceOp::Sum)
            .ok_or_else(|| crate::error::Error::other("no all-reduce"))??
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| crate::error::Error::other(format!("{e:?}")))?;
        Ok((sum, child.close()))
    });
    let handle = match SPLIT_HANDLE_AT_RETURN.load(std::sync::atomic::Ordering::Relaxed) {
        1 => "at ncclCommSplit's return",
        2 => "only when the parent's poll completed (non-blocking split)",
        _ => "never (no split ran)",
    };
    let closed = parent.close();
    let check = |name, passed, seen| super::super::LifecycleCheck { name, passed, seen };
    checks.push(match split {
        Ok((sum, child_closed)) => {
            let right = sum.iter().all(|v| *v == world as f32);
            let ended = child_closed.is_ok() && closed.is_ok();
            check(
                "split",
                right && ended,
                format!(
                    "the child's handle was written {handle}; its all-reduce gave {sum:?} (expected {world} each); \
                     finalize and destroy: child {child_closed:?}, parent {closed:?}"
                ),
            )
        }
        Err(e) => check("split", false, format!("the split failed: {e}; the handle was written {handle}")),
    });

    let comm =
        DeviceCollectives::connect(group.clone(), &Nccl::refusing_call(&device, 1), timeout)?;
    let me = group.process_index();
    let part = || Tensor::<1>::ones([4], &device);
    let incoming = || crate::distributed::tensor_comm::Incoming {
        peer: me,
        len: 4,
        device: device.clone(),
        dtype: part().dtype(),
    };
    let refused = comm
        .send_recv(
            vec![(me, part()), (me, part())],
            vec![incoming(), incoming()],
        )
        .ok_or_else(|| crate::error::Error::other("no send/recv"))?
        .map(|_| ());
    let next = comm
        .all_reduce(part(), ReduceOp::Sum)
        .ok_or_else(|| crate::error::Error::other("no all-reduce"))?
        .map(|_| ());
    checks.push(match (refused, next) {
        (Err(refused), Err(next)) => check(
            "failing-group",
            next.to_string().contains("aborted"),
            format!("the batch was refused ({refused}); the next call was refused ({next})"),
        ),
        (refused, next) => check(
            "failing-group",
            false,
            format!(
                "the refused batch gave {refused:?} and the next call {next:?}: both must fail"
            ),
        ),
    });
    Ok(checks)
}
