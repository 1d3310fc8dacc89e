//! The deep stack the block-wise and pipeline tests train: an input layer, square blocks with tanh, a head; its
//! weights from a fixed formula and its data made up, so that every run of every test starts alike.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_accelerate::Blocks;

/// Width of every block.
pub const WIDTH: usize = 8;

/// An input layer, a stack of square blocks with tanh, and a head: what is outside the blocks is gathered
/// whole, the blocks one at a time.
#[derive(Module, Debug)]
pub struct Deep {
    pub input: Linear,
    pub layers: Vec<Linear>,
    pub head: Linear,
}

impl Blocks for Deep {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.layers
    }
}

/// A stack of `layers` blocks with weights from the fixed formula.
pub fn model(layers: usize, device: &Device) -> Deep {
    deterministic(Deep {
        input: LinearConfig::new(6, WIDTH).init(device),
        layers: (0..layers)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
            .collect(),
        head: LinearConfig::new(WIDTH, 1).init(device),
    })
}

/// `module` with weights drawn from a fixed formula, not from the device's generator (which the tests of this
/// binary share, running at once).
pub fn deterministic<M: Module>(module: M) -> M {
    struct Fill(usize);
    impl ModuleMapper for Fill {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            self.0 += 1;
            let salt = self.0 as f32;
            param.map(|t| {
                let n = t.shape().num_elements();
                let values: Vec<f32> = (0..n)
                    .map(|i| 0.4 * ((i as f32 + 1.0) * 0.731 + salt * 1.37).sin())
                    .collect();
                Tensor::<1>::from_floats(values.as_slice(), &t.device()).reshape(t.dims())
            })
        }
    }
    module.map(&mut Fill(0))
}

/// Rows `first..first + rows` of the synthetic set: inputs and targets.
pub fn batch(first: usize, rows: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..rows * 6)
        .map(|k| ((first + k / 6) as f32 * 0.37 + (k % 6) as f32 * 0.11).sin())
        .collect();
    let y: Vec<f32> = (0..rows)
        .map(|i| ((first + i) as f32 * 0.21).cos())
        .collect();
    (
        Tensor::<1>::from_floats(x.as_slice(), device).reshape([rows, 6]),
        Tensor::<1>::from_floats(y.as_slice(), device).reshape([rows, 1]),
    )
}

/// Each float parameter's values, in visiting order (empty for a placeholder).
pub fn params<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(
                param
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}
