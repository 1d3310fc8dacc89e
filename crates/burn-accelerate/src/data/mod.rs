//! Data loading: a Burn-style [`DataLoader`] that the accelerator can prepare (place batches on its device,
//! report the end of each epoch, and, with several ranks, shard).
//!
//! ```
//! use std::sync::Arc;
//! use burn::data::dataloader::batcher::Batcher;
//! use burn::data::dataset::InMemDataset;
//! use burn::tensor::{Device, Tensor};
//! use burn_accelerate::data::DataLoaderBuilder;
//!
//! #[derive(Clone)]
//! struct Stack;
//! impl Batcher<f32, Tensor<1>> for Stack {
//!     fn batch(&self, items: Vec<f32>, device: &Device) -> Tensor<1> {
//!         Tensor::from_floats(items.as_slice(), device)
//!     }
//! }
//!
//! let loader = DataLoaderBuilder::new(Stack)
//!     .batch_size(4)
//!     .shuffle(7)
//!     .build(InMemDataset::new((0..10).map(|i| i as f32).collect()));
//! assert_eq!(loader.len(), 3);
//! let seen: usize = loader.iter().map(|b| b.unwrap().dims()[0]).sum();
//! assert_eq!(seen, 10);
//! ```

mod position;
mod shard;
mod stream;
mod dispatch;
mod stream_loader;
mod workers;
mod loader;
mod prepared;

pub use loader::{DataLoader, DataLoaderBuilder, DataLoaderIter};
pub(crate) use position::LoaderCursor;
pub use position::{DataPosition, LoaderFingerprint};
pub use prepared::{PreparedDataLoader, PreparedIter};
pub use shard::{ShardSpec, shard};
pub use stream::{StreamShard, shard_stream};
pub use stream_loader::{PreparedStreamIter, PreparedStreamLoader, StreamLoader};
