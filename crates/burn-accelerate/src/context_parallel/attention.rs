//! [`attention`]: the building block a model's attention calls, whole on one rank, over the context group under
//! context parallelism (all-gather or ring), behind a cut of the autodiff graph whose backward half sends the
//! keys' and values' gradients back to the ranks that hold them.

use std::sync::Arc;

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

use super::blocks::causal_mask;
use super::group::{CpContext, active, count, routed};
use super::ring::{self, Failed};
use crate::config::ContextAttention;
use crate::error::Result;
use crate::graph_cut::{Passes, Pending, Roots, constant, in_region, leaf, misused, record};

/// Scaled dot-product attention of `q` over `k` and `v`, `[batch, heads, positions, width]` each (the same
/// positions for the three: self-attention), causal or not: `softmax(q kᵀ / √width) v`.
///
/// On one rank this is the whole sequence's attention. Under context parallelism (`cp_size` > 1) each rank
/// passes its slice of the sequence ([`ContextSplit`](super::ContextSplit)) and gets its queries' attention over
/// every rank's keys and values: gathered whole (`cp_comm_strategy = allgather`) or passed around the ranks a
/// block at a time (`ring`), the causal mask following each position's place in the whole sequence. The
/// attention is a segment of its own in the backward pass, so it must run inside a region whose residual is cut
/// too: [`tensor_parallel::residual`](crate::tensor_parallel::residual), as
/// [`ParallelTransformerLayer::forward_causal`](crate::tensor_parallel::ParallelTransformerLayer::forward_causal)
/// does; the next backward pass fails, naming it, where it is not.
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_accelerate::context_parallel::attention;
///
/// let device = Default::default();
/// let q = Tensor::<4>::ones([1, 2, 4, 8], &device);
/// let v = Tensor::<4>::ones([1, 2, 4, 8], &device).mul_scalar(3.0);
/// let out = attention(q.clone(), q, v, true);
/// assert_eq!(out.dims(), [1, 2, 4, 8]);
/// assert!((out.into_data().to_vec::<f32>().unwrap()[0] - 3.0).abs() < 1e-6);
/// ```
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let Some(ctx) = active() else {
        return local(q, k, v, causal);
    };
    routed();
    let tracked = q.is_tracked() || k.is_tracked() || v.is_tracked();
    if tracked && !in_region() {
        misused(
            "context parallelism: `context_parallel::attention` ran outside a region, so its residual path is \
             not cut and the earlier graph would be walked twice: run the attention sub-layer inside \
             `tensor_parallel::residual(x, norm, |h| ...)` (as `ParallelTransformerLayer::forward_causal` does)"
                .into(),
        );
    }
    let split = match ctx.split_of_local(q.dims()[2]) {
        Ok(split) => split,
        Err(e) => {
            misused(e.to_string());
            return local(q, k, v, causal);
        }
    };
    let out = match ctx.mode {
        ContextAttention::AllGather => gathered(&ctx, &split, q, k, v, causal, tracked),
        ContextAttention::Ring => ring::attention(&ctx, split, q, k, v, causal, tracked),
    };
    match out {
        Ok(out) => out,
        Err(failed) => {
            let (e, fallback) = *failed;
            // A forward pass cannot fail: the next backward pass does, with the collective's error.
            misused(format!("context parallelism: {e}"));
            fallback
        }
    }
}

/// The whole sequence's attention on one rank.
fn local(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let [b, h, lq, _] = q.dims();
    let lk = k.dims()[2];
    count((b * h * lq * lk) as u64, 0, 1);
    let mask = causal.then(|| {
        let positions: Vec<usize> = (0..lq).collect();
        causal_mask(&positions, &positions, &q.device())
    });
    dense(q, k, v, mask)
}

/// `softmax(q kᵀ / √d, masked) v`, through Burn's autodiff.
fn dense(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Option<Tensor<2, Bool>>) -> Tensor<4> {
    let [b, h, lq, d] = q.dims();
    let lk = k.dims()[2];
    let mut scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f32).sqrt());
    if let Some(mask) = mask {
        scores = scores.mask_fill(
            mask.reshape([1, 1, lq, lk]).expand([b, h, lq, lk]),
            f32::NEG_INFINITY,
        );
    }
    softmax(scores, 3).matmul(v)
}

/// The all-gather mode: every rank's keys and values gathered (in rank order), this rank's queries attending
/// to them through Burn's autodiff; the cut reduce-scatters their gradients back.
fn gathered(
    ctx: &Arc<CpContext>,
    split: &super::ContextSplit,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    tracked: bool,
) -> std::result::Result<Tensor<4>, Failed> {
    let [b, h, lq, d] = q.dims();
    let kv = Tensor::cat(vec![constant(k.clone()), constant(v.clone())], 3);
    let whole = match ctx.all_gather(kv, 2, "context-parallel key/value all-gather") {
        Ok(whole) => whole,
        Err(e) => return Err(Box::new((e, local(q, k, v, causal)))),
    };
    let dv = whole.dims()[3] - d;
    let (kg, vg) = (whole.clone().narrow(3, 0, d), whole.narrow(3, d, dv));
    let mask = causal.then(|| {
        let keys: Vec<usize> = (0..ctx.size).flat_map(|r| split.positions_of(r)).collect();
        causal_mask(&split.positions(), &keys, &q.device())
    });
    count((b * h * lq * kg.dims()[2]) as u64, 0, 1);
    if !tracked {
        return Ok(dense(q, kg, vg, mask));
    }
    let (ql, kl, vl) = (leaf(q.clone()), leaf(kg), leaf(vg));
    let out = dense(ql.clone(), kl.clone(), vl.clone(), mask);
    record(Box::new(GatheredCut {
        ctx: ctx.clone(),
        sources: (q, k, v),
        leaves: (ql, kl, vl),
    }));
    Ok(out)
}

/// The backward half of the all-gather mode.
struct GatheredCut {
    ctx: Arc<CpContext>,
    sources: (Tensor<4>, Tensor<4>, Tensor<4>),
    leaves: (Tensor<4>, Tensor<4>, Tensor<4>),
}

impl Pending for GatheredCut {
    fn finish(self: Box<Self>, passes: &mut Passes) -> Result<()> {
        let (q, k, v) = self.sources;
        let (ql, kl, vl) = self.leaves;
        let d = k.dims()[3];
        let dq = passes.remove(&ql);
        // Every rank's gradient of every rank's keys and values, summed to the rank that holds them: every rank
        // takes part, a rank whose queries reached none with zeros.
        let dkv = Tensor::cat(
            vec![passes.remove_or_zeros(&kl), passes.remove_or_zeros(&vl)],
            3,
        );
        let mine = self.ctx.reduce_scatter(
            dkv,
            2,
            "context-parallel key/value gradient reduce-scatter",
        )?;
        let dv = mine.dims()[3] - d;
        let mut roots = Roots::default();
        if let Some(dq) = dq {
            roots.add(q, dq);
        }
        roots.add(k, mine.clone().narrow(3, 0, d));
        roots.add(v, mine.narrow(3, d, dv));
        roots.backward_into(passes);
        Ok(())
    }
}
