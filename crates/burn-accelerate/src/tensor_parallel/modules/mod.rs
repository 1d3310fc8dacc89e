//! The modules a plan can split: [`ParallelLinear`], [`ParallelEmbedding`], [`ParallelAttention`],
//! [`ParallelFeedForward`] and [`ParallelTransformerLayer`], each Burn's module of the same name with the same
//! record, whole on one rank.

mod attention;
mod embedding;
mod layer;
mod linear;

pub use attention::ParallelAttention;
pub(crate) use attention::heads_of;
pub use embedding::ParallelEmbedding;
pub use layer::{ParallelFeedForward, ParallelTransformerLayer};
pub use linear::{LinearLayout, ParallelLinear};
