//! [`ParallelAttention`]: Burn's multi-head self-attention with its heads split over the tensor-parallel ranks.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::module::{Module, ParamId};
use burn::nn::Dropout;
use burn::nn::attention::{MultiHeadAttention, generate_autoregressive_mask};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::{Bool, Tensor};

use super::linear::ParallelLinear;
use crate::tensor_parallel::context::tp_rank_and_size;
use crate::tensor_parallel::dropout::dropout;

/// Each attention's head count, by its query weight's id (read by a plan, which sees parameters only, to refuse
/// a `tp_size` that does not divide the heads before the first step).
static HEADS: Mutex<Option<HashMap<ParamId, usize>>> = Mutex::new(None);

pub(crate) fn heads_of(query_weight: ParamId) -> Option<usize> {
    HEADS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&query_weight).copied())
}

fn note_heads(query_weight: ParamId, heads: usize) {
    HEADS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(query_weight, heads);
}

/// Multi-head self-attention whose query, key and value projections a plan splits by columns (each rank its
/// heads) and whose output projection by rows: Burn's `MultiHeadAttention` with the same record, and the same
/// numbers on one rank. Made from Burn's (`ParallelAttention::from(mha)`).
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// Input features to queries (by columns: this rank's heads).
    pub query: ParallelLinear,
    /// Input features to keys.
    pub key: ParallelLinear,
    /// Input features to values.
    pub value: ParallelLinear,
    /// Heads back to features (by rows).
    pub output: ParallelLinear,
    /// Dropout of the attention probabilities (each rank's heads draw their own masks).
    pub dropout: Dropout,
    /// The whole model width.
    pub d_model: usize,
    /// The whole layer's heads.
    pub n_heads: usize,
    /// The width of one head.
    pub d_k: usize,
    /// The value masked scores take.
    pub min_float: f64,
    /// Whether the softmax is the "quiet" one.
    pub quiet_softmax: bool,
}

impl From<MultiHeadAttention> for ParallelAttention {
    fn from(mha: MultiHeadAttention) -> Self {
        note_heads(mha.query.weight.id, mha.n_heads);
        Self {
            query: mha.query.into(),
            key: mha.key.into(),
            value: mha.value.into(),
            output: mha.output.into(),
            dropout: mha.dropout,
            d_model: mha.d_model,
            n_heads: mha.n_heads,
            d_k: mha.d_k,
            min_float: mha.min_float,
            quiet_softmax: mha.quiet_softmax,
        }
    }
}

impl ParallelAttention {
    /// Self-attention over `x` `[batch, seq, d_model]` with this rank's heads, then the output projection (whole
    /// after its all-reduce): `[batch, seq, d_model]`.
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let query = self.query.forward(x.clone());
        let key = self.key.forward(x.clone());
        let value = self.value.forward(x);
        self.attend(query, key, value, mask_pad, mask_attn)
    }

    /// Causal self-attention over `x` `[batch, seq, d_model]`, then the output projection: [`forward`](Self::forward)
    /// with the causal mask, and under context parallelism (`x` this rank's slice of the sequence) attending to
    /// every rank's positions before each of its own through
    /// [`context_parallel::attention`](crate::context_parallel::attention).
    pub fn forward_causal(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, _] = x.dims();
        if crate::context_parallel::group::active().is_none() {
            let mask = generate_autoregressive_mask(batch, seq, &x.device());
            return self.forward(x, None, Some(mask));
        }
        let query = self.query.forward(x.clone());
        let key = self.key.forward(x.clone());
        let value = self.value.forward(x);
        self.attend_context(query, key, value, true)
    }

    /// Attention through the context group of this rank's heads of `query`, `key`, `value` `[batch, seq, heads *
    /// d_k]`, then the output projection.
    fn attend_context(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        causal: bool,
    ) -> Tensor<3> {
        if self.dropout.prob > 0.0 {
            crate::graph_cut::misused(format!(
                "context parallelism: attention dropout {} (its probabilities are never whole on one rank): \
                 train with dropout 0 under cp_size > 1",
                self.dropout.prob
            ));
        }
        let [batch, seq, _] = query.dims();
        let heads = |y: Tensor<3>| {
            let width = y.dims()[2];
            y.reshape([batch, seq, width / self.d_k, self.d_k])
                .swap_dims(1, 2)
        };
        let local_heads = query.dims()[2] / self.d_k;
        let context =
            crate::context_parallel::attention(heads(query), heads(key), heads(value), causal)
                .swap_dims(1, 2)
                .reshape([batch, seq, local_heads * self.d_k]);
        self.output.forward(context)
    }

    /// Whether sequence parallelism can run this attention on a rank's positions (`forward_parts`): its
    /// projections split the Megatron way.
    pub(crate) fn splits_for_sequence(&self) -> bool {
        use super::linear::LinearLayout::{Columns, Rows};
        [&self.query, &self.key, &self.value]
            .iter()
            .all(|l| l.layout() == Columns)
            && self.output.layout() == Rows
    }

    /// [`forward`](Self::forward) under sequence parallelism from this rank's positions `part`: the queries, keys and
    /// values of the whole sequence from one all-gather, only the part kept for the backward pass; the output this
    /// rank's positions.
    pub(crate) fn forward_parts(
        &self,
        part: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        crate::tensor_parallel::cut::split_ran();
        let mut projected = crate::tensor_parallel::sequence::columns(
            part,
            vec![
                self.query.weight_and_bias(),
                self.key.weight_and_bias(),
                self.value.weight_and_bias(),
            ],
            "attention input gather",
        )
        .into_iter();
        match (projected.next(), projected.next(), projected.next()) {
            (Some(query), Some(key), Some(value)) => {
                self.attend(query, key, value, mask_pad, mask_attn)
            }
            _ => unreachable!("three projections in, three out"),
        }
    }

    /// Attention over this rank's heads of `query`, `key`, `value` `[batch, seq, heads * d_k]`, then the output
    /// projection.
    fn attend(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        if crate::context_parallel::group::active().is_some() {
            if mask_pad.is_some() || mask_attn.is_some() {
                crate::graph_cut::misused(
                    "context parallelism: an attention mask passed to `ParallelAttention::forward` (a mask of \
                     this rank's slice cannot say which of the other ranks' positions to hide): the ring needs the \
                     causal one; call `forward_causal` (`ParallelTransformerLayer::forward_causal`), or \
                     `context_parallel::attention(q, k, v, true)` from your own attention"
                        .into(),
                );
            }
            return self.attend_context(query, key, value, false);
        }
        let [batch, seq, _] = query.dims();
        let heads = |y: Tensor<3>| {
            let width = y.dims()[2];
            y.reshape([batch, seq, width / self.d_k, self.d_k])
                .swap_dims(1, 2)
        };
        let query = heads(query);
        let key = heads(key);
        let value = heads(value);
        let local_heads = query.dims()[1];
        let mut scores = query
            .matmul(key.transpose())
            .div_scalar((self.d_k as f32).sqrt());
        if let Some(mask_pad) = mask_pad {
            let [b, s] = mask_pad.dims();
            scores = scores.mask_fill(mask_pad.reshape([b, 1, 1, s]), self.min_float);
        }
        if let Some(mask_attn) = mask_attn {
            let [b, s1, s2] = mask_attn.dims();
            scores = scores.mask_fill(mask_attn.reshape([b, 1, s1, s2]), self.min_float);
        }
        let weights = if self.quiet_softmax {
            quiet_softmax(scores, 3)
        } else {
            softmax(scores, 3)
        };
        let first_head =
            tp_rank_and_size().0 * local_heads * usize::from(local_heads < self.n_heads);
        let weights = dropout(&self.dropout, weights, Some((1, first_head, self.n_heads)));
        let context =
            weights
                .matmul(value)
                .swap_dims(1, 2)
                .reshape([batch, seq, local_heads * self.d_k]);
        self.output.forward(context)
    }
}
