//! Cutting stages by measured compute: each block's forward and backward time on a sample input
//! ([`measure_block_costs`]), and the counts of blocks per stage that balance them ([`stage_blocks_for`]), for
//! `pp_stage_blocks`. (Without counts, stages are balanced by the blocks' parameters, which is what compute
//! follows when every block sees activations of the same size.)

use std::time::Instant;

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::model::balanced_stages;

/// Seconds each of `blocks` takes for a forward and a backward pass, the blocks run in order on `input` (each
/// block fed the previous one's output, as in the model): the median of `repeats` runs after one to warm up.
/// Measure on the model before it is prepared, on the accelerator's device (an autodiff device, so that the
/// backward pass computes the blocks' gradients too), with a micro-batch of the size training will use (one
/// process; a few blocks of each kind will do for a large model).
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::Tensor;
/// use burn_accelerate::pipeline_parallel::{measure_block_costs, stage_blocks_for};
///
/// let device = burn::tensor::Device::default().autodiff(); // or `accelerator.device()`
/// let blocks: Vec<Linear> = [8, 8, 8, 8].iter().map(|&w| LinearConfig::new(w, w).init(&device)).collect();
/// let costs = measure_block_costs(&blocks, Tensor::<2>::ones([4, 8], &device), |b, x| b.forward(x), 3)?;
/// assert_eq!(costs.len(), 4);
/// let counts = stage_blocks_for(&costs, 2)?; // for `AcceleratorBuilder::pp_stage_blocks`
/// assert_eq!(counts.iter().sum::<usize>(), 4);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
///
/// # Errors
/// No blocks, or no repeat.
pub fn measure_block_costs<B, const D: usize>(
    blocks: &[B],
    input: Tensor<D>,
    block: impl Fn(&B, Tensor<D>) -> Tensor<D>,
    repeats: usize,
) -> Result<Vec<f64>> {
    if blocks.is_empty() || repeats == 0 {
        return Err(Error::InvalidArgument(format!(
            "measure_block_costs: {} block(s) and {repeats} repeat(s): give it the model's blocks and at least one \
             repeat",
            blocks.len()
        )));
    }
    let mut x = match input.is_autodiff() {
        true => input.detach(),
        false => input.autodiff(),
    };
    let mut costs = Vec::with_capacity(blocks.len());
    for b in blocks {
        let mut times = Vec::with_capacity(repeats);
        let mut output = None;
        for run in 0..=repeats {
            let start = Instant::now();
            let input = x.clone().require_grad();
            // A timing pass: a tensor-parallel block's cuts are dropped, not finished, the tape left as it was.
            let (y, grads) = crate::graph_cut::without_cuts(|| {
                let y = block(b, input.clone());
                let grads = y.clone().sum().backward();
                (y, grads)
            });
            // Reading one value waits for the device (a GPU backend queues its work).
            if let Some(g) = input.grad(&grads) {
                g.sum().into_data();
            }
            if run > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
            output = Some(y.detach());
        }
        times.sort_by(f64::total_cmp);
        costs.push(times[times.len() / 2]);
        x = output.expect("at least one run");
    }
    Ok(costs)
}

/// How many blocks each of `stages` stages runs so that the costliest stage is as cheap as a contiguous cut
/// allows (`costs[b]`: block `b`'s cost, from [`measure_block_costs`] or your own): the value for
/// `AcceleratorBuilder::pp_stage_blocks` (or `ACCELERATE_PP_STAGE_BLOCKS`). Give the first and last block the cost
/// of what the first and last stage also run (the embedding, the head and the loss) to balance those too.
///
/// # Errors
/// Fewer blocks than stages.
pub fn stage_blocks_for(costs: &[f64], stages: usize) -> Result<Vec<usize>> {
    balanced_stages(costs, stages)
        .map(|ranges| ranges.iter().map(|r| r.len()).collect())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "stage_blocks_for: {} block cost(s) cannot be cut into {stages} stage(s) of at least one block each",
                costs.len()
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_balance_the_costs_and_cover_every_block() {
        assert_eq!(
            stage_blocks_for(&[1.0, 1.0, 1.0, 5.0], 2).unwrap(),
            vec![3, 1]
        );
        assert_eq!(
            stage_blocks_for(&[4.0, 1.0, 1.0, 1.0, 1.0], 2).unwrap(),
            vec![1, 4]
        );
        assert_eq!(stage_blocks_for(&[1.0; 8], 4).unwrap(), vec![2, 2, 2, 2]);
        assert!(stage_blocks_for(&[1.0], 2).is_err());
    }
}
