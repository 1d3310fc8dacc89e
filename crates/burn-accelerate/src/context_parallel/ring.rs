//! Ring attention (Liu et al., 2023): each rank keeps its queries and passes key/value blocks around the context
//! group, one rank's per step; each step's partial result is merged into the running one by log-sum-exp, and
//! blocks a causal mask hides entirely are skipped. The backward pass keeps only the output and each row's
//! log-sum-exp from the forward pass: it passes the keys and values around again, recomputes each step's scores,
//! and sends the keys' and values' gradients around with them, so that each arrives back at its owner.
//!
//! Per attention and training step, each rank sends `cp − 1` key/value blocks in the forward pass, and `cp − 1`
//! key/value blocks plus `cp` gradient blocks in the backward pass, a block being `2 × batch × heads × seq / cp ×
//! width` values.

use std::sync::Arc;

use burn::tensor::{Bool, Tensor};

use super::blocks::{self, Partial};
use super::group::{CpContext, count};
use super::split::ContextSplit;
use crate::distributed::tensor_comm::Incoming;
use crate::error::Result;
use crate::graph_cut::{Passes, Pending, Roots, constant, leaf, record};

/// The error of a context-parallel attention, and an output for the forward pass to go on with.
pub(crate) type Failed = Box<(crate::error::Error, Tensor<4>)>;

/// How a query chunk meets a key chunk under the mask.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Meet {
    /// Every key before every query (or no mask).
    Whole,
    /// The same chunk: the causal triangle.
    Diagonal,
}

/// The ring of one attention call: this rank's context group, the split of the sequence, whether the mask is
/// causal, and the diagonal blocks' mask.
struct Ring<'a> {
    ctx: &'a CpContext,
    split: ContextSplit,
    causal: bool,
    diagonal: Tensor<2, Bool>,
}

impl<'a> Ring<'a> {
    fn new(
        ctx: &'a CpContext,
        split: ContextSplit,
        causal: bool,
        device: &burn::tensor::Device,
    ) -> Self {
        let positions: Vec<usize> = (0..split.chunk_len()).collect();
        let diagonal = blocks::causal_mask(&positions, &positions, device);
        Self {
            ctx,
            split,
            causal,
            diagonal,
        }
    }

    /// The pairs `(query chunk, key chunk, meet)` this rank computes with the keys of rank `owner`.
    fn pairs(&self, owner: usize) -> Vec<(usize, usize, Meet)> {
        let mine = self.split.chunks_of(self.ctx.rank);
        let theirs = self.split.chunks_of(owner);
        let mut pairs = Vec::with_capacity(4);
        for (i, &a) in mine.iter().enumerate() {
            for (j, &b) in theirs.iter().enumerate() {
                match (self.causal, b.cmp(&a)) {
                    (false, _) | (true, std::cmp::Ordering::Less) => {
                        pairs.push((i, j, Meet::Whole))
                    }
                    (true, std::cmp::Ordering::Equal) => pairs.push((i, j, Meet::Diagonal)),
                    (true, std::cmp::Ordering::Greater) => {}
                }
            }
        }
        pairs
    }

    fn mask(&self, meet: Meet) -> Option<&Tensor<2, Bool>> {
        (meet == Meet::Diagonal).then_some(&self.diagonal)
    }

    fn chunk(&self, t: &Tensor<4>, i: usize) -> Tensor<4> {
        let c = self.split.chunk_len();
        t.clone().narrow(2, i * c, c)
    }

    /// Sends `k` and `v` to the next rank and receives the previous rank's (the same shapes), as one batch: two
    /// messages, each a view of its tensor (no copy here).
    fn pass(
        &self,
        k: &Tensor<4>,
        v: &Tensor<4>,
        operation: &'static str,
    ) -> Result<crate::distributed::tensor_comm::Pending<Vec<Tensor<1>>>> {
        let (rank, size) = (self.ctx.rank, self.ctx.size);
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        let mut sends = Vec::with_capacity(2);
        let mut recvs = Vec::with_capacity(2);
        for t in [k, v] {
            let len = t.shape().num_elements();
            recvs.push(Incoming {
                peer: prev,
                len,
                device: t.device(),
                dtype: t.dtype(),
            });
            count(0, (len * t.dtype().size()) as u64, 0);
            sends.push((next, t.clone().reshape([len])));
        }
        self.ctx.comm.send_recv(sends, recvs, operation)
    }

    /// The forward pass: this rank's output and each row's log-sum-exp.
    fn forward(&self, q: &Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Result<Partial> {
        let (rank, size) = (self.ctx.rank, self.ctx.size);
        let queries: Vec<Tensor<4>> = (0..2).map(|i| self.chunk(q, i)).collect();
        let mut merged: Vec<Option<Partial>> = vec![None, None];
        let (mut k, mut v) = (k, v);
        for step in 0..size {
            let owner = (rank + size - step) % size;
            // The next block travels while this one is computed.
            let next = match step + 1 < size {
                true => Some(self.pass(&k, &v, "context-parallel ring key/value pass")?),
                false => None,
            };
            for (i, j, meet) in self.pairs(owner) {
                let (kj, vj) = (self.chunk(&k, j), self.chunk(&v, j));
                let [b, h, c, _] = kj.dims();
                count((b * h * c * c) as u64, 0, 0);
                let part = blocks::forward(&queries[i], &kj, &vj, self.mask(meet));
                merged[i] = Some(blocks::merge(merged[i].take(), part));
            }
            if let Some(next) = next {
                (k, v) = unpack(next.wait()?, &k, &v)?;
            }
        }
        let (outs, lses): (Vec<_>, Vec<_>) = merged
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                // A chunk with no key before it cannot be (its own chunk is always met); zeros keep the shape.
                m.unwrap_or_else(|| {
                    let o = queries[i].clone().zeros_like();
                    let l = o.clone().narrow(3, 0, 1);
                    (o, l)
                })
            })
            .unzip();
        Ok((Tensor::cat(outs, 2), Tensor::cat(lses, 2)))
    }

    /// The backward pass: the gradients of this rank's queries, keys and values.
    fn backward(
        &self,
        (q, k, v): (&Tensor<4>, &Tensor<4>, &Tensor<4>),
        (out, lse): (&Tensor<4>, &Tensor<4>),
        d_out: &Tensor<4>,
    ) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>)> {
        let (rank, size) = (self.ctx.rank, self.ctx.size);
        let queries: Vec<Tensor<4>> = (0..2).map(|i| self.chunk(q, i)).collect();
        let d_outs: Vec<Tensor<4>> = (0..2).map(|i| self.chunk(d_out, i)).collect();
        let lses: Vec<Tensor<4>> = (0..2).map(|i| self.chunk(lse, i)).collect();
        let deltas: Vec<Tensor<4>> = (0..2)
            .map(|i| (d_outs[i].clone() * self.chunk(out, i)).sum_dim(3))
            .collect();
        let mut dq: Vec<Tensor<4>> = queries.iter().map(|t| t.clone().zeros_like()).collect();
        let (mut k, mut v) = (k.clone(), v.clone());
        // The gradients of the keys and values this rank holds, travelling with them.
        let (mut dk, mut dv) = (k.clone().zeros_like(), v.clone().zeros_like());
        for step in 0..size {
            let owner = (rank + size - step) % size;
            let next = match step + 1 < size {
                true => Some(self.pass(&k, &v, "context-parallel ring key/value pass")?),
                false => None,
            };
            let mut dks: Vec<Option<Tensor<4>>> = vec![None, None];
            let mut dvs: Vec<Option<Tensor<4>>> = vec![None, None];
            for (i, j, meet) in self.pairs(owner) {
                let (kj, vj) = (self.chunk(&k, j), self.chunk(&v, j));
                let (dqi, dkj, dvj) = blocks::backward(
                    (&queries[i], &kj, &vj),
                    self.mask(meet),
                    &d_outs[i],
                    &lses[i],
                    &deltas[i],
                );
                dq[i] = dq[i].clone() + dqi;
                dks[j] = Some(dks[j].take().map_or(dkj.clone(), |a| a + dkj));
                dvs[j] = Some(dvs[j].take().map_or(dvj.clone(), |a| a + dvj));
            }
            let add = |acc: Tensor<4>, parts: Vec<Option<Tensor<4>>>| {
                let c = self.split.chunk_len();
                let whole: Vec<Tensor<4>> = parts
                    .into_iter()
                    .enumerate()
                    .map(|(j, p)| p.unwrap_or_else(|| acc.clone().narrow(2, j * c, c).zeros_like()))
                    .collect();
                acc + Tensor::cat(whole, 2)
            };
            dk = add(dk, dks);
            dv = add(dv, dvs);
            if let Some(next) = next {
                (k, v) = unpack(next.wait()?, &k, &v)?;
            }
            // The gradients go on with their keys; after the last step they reach their owner.
            let back = self
                .pass(&dk, &dv, "context-parallel ring key/value gradient pass")?
                .wait()?;
            (dk, dv) = unpack(back, &dk, &dv)?;
        }
        Ok((Tensor::cat(dq, 2), dk, dv))
    }
}

/// The two tensors a [`Ring::pass`] received, in the shapes of `k` and `v`.
///
/// # Errors
/// A transport that returned other than one tensor per receive.
fn unpack(
    received: Vec<Tensor<1>>,
    k: &Tensor<4>,
    v: &Tensor<4>,
) -> Result<(Tensor<4>, Tensor<4>)> {
    let n = received.len();
    let mut received = received.into_iter();
    match (received.next(), received.next()) {
        (Some(rk), Some(rv)) => Ok((rk.reshape(k.dims()), rv.reshape(v.dims()))),
        _ => Err(crate::error::Error::other(format!(
            "context parallelism: the ring's transport returned {n} tensor(s) for 2 receives"
        ))),
    }
}

/// The ring mode of [`attention`](super::attention): its output, behind a cut whose backward half is the ring's.
pub(crate) fn attention(
    ctx: &Arc<CpContext>,
    split: ContextSplit,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    tracked: bool,
) -> std::result::Result<Tensor<4>, Failed> {
    let ring = Ring::new(ctx, split.clone(), causal, &q.device());
    let (out, lse) = match ring.forward(
        &constant(q.clone()),
        constant(k.clone()),
        constant(v.clone()),
    ) {
        Ok(done) => done,
        Err(e) => {
            let zeros = constant(q.clone()).zeros_like();
            return Err(Box::new((e, zeros)));
        }
    };
    count(0, 0, 1);
    if !tracked {
        return Ok(out);
    }
    let leaf_out = leaf(out.clone());
    record(Box::new(RingCut {
        ctx: ctx.clone(),
        split,
        causal,
        sources: (q, k, v),
        saved: (out, lse),
        leaf: leaf_out.clone(),
    }));
    Ok(leaf_out)
}

/// The backward half of the ring mode.
struct RingCut {
    ctx: Arc<CpContext>,
    split: ContextSplit,
    causal: bool,
    sources: (Tensor<4>, Tensor<4>, Tensor<4>),
    saved: (Tensor<4>, Tensor<4>),
    leaf: Tensor<4>,
}

impl Pending for RingCut {
    fn finish(self: Box<Self>, passes: &mut Passes) -> Result<()> {
        // Every rank goes around the ring, a rank whose output reached no loss with a zero gradient.
        let d_out = passes.remove_or_zeros(&self.leaf);
        let (q, k, v) = self.sources;
        let ring = Ring::new(&self.ctx, self.split, self.causal, &q.device());
        let (qc, kc, vc) = (
            constant(q.clone()),
            constant(k.clone()),
            constant(v.clone()),
        );
        let (dq, dk, dv) =
            ring.backward((&qc, &kc, &vc), (&self.saved.0, &self.saved.1), &d_out)?;
        let mut roots = Roots::default();
        roots.add(q, dq);
        roots.add(k, dk);
        roots.add(v, dv);
        roots.backward_into(passes);
        Ok(())
    }
}
