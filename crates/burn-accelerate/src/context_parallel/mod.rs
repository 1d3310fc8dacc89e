//! Context parallelism (Accelerate's `cp_size`, torchtitan's `context_parallel_degree`, Megatron's
//! `--context-parallel-size`): sequences longer than one rank's activations, each rank of a context group
//! holding a slice of every sequence, causal attention across the ranks.
//!
//! - **The split** ([`ContextSplit`], from `Accelerator::context_split`): each sequence cut into `2 × cp`
//!   chunks, rank `r` holding chunks `r` and `2 × cp − 1 − r` (torchtitan's head-tail balancer: every rank then
//!   computes as many unmasked scores); the tokens, targets and position ids cut alike. A context group reads the
//!   same batches (a prepared dataloader shards by the data-parallel index only).
//! - **Attention** ([`attention`]): the building block a model's attention calls; all-gather of the keys and
//!   values (their gradients reduce-scattered back) or the ring (blocks passed around the ranks, partial results
//!   merged by log-sum-exp, a hand-written flash-style backward). It is a segment of its own in the backward pass
//!   (see the `graph_cut` module).
//! - **Everything else is per position** (embeddings, norms, feed-forward networks, the loss): each rank computes
//!   its positions', and the loss of its positions' mean. The context ranks join the data-parallel gradient
//!   reduction (`dp × cp`, FSDP2 + CP's `dp_shard_cp`), whose mean over them is the whole sequence's gradient.
//!
//! ```text
//! let split = accelerator.context_split(seq)?;
//! let (tokens, targets) = (split.part(tokens, 1)?, split.part(targets, 1)?);
//! let x = model.embed_at(tokens, split.position_ids(&device));
//! let loss = accelerator.backward_blocks(&model, x, |layer, x| layer.forward_causal(x), head)?;
//! ```

mod split;
mod blocks;
pub(crate) mod group;
mod ring;
mod attention;

pub use attention::attention;
pub use group::{ContextStats, cp_rank_and_size, reset_stats, stats};
pub use split::ContextSplit;
