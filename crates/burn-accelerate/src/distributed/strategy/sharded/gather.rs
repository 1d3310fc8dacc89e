//! `gather`: the parameters other ranks own, fetched into a sharded rank's parameter table (large ones
//! broadcast from their owner, the others all-gathered in rounds), for `unshard` and `SHARD_GRAD_OP`'s share
//! after the step.

use super::*;

/// Gives `params` every trainable parameter owned by another rank, in its whole shape, with that rank's value
/// (large ones broadcast from their owner, the others all-gathered in rounds); the parameters in `kept` are left
/// as they are (placeholders stay placeholders). Every rank of the shard group runs the same collectives,
/// whatever it holds.
pub(super) fn gather(
    sharded: &Sharded,
    params: &mut ParamTable,
    kept: &HashSet<ParamId>,
) -> Result<()> {
    let (me, world) = (sharded.shard_rank(), sharded.world());
    sharded.check_world("hybrid sharded parameter gather", world)?;
    if world < 2 {
        return Ok(());
    }
    let mut order = sharded.whole_params(params);
    order.retain(|(id, _)| !kept.contains(id));
    let owners = sharded.owners(&order);
    let missing = |id: ParamId| {
        Error::InvalidArgument(format!(
            "parameter all-gather: parameter {id} is missing from the model"
        ))
    };
    // Large parameters, each broadcast from its owner into the buffer this rank holds it in (moved out of the
    // model when the table is applied: nothing copied when the model alone holds it; a placeholder's rank
    // receives into a new one). The table runs these after the rounds below, in visiting order.
    let large = sharded.large(&order);
    for &i in &large {
        let (id, n) = order[i];
        let owner = owners[i];
        let entry = params.get(id).ok_or_else(|| missing(id))?;
        let (device, dtype, dims) = (entry.device.clone(), entry.dtype, sharded.whole_dims(entry));
        let comm = sharded.shards.clone();
        params.replace_from_own(id, dims, true, move |own| {
            let flat = if own.shape().num_elements() == n {
                own
            } else {
                // A placeholder (FULL_SHARD): nothing to reuse.
                Tensor::zeros([n], (&device, dtype))
            };
            comm.broadcast(flat, owner, "sharded parameter broadcast from its owner")?
                .wait()
        });
    }
    // The smaller ones, all-gathered in rounds.
    for round in sharded.rounds(&order, &owners) {
        let counts: Vec<usize> = round
            .iter()
            .map(|group| group.iter().map(|i| order[*i].1).sum())
            .collect();
        // Every rank sends in the dtype of the whole round (the same on every rank, whatever it holds).
        let mut placement = None;
        let mut dtypes = Vec::new();
        for &i in round.iter().flatten() {
            let entry = params.get(order[i].0).ok_or_else(|| missing(order[i].0))?;
            placement.get_or_insert_with(|| entry.device.clone());
            dtypes.push(entry.dtype);
        }
        let (Some(device), Some(dtype)) = (placement, bucket::common_dtype(dtypes)) else {
            continue;
        };
        let mut part = Vec::with_capacity(round[me].len());
        for &i in &round[me] {
            let id = order[i].0;
            let flat = params.get(id).ok_or_else(|| missing(id))?.value();
            part.push(bucket::in_dtype(flat, dtype));
        }
        let all = sharded
            .shards
            .all_gather(
                bucket::concat(part, (&device, dtype)),
                &counts,
                "sharded parameter all-gather",
            )?
            .wait()?;
        let alone = round.iter().map(Vec::len).sum::<usize>() == 1;
        let mut start = 0;
        for (q, group) in round.iter().enumerate() {
            for &i in group {
                let (id, n) = order[i];
                if q != me {
                    let entry = params.get(id).ok_or_else(|| missing(id))?;
                    let (own, dims) = (entry.dtype, sharded.whole_dims(entry));
                    // One parameter: the gathered buffer is its value.
                    let flat = if alone {
                        all.clone()
                    } else {
                        all.clone().slice(start..start + n)
                    };
                    params.replace(id, bucket::in_dtype(flat, own), dims, true);
                }
                start += n;
            }
        }
    }
    Ok(())
}
