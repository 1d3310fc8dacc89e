//! The settings of an [`AcceleratorConfig`](super::AcceleratorConfig) by name, typed: where each setting came
//! from is kept under a [`Key`], so a misspelt name is a compile error instead of a source that is never found.

use std::fmt;

use serde::Serialize;

macro_rules! keys {
    ($($variant:ident => $name:literal,)*) => {
        /// One setting of an [`AcceleratorConfig`](super::AcceleratorConfig), named as its field.
        ///
        /// ```
        /// use burn_accelerate::config::{AcceleratorConfig, Key, Source};
        /// let config = AcceleratorConfig::default();
        /// assert_eq!(Key::MixedPrecision.name(), "mixed_precision");
        /// assert_eq!(config.source(Key::MixedPrecision), Source::Default);
        /// ```
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        pub enum Key {
            $(
                #[doc = concat!("The setting `", $name, "`.")]
                $variant,
            )*
        }

        impl Key {
            /// Every key, in the order of the configuration's fields.
            pub const ALL: &'static [Key] = &[$(Key::$variant),*];

            /// The field's name (`mixed_precision`), as `burn-accelerate env` and `launch` print it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Key::$variant => $name,)*
                }
            }
        }
    };
}

keys! {
    DevicePlacement => "device_placement",
    StepSchedulerWithOptimizer => "step_scheduler_with_optimizer",
    SplitBatches => "split_batches",
    SchedulerRule => "scheduler_rule",
    GradientAccumulationSteps => "gradient_accumulation_steps",
    Cpu => "cpu",
    MixedPrecision => "mixed_precision",
    LossScaler => "loss_scaler",
    Debug => "debug",
    EvenBatches => "even_batches",
    SyncEachBatch => "sync_each_batch",
    LossNormalization => "loss_normalization",
    BucketSizeMb => "bucket_size_mb",
    Sharding => "sharding",
    DpShardSize => "dp_shard_size",
    TpSize => "tp_size",
    SequenceParallel => "sequence_parallel",
    CpSize => "cp_size",
    CpCommStrategy => "cp_comm_strategy",
    CpLoadBalance => "cp_load_balance",
    PpSize => "pp_size",
    PpMicrobatches => "pp_microbatches",
    PpSchedule => "pp_schedule",
    PpStageBlocks => "pp_stage_blocks",
    FsdpParamDtype => "fsdp_param_dtype",
    FsdpReduceDtype => "fsdp_reduce_dtype",
    ActivationCheckpointing => "activation_checkpointing",
    AutodiffCheckpointing => "autodiff_checkpointing",
    GradientTransport => "gradient_transport",
    CollectiveTimeoutSecs => "collective_timeout_secs",
    ResumeFromLatest => "resume_from_latest",
    IndependentProcesses => "independent_processes",
    RestartCount => "restart_count",
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Key;

    #[test]
    fn every_key_names_a_field_of_the_serialized_configuration() {
        let config = serde_json::to_value(super::super::AcceleratorConfig::default()).unwrap();
        // The fields of every group: each key names exactly one.
        let fields: Vec<String> = config
            .as_object()
            .unwrap()
            .values()
            .filter_map(|group| group.as_object())
            .flat_map(|group| group.keys().cloned())
            .collect();
        for key in Key::ALL {
            let found = fields.iter().filter(|f| *f == key.name()).count();
            assert_eq!(found, 1, "{key} names {found} fields");
        }
        let names: std::collections::BTreeSet<_> = Key::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), Key::ALL.len(), "two keys share a name");
    }
}
