//! Checkpoints, in two halves that do not know each other's insides:
//!
//! - the [`safetensors`] format — model weights in Hugging Face's layout, written atomically and streamed,
//!   read back strictly or partially, one resolver for what a path names;
//! - training state — [`save_state`](crate::Accelerator::save_state) and
//!   [`load_state`](crate::Accelerator::load_state): models, optimizers (one state, or one slice per rank
//!   under a sharded strategy), schedulers, loss scaler, data positions and custom objects for exact
//!   resumption (`manifest`, `save`, `load`), the [`ProjectConfiguration`] of automatic checkpoints, and the
//!   checkpointer that ties them to a rank. A state loads on any number of ranks: each rank re-cuts the saved
//!   records for its own partition (`repartition`), and the data positions carry over because the global batch
//!   is the same.
//!
//! Every write goes to a temporary name that is renamed into place once complete and synced, so a crash during
//! a save leaves the previous checkpoint whole; loading a truncated, corrupt or mismatched checkpoint is an error
//! naming the file and tensor.

mod pieces;
pub(crate) mod repartition;
mod manifest;
mod load;
mod project;
pub mod safetensors;
mod merge;
mod save;
mod checkpointer;

pub(crate) use checkpointer::{Checkpointer, StateLayout};
pub use load::LoadedState;
pub use manifest::FORMAT;
pub use merge::merge_weights;
pub use project::{Checkpointable, ProjectConfiguration};
pub use safetensors::{KeyRemap, LoadOptions, LoadReport, SaveOptions, WeightLayout, parse_size};
pub(crate) use save::SaveContext;
pub use save::StateToSave;
