//! What the library asks of a model and its batches, below every layer that runs them: a model made of blocks
//! ([`Blocks`]), a batch cut into micro-batches ([`Split`]), and the cut of a model's blocks into pipeline stages.

mod blocks;
mod micro_batch;
mod partition;

pub use blocks::Blocks;
pub use micro_batch::Split;
pub(crate) use partition::{balanced_stages, stage_blocks};
