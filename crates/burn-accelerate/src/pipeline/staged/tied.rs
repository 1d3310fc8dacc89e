//! Parameters outside the blocks that several stages use (a tied embedding and output head): their gradients
//! summed over the stages, as Megatron keeps them in sync, and who trains each.

use std::collections::HashSet;

use burn::module::ParamId;
use burn::tensor::{DType, Tensor};

use crate::distributed::comm::ReduceOp;
use crate::distributed::stages::mesh::Stages;
use crate::distributed::tensor_comm::Reduction;
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;

/// Sums over the stages the gradients of the parameters outside the blocks (`rest`, the same list on every stage)
/// that more than one stage's passes reach (`held` on this stage): a tied embedding and output head then take
/// the same step on the first and the last stage. Which ones are shared is found at the first window's end (one
/// small all-reduce) and kept.
pub(super) fn sum_tied(
    stages: &Stages,
    grads: &mut GradientBuffer,
    rest: &[(ParamId, usize)],
    held: &HashSet<ParamId>,
) -> Result<()> {
    if rest.is_empty() {
        return Ok(());
    }
    let device = match grads.ids().first().and_then(|id| grads.flat(&[*id]).pop()) {
        Some(g) => g.device(),
        None => return Ok(()),
    };
    let shared = {
        let mut known = stages.tied.lock().unwrap_or_else(|e| e.into_inner());
        if known.is_none() {
            let uses: Vec<f32> = rest
                .iter()
                .map(|(id, _)| f32::from(u8::from(held.contains(id))))
                .collect();
            let uses = Tensor::<1>::from_floats(uses.as_slice(), &device);
            let counts = stages
                .comm
                .all_reduce(
                    uses,
                    Reduction::Op(ReduceOp::Sum),
                    "pipeline tied parameters",
                )?
                .wait()?
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| {
                    Error::other(format!(
                        "backward_batch: reading the tied parameters: {e:?}"
                    ))
                })?;
            // The first stage that trains each (where a save takes it from).
            let stage = stages.layout.stage as f32;
            let firsts: Vec<f32> = rest
                .iter()
                .map(|(id, _)| match held.contains(id) {
                    true => stage,
                    false => stages.layout.stages as f32,
                })
                .collect();
            let firsts = stages
                .comm
                .all_reduce(
                    Tensor::<1>::from_floats(firsts.as_slice(), &device),
                    Reduction::Op(ReduceOp::Min),
                    "pipeline parameter owners",
                )?
                .wait()?
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| Error::other(format!("backward_batch: reading the owners: {e:?}")))?;
            // Trained by some stage, never reached here: dropped after the step (see `Staged::after_step`).
            *stages
                .rest_elsewhere
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(
                rest.iter()
                    .zip(&firsts)
                    .filter(|((id, _), s)| {
                        (**s as usize) < stages.layout.stages && !held.contains(id)
                    })
                    .map(|((id, _), _)| *id)
                    .collect(),
            );
            *stages.rest_owner.lock().unwrap_or_else(|e| e.into_inner()) = Some(
                rest.iter()
                    .zip(firsts)
                    .filter(|(_, s)| (*s as usize) < stages.layout.stages)
                    .map(|((id, _), s)| (*id, s as usize))
                    .collect(),
            );
            // A stage between the first and the last holds these as placeholders: their lengths as they arrived.
            let placeholders = stages.rest_lens.lock().unwrap_or_else(|e| e.into_inner());
            *known = Some(
                rest.iter()
                    .zip(counts)
                    .filter(|(_, n)| *n > 1.5)
                    .map(|((id, len), _)| {
                        (*id, (*len).max(placeholders.get(id).copied().unwrap_or(0)))
                    })
                    .collect(),
            );
        }
        known.clone().unwrap_or_default()
    };
    if shared.is_empty() {
        return Ok(());
    }
    let parts: Vec<Tensor<1>> = shared
        .iter()
        .map(|(id, len)| match held.contains(id) {
            true => grads.flat(&[*id]).remove(0).cast(DType::F32),
            false => Tensor::zeros([*len], (&device, DType::F32)),
        })
        .collect();
    let summed = stages
        .comm
        .all_reduce(
            Tensor::cat(parts, 0),
            Reduction::Op(ReduceOp::Sum),
            "pipeline tied gradients",
        )?
        .wait()?;
    let mut start = 0;
    for (id, len) in &shared {
        if held.contains(id) {
            let dtype = grads.flat(&[*id]).remove(0).dtype();
            grads.set_flat(*id, summed.clone().slice(start..start + len).cast(dtype));
        }
        start += len;
    }
    Ok(())
}
