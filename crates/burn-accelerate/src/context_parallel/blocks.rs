//! Attention over one block of queries and one of keys, as values (no autodiff graph): the forward pass keeping
//! each row's log-sum-exp, two blocks' results merged by it, and the flash-attention backward that recomputes
//! the scores from it. `[batch, heads, positions, width]` throughout.

use burn::tensor::{Bool, Tensor, TensorData};

/// One block's output and each query row's log-sum-exp of its scores, `[b, h, lq, d]` and `[b, h, lq, 1]`.
pub(crate) type Partial = (Tensor<4>, Tensor<4>);

/// The scores `q kᵀ / √d` of a block, the positions `mask` marks (`[lq, lk]`, true where a key comes after its
/// query) set to −∞.
pub(crate) fn scores(q: &Tensor<4>, k: &Tensor<4>, mask: Option<&Tensor<2, Bool>>) -> Tensor<4> {
    let [b, h, lq, d] = q.dims();
    let lk = k.dims()[2];
    let s = q
        .clone()
        .matmul(k.clone().swap_dims(2, 3))
        .div_scalar((d as f32).sqrt());
    match mask {
        Some(mask) => s.mask_fill(
            mask.clone().reshape([1, 1, lq, lk]).expand([b, h, lq, lk]),
            f32::NEG_INFINITY,
        ),
        None => s,
    }
}

/// The attention of queries `q` to the block `k`, `v`: its output (normalised over the block) and each row's
/// log-sum-exp. Every row must see at least one key.
pub(crate) fn forward(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<&Tensor<2, Bool>>,
) -> Partial {
    let s = scores(q, k, mask);
    let max = s.clone().max_dim(3);
    let p = (s - max.clone()).exp();
    let sum = p.clone().sum_dim(3);
    let o = p.matmul(v.clone()).div(sum.clone());
    (o, max + sum.log())
}

/// Two partial results of the same queries over different keys, merged: the log-sum-exp rule.
pub(crate) fn merge(a: Option<Partial>, b: Partial) -> Partial {
    let Some((o1, l1)) = a else { return b };
    let (o2, l2) = b;
    let max = l1.clone().max_pair(l2.clone());
    let lse = max.clone() + ((l1.clone() - max.clone()).exp() + (l2.clone() - max).exp()).log();
    let o = o1 * (l1 - lse.clone()).exp() + o2 * (l2 - lse.clone()).exp();
    (o, lse)
}

/// The gradients of one block's queries, keys and values given the output's gradient `d_out`, the rows'
/// whole log-sum-exp `lse` and `delta = rowsum(d_out ∘ out)` (flash attention's backward pass).
pub(crate) fn backward(
    (q, k, v): (&Tensor<4>, &Tensor<4>, &Tensor<4>),
    mask: Option<&Tensor<2, Bool>>,
    d_out: &Tensor<4>,
    lse: &Tensor<4>,
    delta: &Tensor<4>,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let scale = 1.0 / (q.dims()[3] as f32).sqrt();
    let p = (scores(q, k, mask) - lse.clone()).exp();
    let dv = p.clone().swap_dims(2, 3).matmul(d_out.clone());
    let dp = d_out.clone().matmul(v.clone().swap_dims(2, 3));
    let ds = p * (dp - delta.clone());
    let dq = ds.clone().matmul(k.clone()).mul_scalar(scale);
    let dk = ds.swap_dims(2, 3).matmul(q.clone()).mul_scalar(scale);
    (dq, dk, dv)
}

/// The causal mask of queries at positions `queries` over keys at `keys`: true where a key comes after its query.
pub(crate) fn causal_mask(
    queries: &[usize],
    keys: &[usize],
    device: &burn::tensor::Device,
) -> Tensor<2, Bool> {
    let data: Vec<bool> = queries
        .iter()
        .flat_map(|&q| keys.iter().map(move |&k| k > q))
        .collect();
    Tensor::from_data(TensorData::new(data, [queries.len(), keys.len()]), device)
}
