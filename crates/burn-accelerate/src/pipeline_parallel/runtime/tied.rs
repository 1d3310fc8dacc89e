//! Parameters outside the blocks that several stages use (a tied embedding and output head): their gradients
//! summed over the stages, as Megatron keeps them in sync, and who trains each.

use std::collections::HashSet;

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};

use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::Reduction;
use crate::error::{Error, Result};
use crate::grad::GradientBuffer;
use crate::pipeline_parallel::Stages;

/// Sums over the stages the gradients of the parameters outside the blocks (`rest`, the same list on every stage)
/// that more than one stage's passes reach (`held` on this rank): a tied embedding and output head then take the
/// same step on the first and the last stage. Which stage reaches which is found at the first window's end (one
/// small all-reduce over every rank of the run, so that the replicas of a stage agree: the union of what their
/// passes reached) and kept. Every rank takes part, whether or not it holds any gradient (a stage whose blocks are
/// all frozen holds none): `device` is where its zeros live.
pub(super) fn sum_tied(
    stages: &Stages,
    grads: &mut GradientBuffer,
    rest: &[(ParamId, usize)],
    held: &HashSet<ParamId>,
    device: &Device,
) -> Result<()> {
    let shared = {
        let mut known = stages.tied.lock().unwrap_or_else(|e| e.into_inner());
        if known.is_none() {
            *known = Some(find_uses(stages, rest, held, device)?);
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
            false => Tensor::zeros([*len], (device, DType::F32)),
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

/// Which stages' passes reach each parameter of `rest`: every rank marks its stage's row with what it `held`,
/// and one all-reduce (max) over the whole run gives every rank every stage's union over its replicas. Records
/// what this stage reaches, the first stage that trains each (where a save takes it from) and those only other
/// stages train; returns the tied ones (reached by more than one stage) with their lengths.
fn find_uses(
    stages: &Stages,
    rest: &[(ParamId, usize)],
    held: &HashSet<ParamId>,
    device: &Device,
) -> Result<Vec<(ParamId, usize)>> {
    let (here, count) = (stages.layout.stage, stages.layout.stages);
    let n = rest.len();
    let mut marks = vec![0f32; n * count];
    for (j, (id, _)) in rest.iter().enumerate() {
        if held.contains(id) {
            marks[here * n + j] = 1.0;
        }
    }
    let marks = match n {
        0 => marks,
        _ => stages
            .world
            .all_reduce(
                Tensor::<1>::from_floats(marks.as_slice(), device),
                Reduction::Op(ReduceOp::Max),
                "pipeline parameter uses",
            )?
            .wait()?
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| {
                Error::other(format!(
                    "backward_batch: reading which stages use the parameters outside the blocks: {e:?}"
                ))
            })?,
    };
    let reaches = |stage: usize, j: usize| marks[stage * n + j] > 0.5;
    let reached: HashSet<ParamId> = (0..n)
        .filter(|&j| reaches(here, j))
        .map(|j| rest[j].0)
        .collect();
    let firsts: Vec<Option<usize>> = (0..n)
        .map(|j| (0..count).find(|&s| reaches(s, j)))
        .collect();
    // Trained by some stage, never reached here: dropped after the step (see `Staged::after_step`).
    *stages
        .rest_elsewhere
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(
        rest.iter()
            .zip(&firsts)
            .filter(|((id, _), first)| first.is_some() && !reached.contains(id))
            .map(|((id, _), _)| *id)
            .collect(),
    );
    *stages.rest_owner.lock().unwrap_or_else(|e| e.into_inner()) = Some(
        rest.iter()
            .zip(&firsts)
            .filter_map(|((id, _), first)| first.map(|s| (*id, s)))
            .collect(),
    );
    *stages
        .rest_reached
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(reached);
    // A stage between the first and the last holds these as placeholders: their lengths as they arrived.
    let placeholders = stages.rest_lens.lock().unwrap_or_else(|e| e.into_inner());
    Ok(rest
        .iter()
        .enumerate()
        .filter(|(j, _)| (0..count).filter(|&s| reaches(s, *j)).count() > 1)
        .map(|(_, (id, len))| (*id, (*len).max(placeholders.get(id).copied().unwrap_or(0))))
        .collect())
}
