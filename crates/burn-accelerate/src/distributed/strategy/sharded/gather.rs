//! `gather`: every rank's slices of the parameters joined into whole values in a sharded rank's parameter table,
//! a bucket at a time, for `unshard` and `SHARD_GRAD_OP`'s share after the step; started and finished apart when a
//! block-wise pass prefetches the next block ([`start_gather`]).

use super::exchange::Gathering;
use super::*;

/// Gives `params` every trainable parameter whole, joined from every rank's slices (bucket by bucket, one flat
/// all-gather each); the parameters in `kept` are left as they are. Every rank of the shard group runs the same
/// collectives, whatever it holds.
pub(super) fn gather(
    sharded: &Sharded,
    params: &mut ParamTable,
    kept: &HashSet<ParamId>,
) -> Result<()> {
    start_gather(sharded, params, kept, None)?.finish(params)
}

/// A parameter a bucket gathers: its id, whole shape and own dtype.
type Member = (ParamId, Vec<usize>, DType);

/// A gather started: every bucket's all-gather issued, none waited for.
pub(crate) struct StartedGather {
    buckets: Vec<(Vec<Member>, Gathering)>,
}

impl StartedGather {
    /// Waits for every bucket's all-gather and gives `params` the whole values.
    ///
    /// # Errors
    /// A failed all-gather (a rank died, a timeout).
    pub fn finish(self, params: &mut ParamTable) -> Result<()> {
        for (members, gathering) in self.buckets {
            for ((id, dims, dtype), whole) in members.into_iter().zip(gathering.finish()?) {
                params.replace(id, bucket::in_dtype(whole, dtype), dims, true);
            }
        }
        Ok(())
    }
}

/// Starts [`gather`]: issues every bucket's all-gather (the collectives run while the caller computes) and returns
/// what finishes it. With `dtype`, the slices are sent and the whole values given in it (FSDP2's `param_dtype`);
/// otherwise each in its own.
pub(super) fn start_gather(
    sharded: &Sharded,
    params: &ParamTable,
    kept: &HashSet<ParamId>,
    dtype: Option<DType>,
) -> Result<StartedGather> {
    let world = sharded.world();
    sharded.check_world("hybrid sharded parameter gather", world)?;
    if world < 2 {
        return Ok(StartedGather {
            buckets: Vec::new(),
        });
    }
    let mut order = sharded.whole_params(params);
    order.retain(|(id, _)| !kept.contains(id));
    let splits = sharded.slicings_for(&order);
    let missing = |id: ParamId| {
        Error::InvalidArgument(format!(
            "parameter all-gather: parameter {id} is missing from the model"
        ))
    };
    let (cap, alone) = sharded.bucket_limits();
    let mut buckets = Vec::new();
    for members in exchange::buckets(&splits, cap, alone) {
        // Every rank sends in the dtype of the whole bucket (the same on every rank, whatever it holds).
        let mut placement = None;
        let mut locals = Vec::with_capacity(members.len());
        let mut own = Vec::with_capacity(members.len());
        for &i in &members {
            let id = order[i].0;
            let entry = params.get(id).ok_or_else(|| missing(id))?;
            placement.get_or_insert_with(|| entry.device.clone());
            // An adopted parameter owned whole whose shape the strategy has not seen keeps the one it has here.
            let dims = if sharded.slicing_of(id).is_some() {
                splits[i].dims().to_vec()
            } else {
                entry.dims.clone()
            };
            own.push((id, dims, dtype.unwrap_or(entry.dtype)));
            locals.push(sharded.local_value(entry, &splits[i]));
        }
        let (Some(device), Some(dtype)) = (
            placement,
            bucket::common_dtype(own.iter().map(|(_, _, dtype)| *dtype)),
        ) else {
            continue;
        };
        let bucket_splits: Vec<&Slicing> = members.iter().map(|&i| &splits[i]).collect();
        let gathering = exchange::start_all_gather(
            sharded.shards.as_ref(),
            &bucket_splits,
            locals,
            "sharded parameter all-gather",
            (&device, dtype),
        )?;
        buckets.push((own, gathering));
    }
    Ok(StartedGather { buckets })
}
