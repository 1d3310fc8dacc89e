//! The byte-level causal transformer language model of `transformer_lm` and `transformer_learner`, and its data:
//! sequences of `examples/data/corpus.txt`, one token per byte. Its layers (Burn's `TransformerEncoderLayer` as
//! the crate's `ParallelTransformerLayer`, the same record and, on one rank, the same numbers, with a causal
//! mask) are the blocks; the embeddings and the head are outside them. Under tensor parallelism ([`plan`]) the
//! layers split the Megatron way, the token embedding by vocabulary and the head by columns.

#![allow(dead_code)]

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::Blocks;
use burn_accelerate::tensor_parallel::{
    self, ParallelEmbedding, ParallelLinear, ParallelTransformerLayer, Split, TensorParallelPlan,
    region,
};

/// The corpus, one token per byte.
pub const CORPUS: &str = include_str!("../data/corpus.txt");
/// One token per byte value.
pub const VOCAB: usize = 256;

/// A decoder-only transformer over bytes: token and position embeddings, `layers` causal self-attention layers,
/// a final norm and a head onto the 256 byte values.
#[derive(Module, Debug)]
pub struct ByteLm {
    pub tokens: ParallelEmbedding,
    pub positions: Embedding,
    pub layers: Vec<ParallelTransformerLayer>,
    pub norm: LayerNorm,
    pub head: ParallelLinear,
}

impl Blocks for ByteLm {
    type Block = ParallelTransformerLayer;
    fn blocks(&self) -> &[ParallelTransformerLayer] {
        &self.layers
    }
}

/// How tensor parallelism splits the model: every layer the Megatron way (each rank its heads and its columns of
/// the feed-forward network), the token embedding by vocabulary, the head by columns (its logits gathered for the
/// loss); the position embedding and the norms whole.
pub fn plan() -> TensorParallelPlan {
    TensorParallelPlan::megatron().split("head", Split::Columns)
}

impl ByteLm {
    /// `layers` pre-norm layers of width `d_model` with `heads` heads, over sequences of `seq` bytes.
    pub fn new(layers: usize, d_model: usize, heads: usize, seq: usize, device: &Device) -> Self {
        Self::with_dropout(layers, d_model, heads, seq, 0.0, device)
    }

    /// [`new`](Self::new) with dropout `dropout` in every layer.
    pub fn with_dropout(
        layers: usize,
        d_model: usize,
        heads: usize,
        seq: usize,
        dropout: f64,
        device: &Device,
    ) -> Self {
        let config = TransformerEncoderConfig::new(d_model, 4 * d_model, heads, 1)
            .with_dropout(dropout)
            .with_norm_first(true);
        Self {
            tokens: EmbeddingConfig::new(VOCAB, d_model).init(device).into(),
            positions: EmbeddingConfig::new(seq, d_model).init(device),
            layers: (0..layers)
                .map(|_| ParallelTransformerLayer::new(&config, device))
                .collect(),
            norm: LayerNormConfig::new(d_model).init(device),
            head: LinearConfig::new(d_model, VOCAB).init(device).into(),
        }
    }

    /// The first activation: token plus position embeddings, `[batch, seq, d_model]` (under sequence
    /// parallelism this rank's positions: the token embedding gives them, and the position embeddings are cut to
    /// match).
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        self.tokens.forward(tokens)
            + tensor_parallel::sequence_part(self.positions.forward(positions))
    }

    /// [`embed`](Self::embed) at the positions `positions` `[seq]` (under context parallelism this rank's, from
    /// `ContextSplit::position_ids`).
    pub fn embed_at(&self, tokens: Tensor<2, Int>, positions: Tensor<1, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let positions = positions.reshape([1, seq]).repeat_dim(0, batch);
        self.tokens.forward(tokens)
            + tensor_parallel::sequence_part(self.positions.forward(positions))
    }

    /// The next byte's logits after the last layer's activation `x`, `[batch * seq, VOCAB]`.
    pub fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        // The head is a tensor-parallel region of its own: its input's gradient summed over the ranks' columns
        // (and its input gathered along the sequence under sequence parallelism).
        let logits = region(self.norm.forward(x), |h| self.head.forward_gathered(h));
        let [batch, seq, _] = logits.dims();
        logits.reshape([batch * seq, VOCAB])
    }

    /// [`loss`](Self::loss) with loss parallelism: under tensor parallelism each rank keeps its columns of the
    /// logits (`[batch * seq, VOCAB / tp]`) and the cross-entropy combines three vectors over the ranks instead
    /// of gathering them.
    pub fn parallel_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        // The region's input comes whole along the sequence (gathered under sequence parallelism).
        let logits = region(self.norm.forward(x), |h| self.head.forward(h));
        let [batch, seq, width] = logits.dims();
        tensor_parallel::cross_entropy(
            logits.reshape([batch * seq, width]),
            targets.reshape([batch * seq]),
            VOCAB,
        )
    }

    /// Each sequence's mean cross-entropy of the next byte after the last layer's activation `x`, `[batch]`: the
    /// per-sample values of an evaluation (`forward_batch`, then `gather_for_metrics`).
    pub fn sequence_losses(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [batch, seq] = targets.dims();
        let log_p = burn::tensor::activation::log_softmax(self.logits(x), 1);
        let picked = log_p.gather(1, targets.reshape([batch * seq, 1]));
        picked
            .reshape([batch, seq])
            .mean_dim(1)
            .reshape([batch])
            .neg()
    }

    /// The mean cross-entropy of the next byte after the last layer's activation `x`.
    pub fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let logits = self.logits(x);
        let n = logits.dims()[0];
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets.reshape([n]))
    }
}

/// Sequences `first..first + rows` of the corpus (wrapping around): inputs and next-byte targets.
pub fn batch(
    (first, rows): (usize, usize),
    seq: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let indices: Vec<usize> = (first..first + rows).collect();
    sequences(&indices, seq, device)
}

/// The corpus's sequences `indices` (each `seq` bytes, 7 bytes apart, wrapping around): inputs and next-byte
/// targets, `[indices.len(), seq]` each.
pub fn sequences(
    indices: &[usize],
    seq: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let bytes = CORPUS.as_bytes();
    let stride = 7;
    let window = |i: usize, shift: usize| -> Vec<i64> {
        (0..seq)
            .map(|j| i64::from(bytes[(i * stride + j + shift) % bytes.len()]))
            .collect()
    };
    let (inputs, targets): (Vec<i64>, Vec<i64>) = indices
        .iter()
        .map(|&i| (window(i, 0), window(i, 1)))
        .fold((Vec::new(), Vec::new()), |(mut a, mut b), (x, y)| {
            a.extend(x);
            b.extend(y);
            (a, b)
        });
    let rows = indices.len();
    let tensor = |values: Vec<i64>| {
        Tensor::<1, Int>::from_ints(values.as_slice(), device).reshape([rows, seq])
    };
    (tensor(inputs), tensor(targets))
}
