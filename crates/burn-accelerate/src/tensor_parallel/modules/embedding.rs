//! [`ParallelEmbedding`]: Burn's `Embedding` (the same record: `weight` `[n_embedding, d_model]`), split by a plan
//! over the vocabulary.

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::module::embedding;
use burn::tensor::{Int, Tensor};

use crate::tensor_parallel::context::tp_rank_and_size;
use crate::tensor_parallel::cut::reduce_from_region;
use crate::tensor_parallel::sequence;

/// An embedding a plan can split by vocabulary (Megatron's vocabulary-parallel embedding): each rank holds a
/// range of rows; a token outside its range looks up zeros, and the ranks' lookups are summed. Whole until a plan
/// splits it.
///
/// ```
/// use burn::nn::EmbeddingConfig;
/// use burn::tensor::{Int, Tensor};
/// use burn_accelerate::tensor_parallel::ParallelEmbedding;
///
/// let device = Default::default();
/// let table = ParallelEmbedding::from(EmbeddingConfig::new(10, 4).init(&device));
/// let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3]], &device);
/// assert_eq!(table.forward(tokens).dims(), [1, 3, 4]);
/// ```
#[derive(Module, Debug)]
pub struct ParallelEmbedding {
    /// The table `[n_embedding, d_model]`, or this rank's rows of it.
    pub weight: Param<Tensor<2>>,
    /// The whole table's rows (the vocabulary).
    pub n_embedding: usize,
}

impl From<Embedding> for ParallelEmbedding {
    fn from(table: Embedding) -> Self {
        let [n_embedding, _] = table.weight.lazy_shape().dims();
        Self {
            weight: table.weight,
            n_embedding,
        }
    }
}

impl ParallelEmbedding {
    /// Whether this rank holds only some rows.
    pub fn is_split(&self) -> bool {
        self.weight.lazy_shape().dims::<2>()[0] < self.n_embedding
    }

    /// The embeddings of `tokens` `[batch, seq]`: `[batch, seq, d_model]`; under sequence parallelism this rank's
    /// positions of them, `[batch, seq / tp, d_model]` (split, the ranks' lookups reduce-scattered).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        if !self.is_split() {
            return sequence::sequence_part(embedding(self.weight.val(), tokens));
        }
        let rows = self.weight.lazy_shape().dims::<2>()[0];
        let start = (tp_rank_and_size().0 * rows) as i64;
        let end = start + rows as i64;
        let mine = tokens
            .clone()
            .greater_equal_elem(start)
            .bool_and(tokens.clone().lower_elem(end));
        let local = (tokens - start).clamp(0, rows as i64 - 1);
        let looked_up = embedding(self.weight.val(), local);
        let keep = mine.float().cast(looked_up.dtype()).unsqueeze_dim::<3>(2);
        let looked_up = looked_up * keep;
        match sequence::active() {
            Some(_) => sequence::scatter_from_region(looked_up, 1, "vocabulary-parallel embedding"),
            None => reduce_from_region(looked_up, "vocabulary-parallel embedding"),
        }
    }
}
