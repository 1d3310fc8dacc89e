//! [`ParallelTransformerLayer`]: Burn's transformer encoder layer with its attention and feed-forward network
//! split by a plan, and [`ParallelFeedForward`].

use burn::module::Module;
use burn::nn::activation::Activation;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerEncoderConfig, TransformerEncoderLayer,
};
use burn::nn::{Dropout, LayerNorm};
use burn::tensor::{Bool, Device, Tensor};

use super::attention::ParallelAttention;
use super::linear::ParallelLinear;
use crate::tensor_parallel::dropout::dropout;
use crate::tensor_parallel::regions::{residual, residual_of_parts};
use crate::tensor_parallel::sequence;

/// The position-wise feed-forward network (`linear_inner` by columns, `linear_outer` by rows): Burn's
/// `PositionWiseFeedForward` with the same record.
#[derive(Module, Debug)]
pub struct ParallelFeedForward {
    /// Model width to the inner width (by columns).
    pub linear_inner: ParallelLinear,
    /// Inner width back to the model width (by rows).
    pub linear_outer: ParallelLinear,
    /// Dropout after the activation (each rank's columns draw their own masks).
    pub dropout: Dropout,
    /// The activation between them.
    #[module(skip)]
    pub activation: Activation,
}

impl From<PositionWiseFeedForward> for ParallelFeedForward {
    fn from(ff: PositionWiseFeedForward) -> Self {
        Self {
            linear_inner: ff.linear_inner.into(),
            linear_outer: ff.linear_outer.into(),
            dropout: ff.dropout,
            activation: ff.activation,
        }
    }
}

impl ParallelFeedForward {
    /// Whether sequence parallelism can run this network on a rank's positions (`forward_parts`).
    pub(crate) fn splits_for_sequence(&self) -> bool {
        use super::linear::LinearLayout::{Columns, Rows};
        self.linear_inner.layout() == Columns && self.linear_outer.layout() == Rows
    }

    /// [`forward`](Self::forward) under sequence parallelism from this rank's positions `part`: the inner layer's
    /// input all-gathered, only the part kept for the backward pass; the output this rank's positions.
    pub(crate) fn forward_parts<const D: usize>(&self, part: Tensor<D>) -> Tensor<D> {
        crate::tensor_parallel::cut::split_ran();
        let h = crate::tensor_parallel::sequence::columns(
            part,
            vec![self.linear_inner.weight_and_bias()],
            "feed-forward input gather",
        )
        .remove(0);
        self.after_inner(h)
    }

    /// `linear_outer(dropout(activation(linear_inner(x))))`, the inner width this rank's columns.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.after_inner(self.linear_inner.forward(x))
    }

    /// The activation, the dropout and the outer layer, after the inner layer's output `h`.
    fn after_inner<const D: usize>(&self, h: Tensor<D>) -> Tensor<D> {
        let h = self.activation.forward(h);
        let offset = self.linear_inner.output_offset();
        let h = dropout(
            &self.dropout,
            h,
            Some((D - 1, offset, self.linear_inner.d_output)),
        );
        self.linear_outer.forward(h)
    }
}

/// A transformer encoder layer (self-attention and a feed-forward network, pre- or post-norm) that a
/// [`TensorParallelPlan`](crate::tensor_parallel::TensorParallelPlan) splits the Megatron way: Burn's
/// `TransformerEncoderLayer` with the same record paths (`mha.query.weight`, `pwff.linear_inner.bias`, `norm_1`,
/// ...) and, on one rank, the same numbers. Each sub-layer is a tensor-parallel region with its residual around
/// it ([`residual`](crate::tensor_parallel::residual)).
///
/// ```
/// use burn::nn::transformer::TransformerEncoderConfig;
/// use burn::tensor::Tensor;
/// use burn_accelerate::tensor_parallel::ParallelTransformerLayer;
///
/// let device = Default::default();
/// let config = TransformerEncoderConfig::new(8, 16, 2, 1).with_norm_first(true);
/// let layer = ParallelTransformerLayer::new(&config, &device);
/// assert_eq!(layer.forward(Tensor::<3>::ones([1, 3, 8], &device), None, None).dims(), [1, 3, 8]);
/// ```
#[derive(Module, Debug)]
pub struct ParallelTransformerLayer {
    /// Self-attention.
    pub mha: ParallelAttention,
    /// The feed-forward network.
    pub pwff: ParallelFeedForward,
    /// The norm around the feed-forward network.
    pub norm_1: LayerNorm,
    /// The norm around the attention.
    pub norm_2: LayerNorm,
    /// Dropout on each sub-layer's output, before its residual add (the same mask on every rank).
    pub dropout: Dropout,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
}

impl From<TransformerEncoderLayer> for ParallelTransformerLayer {
    fn from(layer: TransformerEncoderLayer) -> Self {
        Self {
            mha: layer.mha.into(),
            pwff: layer.pwff.into(),
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
        }
    }
}

impl ParallelTransformerLayer {
    /// A layer as `config` describes it, initialised as Burn's `TransformerEncoderLayer::new` initialises one.
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        TransformerEncoderLayer::new(config, device).into()
    }

    /// The layer's output for `x` `[batch, seq, d_model]`, as Burn's layer computes it.
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        // The norms run whole, before each region's cut (Megatron's *f* sits after them); the regions hold the
        // split layers and the dropout after their sum.
        // The dropout on each sub-layer's output draws one stream per position of the sequence: under sequence
        // parallelism each rank its positions' part of one process's mask.
        let branch = |y: Tensor<3>| {
            let split = sequence::dropout_split(y.dims()[1], 1);
            dropout(&self.dropout, y, Some(split))
        };
        if sequence::active().is_some()
            && self.mha.splits_for_sequence()
            && self.pwff.splits_for_sequence()
        {
            // Under sequence parallelism each region takes this rank's positions and gathers them itself.
            let attend = |z: Tensor<3>| {
                branch(
                    self.mha
                        .forward_parts(z, mask_pad.clone(), mask_attn.clone()),
                )
            };
            let feed = |z: Tensor<3>| branch(self.pwff.forward_parts(z));
            return if self.norm_first {
                let x = residual_of_parts(x, |h| self.norm_2.forward(h), attend);
                residual_of_parts(x, |h| self.norm_1.forward(h), feed)
            } else {
                let x = self.norm_1.forward(residual_of_parts(x, |h| h, attend));
                self.norm_2.forward(residual_of_parts(x, |h| h, feed))
            };
        }
        self.sub_layers(x, |h| {
            self.mha.forward(h, mask_pad.clone(), mask_attn.clone())
        })
    }

    /// The layer's output for `x` `[batch, seq, d_model]` with causal self-attention: [`forward`](Self::forward)
    /// with the causal mask, and under context parallelism (`x` this rank's slice of each sequence, see
    /// `Accelerator::context_split`) attending across the context group through
    /// [`context_parallel::attention`](crate::context_parallel::attention).
    pub fn forward_causal(&self, x: Tensor<3>) -> Tensor<3> {
        if crate::context_parallel::group::active().is_none() {
            let [batch, seq, _] = x.dims();
            let mask = burn::nn::attention::generate_autoregressive_mask(batch, seq, &x.device());
            return self.forward(x, None, Some(mask));
        }
        let dropout = [self.dropout.prob, self.pwff.dropout.prob]
            .into_iter()
            .fold(0.0, f64::max);
        if dropout > 0.0 || sequence::active().is_some() {
            crate::graph_cut::misused(format!(
                "context parallelism: a ParallelTransformerLayer with {} under cp_size > 1 (each rank's slice of \
                 the sequence is not contiguous, so its masks and parts would not be one process's): train with \
                 dropout 0 and without sequence parallelism",
                match dropout > 0.0 {
                    true => format!("dropout {dropout}"),
                    false => "sequence parallelism".to_string(),
                }
            ));
        }
        self.sub_layers(x, |h| self.mha.forward_causal(h))
    }

    /// Each sub-layer with its residual around it (a tensor-parallel region each), `attend` the attention.
    fn sub_layers(&self, x: Tensor<3>, attend: impl Fn(Tensor<3>) -> Tensor<3>) -> Tensor<3> {
        let branch = |y: Tensor<3>| {
            let split = sequence::dropout_split(y.dims()[1], 1);
            dropout(&self.dropout, y, Some(split))
        };
        let attend = |h: Tensor<3>| branch(attend(h));
        let feed = |h: Tensor<3>| branch(self.pwff.forward(h));
        if self.norm_first {
            let x = residual(x, |h| self.norm_2.forward(h), attend);
            residual(x, |h| self.norm_1.forward(h), feed)
        } else {
            let x = self.norm_1.forward(residual(x, |h| h, attend));
            self.norm_2.forward(residual(x, |h| h, feed))
        }
    }
}
