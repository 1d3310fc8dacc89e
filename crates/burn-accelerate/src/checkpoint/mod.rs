//! Checkpoints: model weights in Hugging Face's safetensors layout ([`weights`]), and the full training state
//! (models, optimizers, schedulers, loss scaler, data positions, custom objects) for exact resumption
//! ([`state`]).
//!
//! Every write goes to a temporary name that is renamed into place once complete and synced, so a crash during
//! a save leaves the previous checkpoint whole; loading a truncated, corrupt or mismatched checkpoint is an error
//! naming the file and tensor.

mod checkpointer;
pub(crate) mod fs;
pub mod layout;
pub mod state;
mod stream;
pub mod weights;

pub(crate) use checkpointer::Checkpointer;
pub use layout::{KeyRemap, WeightLayout};
pub use state::{Checkpointable, LoadedState, ProjectConfiguration, StateToSave};
pub use weights::{LoadOptions, LoadReport, SaveOptions, parse_size};
