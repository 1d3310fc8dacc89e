//! The [`Accelerator`]'s collectives, each forwarded to [`collectives`](crate::distributed::collectives) with
//! this rank's process group.

use burn::tensor::Tensor;
use burn::tensor::kind::Basic;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Accelerator;
use crate::distributed::collectives;
use crate::distributed::comm::ReduceOp;
use crate::distributed::{Gatherable, MetricsGather};
use crate::error::Result;

impl Accelerator {
    /// Concatenates every rank's tensor along dimension 0, in rank order; the first dimension may differ
    /// between ranks (no padding is left in the result). See [`collectives::gather`].
    pub fn gather<const D: usize, K: Basic>(&self, tensor: Tensor<D, K>) -> Result<Tensor<D, K>> {
        collectives::gather(&self.group, tensor)
    }

    /// [`gather`](Self::gather) for evaluation: on the last batch of a prepared dataloader, the samples that
    /// `even_batches` repeated to fill the last round are dropped, so metrics see every sample exactly once.
    /// Under a pipeline (`pp_size` > 1) the values are gathered over the data-parallel replicas only: every stage
    /// of a replica holds the same ones ([`forward_batch`](Self::forward_batch) hands the last stage's to all).
    /// Pass per-sample tensors (first dimension = batch), not per-batch aggregates: one tensor, or a tuple,
    /// `Vec`, `Option` or struct of them ([`Gatherable`]), gathered in one call.
    /// Tensors whose first dimension differs between ranks (dynamic padding) go through
    /// [`pad_across_processes`](Self::pad_across_processes) along their other dimensions first.
    pub fn gather_for_metrics<T: Gatherable>(&self, value: T) -> Result<T> {
        let keep = self.gradient_state().samples_to_keep();
        // Under a pipeline every stage holds its replica's values: gathered over the replicas, once each.
        value.gather_for_metrics(&MetricsGather::new(&self.mesh.dp, keep))
    }

    /// [`gather_for_metrics`](Self::gather_for_metrics) for per-sample values that are not tensors (labels,
    /// ids, strings): every rank's items, concatenated in rank order, without the repeated tail.
    pub fn gather_for_metrics_objects<T: Serialize + DeserializeOwned>(
        &self,
        items: &[T],
    ) -> Result<Vec<T>> {
        let mut all: Vec<T> = collectives::gather_object_as::<[T], Vec<T>>(&self.mesh.dp, items)?
            .into_iter()
            .flatten()
            .collect();
        if let Some(keep) = self.gradient_state().samples_to_keep() {
            all.truncate(keep);
        }
        Ok(all)
    }

    /// Combines every rank's tensor with `op` (sum, mean, max, min); every rank gets the result.
    pub fn reduce<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        collectives::reduce(&self.group, tensor, op)
    }

    /// `tensor` combined with `op` over this rank's context group (the ranks holding the other slices of its
    /// sequences, see [`context_split`](Self::context_split)); `tensor` itself with `cp_size` 1. For values per
    /// sequence that each rank computed on its slice: a per-sample loss averaged over a rank's positions becomes the
    /// whole sequence's with `ReduceOp::Mean` (every rank holds as many positions), before `gather_for_metrics`
    /// gathers the samples over the data-parallel ranks.
    ///
    /// # Errors
    /// The collective's (a timeout, a peer that failed).
    pub fn reduce_context<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        match &self.mesh.cp {
            Some(cp) => collectives::reduce(cp, tensor, op),
            None => Ok(tensor),
        }
    }

    /// Returns rank `from`'s tensor on every rank.
    pub fn broadcast<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        from: usize,
    ) -> Result<Tensor<D, K>> {
        collectives::broadcast(&self.group, tensor, from)
    }

    /// Pads `tensor` along `dim` with `pad_value` to the largest size across ranks (after the data, or before
    /// it with `pad_first`).
    pub fn pad_across_processes<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor<D, K>> {
        collectives::pad_across_processes(&self.group, tensor, dim, pad_value, pad_first)
    }

    /// Gathers one serializable value per rank, in rank order (unlike Accelerate, a single process also gets a
    /// one-element `Vec`, and lists are not flattened).
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        collectives::gather_object(&self.group, value)
    }

    /// Returns rank `from`'s value on every rank.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        from: usize,
    ) -> Result<T> {
        collectives::broadcast_object(&self.group, value, from)
    }

    /// This rank's share of `items` (contiguous; the first `len % num_processes` ranks get one more). With
    /// `apply_padding`, every rank gets the same count (shorter shares repeat their last item).
    pub fn split_between_processes<T: Clone>(&self, items: &[T], apply_padding: bool) -> Vec<T> {
        collectives::split_between_processes(
            items,
            self.process_index(),
            self.num_processes(),
            apply_padding,
        )
    }

    /// Raises this rank's trigger (e.g. an early-stopping condition); [`check_trigger`](Self::check_trigger)
    /// reports it on every rank.
    pub fn set_trigger(&self) {
        self.trigger.raise();
    }

    /// Whether any rank raised its trigger since the last check that fired; resets the triggers when it
    /// fires. A collective: every rank must call it at the same point.
    pub fn check_trigger(&self) -> Result<bool> {
        self.trigger.check(&self.group)
    }
}
