//! Dropout masks that tensor parallelism can reproduce (Megatron's RNG tracker): drawn from a counter-based
//! stream keyed by the run's seed, the data-parallel rank, the backward pass they belong to and the draw's place
//! in it, never from the device's generator, so that
//!
//! - in a replicated part (the residual stream) every rank of a tensor-parallel group draws the same mask, the
//!   mask one process draws;
//! - in a split part (attention probabilities over a rank's heads, a feed-forward's columns) each rank draws its
//!   own: each row of the split dimension has a stream of its own, keyed by its index in the whole, so each rank's
//!   slice differs from its peers' and equals the matching slice of one process's mask;
//! - activation checkpointing, which runs a block again in the backward pass, draws the same masks (the block-wise
//!   runtime puts the draw counter back to where the block first began).

use std::cell::RefCell;

use burn::nn::Dropout;
use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::context::current;

#[derive(Debug, Clone, Copy)]
struct Draws {
    seed: u64,
    pass: u64,
    site: u64,
}

thread_local! {
    static DRAWS: RefCell<Draws> = const { RefCell::new(Draws { seed: 0x5eed_7e45, pass: 0, site: 0 }) };
}

/// Seeds this thread's tensor-parallel dropout masks (Megatron's `model_parallel_cuda_manual_seed`); called by
/// [`Accelerator::set_seed`](crate::Accelerator::set_seed).
pub fn manual_seed(seed: u64) {
    DRAWS.with(|d| {
        let mut d = d.borrow_mut();
        *d = Draws {
            seed,
            pass: 0,
            site: 0,
        };
    });
}

/// A backward pass ended: the next forward pass draws masks of its own. Where nothing was drawn since the last
/// call (a backward pass that called it already on its way), nothing changes, so that every path through a
/// backward pass (whole, block by block, recomputed) counts the passes alike.
pub(crate) fn next_pass() {
    DRAWS.with(|d| {
        let mut d = d.borrow_mut();
        if d.site > 0 {
            d.pass += 1;
            d.site = 0;
        }
    });
}

/// Where the next draw of this pass is (to draw a block's masks again when it is recomputed).
pub(crate) fn site() -> u64 {
    DRAWS.with(|d| d.borrow().site)
}

/// Puts the next draw back to `site`.
pub(crate) fn set_site(site: u64) {
    DRAWS.with(|d| d.borrow_mut().site = site);
}

/// Runs `f` (a pass run again: a recomputed block, a part made anew in the backward pass) with its draws from
/// `site`, where its first run's began, so that it draws the same masks; the next draws then go on where they were.
pub(crate) fn again_at<T>(site: u64, f: impl FnOnce() -> T) -> T {
    let resume = DRAWS.with(|d| std::mem::replace(&mut d.borrow_mut().site, site));
    let out = f();
    set_site(resume);
    out
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0u64, |k, p| splitmix64(k ^ splitmix64(*p)))
}

/// `dropout` applied to `x` with a mask tensor parallelism can reproduce (Megatron's RNG tracker): `split` is `None`
/// in a replicated part, else `Some((dim, offset, whole))`: `x` holds rows `offset..offset + x.dims()[dim]` of
/// `whole` along `dim`. Inactive (evaluation, no autodiff, probability 0) exactly where Burn's `Dropout` is.
///
/// The mask comes from a counter-based stream keyed by the seed ([`manual_seed`], which
/// [`Accelerator::set_seed`](crate::Accelerator::set_seed) calls), the data-parallel rank, the backward pass and the
/// draw's place in it, never from the device's generator: in a replicated part every rank of a tensor-parallel group
/// draws one process's mask; in a split part each row of the split dimension has a stream of its own, keyed by its
/// index in the whole, so each rank's slice differs from its peers' and equals one process's slice there; a block
/// recomputed by activation checkpointing draws its masks again.
pub fn dropout<const D: usize>(
    dropout: &Dropout,
    x: Tensor<D>,
    split: Option<(usize, usize, usize)>,
) -> Tensor<D> {
    if !dropout.training.is_enabled() || !x.device().is_autodiff() || dropout.prob == 0.0 {
        return x;
    }
    let keep = 1.0 - dropout.prob;
    let draws = DRAWS.with(|d| {
        let mut d = d.borrow_mut();
        let now = *d;
        d.site += 1;
        now
    });
    let dp = current().map_or(0, |c| c.dp_index as u64);
    let base = key(&[draws.seed, dp, draws.pass, draws.site]);
    let dims = x.dims();
    let (dim, offset) = match split {
        Some((dim, offset, _)) => (dim, offset),
        None => (0, 0),
    };
    let rows = dims[dim];
    let per_row = dims.iter().product::<usize>() / rows.max(1);
    let mut values = Vec::with_capacity(rows * per_row);
    match split {
        None => {
            let mut rng = ChaCha8Rng::seed_from_u64(base);
            values.extend(
                (0..rows * per_row).map(|_| f32::from(u8::from(rng.random::<f32>() < keep as f32))),
            );
        }
        Some(_) => {
            for r in 0..rows {
                let mut rng = ChaCha8Rng::seed_from_u64(key(&[base, (offset + r) as u64]));
                values.extend(
                    (0..per_row).map(|_| f32::from(u8::from(rng.random::<f32>() < keep as f32))),
                );
            }
        }
    }
    // Drawn with the split dimension first (each row's values together), then moved back to its place.
    let mut moved = dims;
    moved.swap(0, dim);
    let device = x.device();
    let mask = Tensor::<D>::from_data(TensorData::new(values, moved), (&device, x.dtype()))
        .swap_dims(0, dim);
    (x * mask).mul_scalar(1.0 / keep)
}
