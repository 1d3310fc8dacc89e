//! `prepare_model`: every rank starts from the main process's weights, each keeping what its strategy gives it.

use burn::module::Module;

use super::{Accelerator, with_device_checkpointing};
use crate::distributed::strategy::materialize;
use crate::error::Result;

impl Accelerator {
    /// Prepares `model` for training: with several ranks, every rank gets rank 0's weights (so ranks start
    /// identical whatever their seeds); then the model is placed on the accelerator's device with autodiff on
    /// (unless device placement is off).
    ///
    /// Burn draws a parameter's initial value at its first use. `prepare_model` draws them all, in the module's
    /// order, on the main process only, after every rank has reached this call (so a `set_seed` of another
    /// rank cannot land in the middle) and before any other rank draws anything: a program gets the same
    /// starting weights on 1, 2 or N ranks, in-process ranks included (they share the device's random
    /// generator). Parameters drawn before this call (`Tensor::random` in a constructor) are taken as they
    /// are; build such a model on each rank after `set_seed`, or inside
    /// [`main_process_first`](Self::main_process_first).
    pub fn prepare_model<M: Module>(&self, model: M) -> Result<M> {
        self.check_tensor_parallel_planned()?;
        let model = if self.num_processes() == 1 {
            materialize(model)
        } else {
            // Every rank has seeded and built its model before the main process draws; the main process draws
            // each parameter as it sends it, in visiting order, and the other ranks receive every lazy value
            // without drawing it. Rank 0's parameter ids too: checkpoints key optimizer state by id, and a
            // sharding strategy keeps each rank's slice under it as the parameter arrives.
            self.wait_for_everyone()?;
            self.warn_if_drawn_whole(&model);
            let ids: Vec<u64> = crate::grad::param_ids(&model)
                .iter()
                .map(|id| id.val())
                .collect();
            let ids = self.broadcast_object(&ids, 0)?;
            let model = self.step.broadcast_initial(model, &ids)?;
            crate::distributed::strategy::with_param_ids(model, &ids)
        };
        let model = if self.config.device.device_placement {
            model.fork(self.device()).train()
        } else {
            model
        };
        let model = with_device_checkpointing(model, self.device());
        let model = self.step.after_prepare(model);
        crate::heap::release_free_heap();
        model
    }

    /// Under a mode whose ranks keep only part of the model (`FULL_SHARD`, the hybrids, a pipeline's stages), says
    /// once, on a rank other than the main process, how many bytes of `model` this rank had drawn already
    /// (`Param::from_tensor`, a constructor that calls `Tensor::random`): the memory that mode saves is spent
    /// before `prepare_model` can cut it. A lazy parameter (Burn's `*Config::init`, `Param::uninitialized`) is
    /// drawn on the main process alone and arrives as this rank's part.
    fn warn_if_drawn_whole<M: Module>(&self, model: &M) {
        let keeps_part = self.config.distributed.sharding.reshards_parameters()
            || self.config.pipeline.pp_size > 1;
        if !keeps_part || self.is_main_process() {
            return;
        }
        let mut drawn = 0usize;
        crate::named_params::floats(model, |p| {
            if p.is_drawn() {
                drawn += p.num_elements() * p.placement().1.size();
            }
        });
        if drawn == 0 {
            return;
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            let mode = match self.config.pipeline.pp_size {
                1 => self.config.distributed.sharding.to_string(),
                stages => format!("pp_size {stages}"),
            };
            crate::notice::warn_visibly(&format!(
                "prepare_model: rank {} was handed {drawn} bytes ({:.1} MiB) of parameters already drawn: under \
                 {mode} each rank keeps only its part, but this memory was spent before the model reached \
                 prepare_model, on every rank. Leave the parameters lazy (Burn's `*Config::init`, or \
                 `Param::uninitialized` for values of your own) so that only the main process draws them and each \
                 rank receives its part; see docs/troubleshoot.md (said once)",
                self.process_index(),
                drawn as f64 / (1024.0 * 1024.0)
            ));
        });
    }
}
