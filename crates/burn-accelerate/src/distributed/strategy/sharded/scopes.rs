//! What a checkpoint holds of a sharded rank's state, and which optimizers and trainers can step its slices.

use super::*;

impl StateScopes for Sharded {
    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }

    fn model_state(&self) -> StateScope {
        if self.mode.reshards_parameters() {
            // Between steps each rank holds only its slices: each writes its own record, without gathering.
            StateScope::PerRank
        } else {
            StateScope::Replicated
        }
    }

    fn check_learner(&self) -> Result<()> {
        if self.mode.reshards_parameters() {
            // FULL_SHARD and HYBRID_SHARD: the Learner's model holds this rank's slices between steps, burn-train's
            // optimizer steps them with the slices' gradients, and the Learner strategy gathers the whole model for
            // each step (`learner::unshard`) and for validation.
            return Ok(());
        }
        // burn-train's optimizer steps the Learner's whole parameters: each is owned whole by one rank.
        self.whole_tensors.store(true, Ordering::Relaxed);
        let mut known = self.known();
        let order: Vec<(ParamId, usize)> =
            known.iter().map(|(id, k)| (*id, k.slicing.len())).collect();
        let mut order = order;
        order.sort_by_key(|(id, _)| id.val());
        for ((id, _), owner) in order.iter().zip(balanced_owners(&order, self.world())) {
            if let Some(k) = known.get_mut(id) {
                k.slicing = Slicing::new(
                    k.slicing.dims().to_vec(),
                    self.world(),
                    SliceKind::Whole { owner },
                );
            }
        }
        Ok(())
    }

    fn check_optimizer(&self, optimizer: &str) -> Result<()> {
        let cut = self
            .known()
            .values()
            .any(|k| k.slicing.kind() == SliceKind::Rows && k.slicing.parts() > 1);
        if cut {
            return Err(Error::InvalidArgument(format!(
                "optimizer step: {optimizer} needs each parameter whole (a trust ratio, factored moments or an \
                 orthogonalised update), and {} cuts every parameter into row slices across the ranks; use an \
                 element-wise optimizer (Adam, AdamW, SGD, RMSprop, AdaGrad, Lion, Adan) with sharding, or \
                 NO_SHARD",
                self.mode
            )));
        }
        Ok(())
    }
}
