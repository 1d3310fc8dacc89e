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
        let group = sharded.group.clone();
        params.replace_from_own(id, dims, true, move |own| {
            let host = if own.shape().num_elements() == n {
                to_host(own, "parameter broadcast")?
            } else {
                // A placeholder (FULL_SHARD): nothing to reuse.
                vec![0.0; n]
            };
            let comm = Sharded::checked(
                &group,
                "sharded parameter broadcast from its owner",
                &[n, owner],
            )?;
            match comm.broadcast_buffer(ReduceBuffer::F32(host), owner)? {
                ReduceBuffer::F32(values) => {
                    from_host(values, (&device, dtype), "parameter broadcast")
                }
                other => Err(Error::InvalidArgument(format!(
                    "parameter broadcast: the engine returned {} values",
                    other.kind()
                ))),
            }
        });
    }
    // The smaller ones, all-gathered in rounds.
    for round in sharded.rounds(&order, &owners) {
        let counts: Vec<usize> = round
            .iter()
            .map(|group| group.iter().map(|i| order[*i].1).sum())
            .collect();
        let mut part = Vec::new();
        for &i in &round[me] {
            let id = order[i].0;
            let flat = params.get(id).ok_or_else(|| missing(id))?.value();
            if part.is_empty() {
                part = to_host(flat, "parameter all-gather")?;
            } else {
                part.extend(to_host(flat, "parameter all-gather")?);
            }
        }
        let comm = Sharded::checked(&sharded.group, "sharded parameter all-gather", &counts)?;
        let all = comm.all_gather_parts(ReduceBuffer::F32(part), &counts)?;
        let ReduceBuffer::F32(mut all) = all else {
            return Err(Error::InvalidArgument(format!(
                "parameter all-gather: the engine returned {} values",
                all.kind()
            )));
        };
        let alone = round.iter().map(Vec::len).sum::<usize>() == 1;
        let mut start = 0;
        for (q, group) in round.iter().enumerate() {
            for &i in group {
                let (id, n) = order[i];
                if q != me {
                    let entry = params.get(id).ok_or_else(|| missing(id))?;
                    let (device, dtype, dims) =
                        (entry.device.clone(), entry.dtype, sharded.whole_dims(entry));
                    // One parameter: the gathered buffer is its value.
                    let values = if alone {
                        std::mem::take(&mut all)
                    } else {
                        all[start..start + n].to_vec()
                    };
                    let flat = from_host(values, (&device, dtype), "parameter all-gather")?;
                    params.replace(id, flat, dims, true);
                }
                start += n;
            }
        }
    }
    Ok(())
}
