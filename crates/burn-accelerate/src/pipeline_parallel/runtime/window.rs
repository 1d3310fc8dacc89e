//! The end of a pipelined accumulation window on one stage: its gradients summed over the stages that share a
//! parameter, normalised, unscaled, averaged over the stage's data-parallel group and checked for an overflow.

use super::*;

impl StepPipeline {
    /// The window's part of a pipelined step, as [`end_backward`](Self::end_backward) for a whole model: on the
    /// window's last batch the stage's gradients (its blocks' (`own`), and those of the parameters outside the
    /// blocks its passes reached) are summed over the stages for parameters more than one stage uses (a tied
    /// embedding and output head, as Megatron keeps them in sync), normalised over every micro-batch of the window,
    /// unscaled, averaged over the stage's data-parallel group, and checked for an fp16 overflow on every rank of
    /// the run.
    pub(super) fn end_stage_window<M: Blocks>(
        &self,
        stages: &Stages,
        model: &M,
        whole: &M,
        (micro_batches_run, device): (usize, &burn::tensor::Device),
        (own, block_ids): (&HashSet<ParamId>, &HashSet<ParamId>),
    ) -> Result<()> {
        let mut core = self.shared.lock();
        let plan = core.state.record_backward(model_key(model), false);
        let splits = {
            let mut window = self.window_splits.lock().unwrap_or_else(|e| e.into_inner());
            *window += micro_batches_run;
            match plan {
                BackwardPlan::EndWindow { micro_batches } => {
                    (micro_batches, std::mem::take(&mut *window))
                }
                _ => return Ok(()),
            }
        };
        let (micro_batches, splits) = splits;
        let sync_started = Instant::now();
        let held: HashSet<ParamId> = core.grads.ids().into_iter().collect();
        let trainable = self.stage_params(whole);
        let rest: Vec<(ParamId, usize)> = trainable
            .iter()
            .filter(|(id, _)| !block_ids.contains(id))
            .copied()
            .collect();
        sum_tied(stages, &mut core.grads, &rest, &held, device)?;
        // In visiting order: this stage's blocks, and what outside the blocks its passes reached on any of its
        // replicas (the same list on each, whatever this one's data reached).
        let reached = stages
            .rest_reached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        let params: Vec<(ParamId, usize)> = trainable
            .into_iter()
            .filter(|(id, _)| match block_ids.contains(id) {
                true => own.contains(id),
                false => reached.contains(id),
            })
            .collect();
        let mut precision = self.precision();
        // Every rank of the stage's group reduces at one scale, the window's nominal count's; a replica that ran
        // fewer micro-batches (a short last batch) weighs its own gradients up to the mean over those it ran
        // first, so that each replica counts as much as the others, as each rank's mean does in data parallelism.
        let nominal = micro_batches * stages.micro_batches;
        let scale = precision.unscaled(self.normalisation_of_splits(nominal, stages.micro_batches));
        let fewer = self.normalisation_of_splits(splits, stages.micro_batches)
            / self.normalisation_of_splits(nominal, stages.micro_batches);
        if fewer != 1.0 {
            let ids = core.grads.ids();
            core.grads.map_flat(&ids, |g| g.mul_scalar(fewer));
        }
        self.average_params(&mut core.grads, whole, &params, scale)?;
        let ids: Vec<ParamId> = params.iter().map(|(id, _)| *id).collect();
        self.record_overflow(&mut precision, &mut core, &ids, model_key(model))?;
        drop(precision);
        core.phases.gradient_sync += sync_started.elapsed();
        Ok(())
    }
    /// `(id, whole number of elements)` of every float parameter of `whole` that trains, in visiting order, the
    /// same on every rank of a stage: under a sharded stage, what is outside the blocks is this rank's slices
    /// (gathered only for each use), and a rank whose slice of a parameter is empty holds it as not training.
    pub(super) fn stage_params<M: Blocks>(&self, whole: &M) -> Vec<(ParamId, usize)> {
        let mut params = Vec::new();
        crate::named_params::floats(whole, |p| match self.strategy.slicing(p.id()) {
            Some((split, _)) if p.require_grad() || p.num_elements() == 0 => {
                params.push((p.id(), split.len()))
            }
            _ if p.require_grad() => params.push((p.id(), p.num_elements())),
            _ => {}
        });
        params
    }
}
