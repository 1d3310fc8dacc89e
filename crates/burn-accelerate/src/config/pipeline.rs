//! Pipeline parallelism's settings: how many stages the model's blocks are cut into, how many micro-batches each
//! batch is split into, and the schedule that orders them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable that sets [`PipelineSettings::pp_size`].
pub const PP_SIZE_VAR: &str = "ACCELERATE_PP_SIZE";
/// The environment variable that sets [`PipelineSettings::pp_microbatches`].
pub const PP_MICROBATCHES_VAR: &str = "ACCELERATE_PP_MICROBATCHES";
/// The environment variable that sets [`PipelineSettings::pp_schedule`].
pub const PP_SCHEDULE_VAR: &str = "ACCELERATE_PP_SCHEDULE";
/// The environment variable that sets [`PipelineSettings::pp_stage_blocks`] (`3,5`: 3 blocks, then 5).
pub const PP_STAGE_BLOCKS_VAR: &str = "ACCELERATE_PP_STAGE_BLOCKS";

/// How a pipeline stage orders its micro-batches' forward and backward passes (`torch.distributed.pipelining`'s
/// `ScheduleGPipe` and `Schedule1F1B`). Both leave each stage idle for the same share of a step,
/// `(pp_size - 1) / (pp_microbatches + pp_size - 1)`; they differ in memory.
///
/// ```
/// use burn_accelerate::PipelineSchedule;
/// assert_eq!("1f1b".parse::<PipelineSchedule>()?, PipelineSchedule::OneFOneB);
/// assert_eq!("GPipe".parse::<PipelineSchedule>()?, PipelineSchedule::GPipe);
/// assert!("interleaved".parse::<PipelineSchedule>().is_err());
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// Every micro-batch's forward pass, then every backward pass: each stage holds every micro-batch's
    /// activations until its backward pass.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward in the steady state (PipeDream-Flush): stage `s` of `P` holds at most `P - s`
    /// micro-batches' activations (the default).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl PipelineSchedule {
    /// The setting's spelling (`gpipe`, `1f1b`).
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
        }
    }
}

impl fmt::Display for PipelineSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PipelineSchedule {
    type Err = Error;

    /// `gpipe` or `1f1b` (torchtitan's `GPipe` and `1F1B`), in any case.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gpipe" => Ok(PipelineSchedule::GPipe),
            "1f1b" => Ok(PipelineSchedule::OneFOneB),
            _ => Err(Error::config(
                "pp_schedule",
                s.trim(),
                "configuration",
                "gpipe or 1f1b",
            )),
        }
    }
}

/// Pipeline parallelism: the model's blocks ([`Blocks`](crate::Blocks)) cut into `pp_size` contiguous stages,
/// one per group of ranks, each batch split into `pp_microbatches` micro-batches that flow through the stages
/// (see [`Accelerator::backward_batch`](crate::Accelerator::backward_batch)). The ranks form a `pp_size` ×
/// `world / pp_size` mesh: rank `r` runs stage `r / dp` of data-parallel replica `r % dp`, where `dp = world /
/// pp_size`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PipelineSettings {
    /// Pipeline stages (default 1: no pipeline; `ACCELERATE_PP_SIZE`, the config file's
    /// `parallelism_config.parallelism_config_pp_size`). It must divide the number of ranks.
    pub pp_size: usize,
    /// Micro-batches per batch (default: `pp_size`; `ACCELERATE_PP_MICROBATCHES`). More micro-batches shrink the
    /// idle share of each stage, `(pp_size - 1) / (pp_microbatches + pp_size - 1)`.
    pub pp_microbatches: Option<usize>,
    /// The schedule (default [`PipelineSchedule::OneFOneB`]; `ACCELERATE_PP_SCHEDULE`).
    pub pp_schedule: PipelineSchedule,
    /// How many blocks each stage runs, first stage first (default: cut by the blocks' parameters;
    /// `ACCELERATE_PP_STAGE_BLOCKS=3,5`): one count per stage, each at least 1, summing to the model's blocks.
    /// torchtitan's `pipeline_parallel_split_points`, as counts.
    pub pp_stage_blocks: Option<Vec<usize>>,
}

impl Default for PipelineSettings {
    fn default() -> Self {
        Self {
            pp_size: 1,
            pp_microbatches: None,
            pp_schedule: PipelineSchedule::default(),
            pp_stage_blocks: None,
        }
    }
}

impl PipelineSettings {
    /// Whether the blocks run as a pipeline (more than one stage).
    pub fn is_pipelined(&self) -> bool {
        self.pp_size > 1
    }

    /// `pp_stage_blocks` as the setting's text (`3,5`).
    pub fn stage_blocks_text(&self) -> Option<String> {
        self.pp_stage_blocks.as_ref().map(|counts| {
            counts
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",")
        })
    }

    /// Reads `pp_stage_blocks` from its text (`3,5`).
    ///
    /// # Errors
    /// A part that is not a count of 1 or more.
    pub fn parse_stage_blocks(text: &str) -> Result<Vec<usize>> {
        text.split(',')
            .map(|part| part.trim().parse::<usize>().ok().filter(|n| *n > 0))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                Error::config(
                    "pp_stage_blocks",
                    text.trim(),
                    "configuration",
                    "counts of blocks per stage separated by commas, each 1 or more (`3,5`)",
                )
            })
    }

    /// The micro-batches each batch is split into: the setting, else `pp_size`.
    pub fn microbatches(&self) -> usize {
        self.pp_microbatches.unwrap_or(self.pp_size).max(1)
    }
}
