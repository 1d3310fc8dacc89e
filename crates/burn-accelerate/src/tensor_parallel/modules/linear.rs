//! [`ParallelLinear`]: Burn's `Linear` (the same record: `weight` `[d_input, d_output]`, `bias`), split by a plan
//! by columns (output features) or by rows (input features).

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn::tensor::module::linear;

use crate::tensor_parallel::context::tp_rank_and_size;
use crate::tensor_parallel::cut::{
    gather_from_region, in_region, misused, reduce_from_region, split_ran,
};
use crate::tensor_parallel::sequence;

/// How a [`ParallelLinear`] is held on this rank, read from its weight's shape against the whole layer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearLayout {
    /// Every rank holds the whole layer.
    Whole,
    /// This rank holds a range of output features (Megatron's column-parallel layer): its output is split.
    Columns,
    /// This rank holds a range of input features (the row-parallel layer): its input is split, its partial
    /// outputs are summed over the group, the bias added once after.
    Rows,
}

/// A linear layer that a [`TensorParallelPlan`](crate::tensor_parallel::TensorParallelPlan) can split over the
/// tensor-parallel ranks: Burn's `Linear` with the same record (checkpoints and PyTorch-layout files map
/// unchanged), whole until a plan splits it.
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Tensor;
/// use burn_accelerate::tensor_parallel::{LinearLayout, ParallelLinear};
///
/// let device = Default::default();
/// let layer = ParallelLinear::from(LinearConfig::new(4, 8).init(&device));
/// assert_eq!(layer.layout(), LinearLayout::Whole);
/// let y = layer.forward(Tensor::<2>::ones([3, 4], &device));
/// assert_eq!(y.dims(), [3, 8]);
/// ```
#[derive(Module, Debug)]
pub struct ParallelLinear {
    /// The weight `[d_input, d_output]`, or this rank's columns or rows of it.
    pub weight: Param<Tensor<2>>,
    /// The bias `[d_output]` (this rank's columns under a column split; whole under a row split).
    pub bias: Option<Param<Tensor<1>>>,
    /// The whole layer's input features.
    pub d_input: usize,
    /// The whole layer's output features.
    pub d_output: usize,
}

impl From<Linear> for ParallelLinear {
    fn from(layer: Linear) -> Self {
        let [d_input, d_output] = layer.weight.lazy_shape().dims();
        Self {
            weight: layer.weight,
            bias: layer.bias,
            d_input,
            d_output,
        }
    }
}

impl ParallelLinear {
    /// How this rank holds the layer.
    pub fn layout(&self) -> LinearLayout {
        let [rows, cols] = self.weight.lazy_shape().dims();
        if rows < self.d_input {
            LinearLayout::Rows
        } else if cols < self.d_output {
            LinearLayout::Columns
        } else {
            LinearLayout::Whole
        }
    }

    /// The weight and the bias as the forward pass uses them.
    pub(crate) fn weight_and_bias(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        (self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }

    /// The first output feature (of the whole layer's) this rank holds.
    pub fn output_offset(&self) -> usize {
        match self.layout() {
            LinearLayout::Columns => tp_rank_and_size().0 * self.weight.lazy_shape().dims::<2>()[1],
            _ => 0,
        }
    }

    /// `x · weight + bias` of the layer as this rank holds it: whole, this rank's output features (column split),
    /// or the whole output from this rank's input features (row split: the partial products summed over the
    /// group, then the bias; under sequence parallelism this rank's positions of the sum). A split layer runs
    /// inside [`residual`](crate::tensor_parallel::residual) or [`region`](crate::tensor_parallel::region), which
    /// sum its input's gradient over the group; elsewhere the next backward pass fails, naming the layer's size.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let layout = self.layout();
        if layout != LinearLayout::Whole && !in_region() {
            misused(format!(
                "tensor parallelism: a ParallelLinear [{} x {}] split by {layout:?} ran outside a tensor-parallel \
                 region: call it inside `tensor_parallel::residual(x, |h| ...)` or `tensor_parallel::region(x, \
                 |h| ...)`, which sum its input's gradient over the tensor-parallel ranks",
                self.d_input, self.d_output
            ));
        }
        if layout != LinearLayout::Whole {
            split_ran();
        }
        let bias = self.bias.as_ref().map(|b| b.val());
        match layout {
            LinearLayout::Whole | LinearLayout::Columns => linear(x, self.weight.val(), bias),
            LinearLayout::Rows => {
                // Under sequence parallelism each rank keeps its positions of the sum.
                let whole = match sequence::active() {
                    Some(_) => {
                        sequence::row_parallel(x, self.weight.val(), "row-parallel linear output")
                    }
                    None => reduce_from_region(
                        linear(x, self.weight.val(), None),
                        "row-parallel linear output",
                    ),
                };
                match bias {
                    Some(b) => whole + b.unsqueeze(),
                    None => whole,
                }
            }
        }
    }

    /// [`forward`](Self::forward) with a column split's output gathered whole on every rank (each rank's
    /// gradient its own columns'): a column-parallel head whose logits the loss reads whole. Inside
    /// [`region`](crate::tensor_parallel::region).
    pub fn forward_gathered<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let y = self.forward(x);
        match self.layout() {
            LinearLayout::Columns => {
                gather_from_region(y, D - 1, "column-parallel linear output gather")
            }
            _ => y,
        }
    }
}
