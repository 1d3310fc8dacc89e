//! Reducing a sharded rank's gradients: each bucket's whole gradients reduce-scattered, this rank keeping only
//! its slices (averaged across the replicas under a hybrid strategy).

use super::*;

/// One bucket of gradients whose reduce-scatter was started: each member's id, the length of this rank's buffer,
/// its own dtype and the shape to store (`None`: its parameter's, when the optimizer takes it).
pub(super) struct Reducing {
    pending: Pending<Tensor<1>>,
    members: Vec<(ParamId, usize, DType, Option<Shape>)>,
}

/// A gradient reduction started ([`Sharded::start_reducing`]): every bucket's reduce-scatter issued.
pub(crate) struct ReduceStarted {
    grads: GradientBuffer,
    buckets: Vec<Reducing>,
    /// Under a hybrid strategy, the replicas' communicator and the factor of their sum.
    replicas: Option<(Arc<dyn TensorComm>, f32)>,
}

impl ReduceStarted {
    /// Waits for every bucket's reduce-scatter (and, under a hybrid strategy, sums each across the replicas) and
    /// returns the buffer with this rank's reduced slices.
    pub fn finish(mut self) -> Result<GradientBuffer> {
        for bucket in self.buckets {
            let mine = bucket.pending.wait()?;
            let mine = match &self.replicas {
                Some((replicas, factor)) if mine.dims()[0] > 0 => replicas
                    .all_reduce(
                        mine,
                        Reduction::ScaledSum(*factor),
                        "hybrid gradient all-reduce across replicas",
                    )?
                    .wait()?,
                _ => mine,
            };
            let lens = bucket.members.iter().map(|m| m.1).collect();
            for ((id, len, dtype, shape), flat) in
                bucket.members.into_iter().zip(exchange::pieces(mine, lens))
            {
                if len > 0 {
                    self.grads
                        .add_reduced(id, shape, bucket::in_dtype(flat, dtype));
                }
            }
        }
        Ok(self.grads)
    }
}

impl Sharded {
    /// Starts reducing `grads` (see [`Strategy::reduce_gradients`]): takes each bucket's whole gradients out of
    /// the buffer and issues its reduce-scatter; [`ReduceStarted::finish`] stores this rank's slices.
    pub(super) fn start_reducing(
        &self,
        mut grads: GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<ReduceStarted> {
        let replicas = self
            .replica_comm
            .as_ref()
            .map(|r| (r.clone(), scale / self.world.num_processes() as f32));
        // A rank that holds none of these gradients (its part of the batch used none of them) still takes part,
        // with zeros where the model keeps them; of parameters it has never seen whole either (unfrozen after
        // `prepare_model`), with zeros on its group's device, in its default float dtype. It never leaves its
        // peers in a reduce-scatter it skipped.
        let (device, dtype) = grads
            .device_and_dtype(params.iter().map(|(id, _)| *id))
            .or_else(|| self.placement_of(params.iter().map(|(id, _)| *id)))
            .unwrap_or_else(|| {
                let device = self.world.device().clone();
                let dtype = Tensor::<1>::zeros([0], &device).dtype();
                (device, dtype)
            });
        let me = self.shard_rank();
        self.check_world("hybrid sharded gradient sync", params.len())?;
        let splits = self.slicings_for(params);
        let own_dtypes = self.dtypes(params.iter().map(|(id, _)| *id), dtype);
        let (cap, alone) = self.bucket_limits();
        let mut buckets = Vec::new();
        for members in exchange::buckets(&splits, cap, alone) {
            // Every rank sends in the dtype of the whole bucket (the same on every rank, whatever it holds), or in
            // the policy's reduce dtype; each slice is stored in its parameter's own.
            let Some(wire) = bucket::common_dtype(members.iter().map(|&i| own_dtypes[i])) else {
                continue;
            };
            let wire = self.reduce_dtype.unwrap_or(wire);
            let mut wholes = Vec::with_capacity(members.len());
            let mut stored = Vec::with_capacity(members.len());
            for &i in &members {
                let (id, n) = params[i];
                // Taken out of the buffer (moved, not copied, when it travels alone); a gradient this rank lacks
                // (its parameter was unused here) takes part as zeros.
                let whole_shape = match grads.take_unreduced(id) {
                    Some((shape, grad)) => {
                        wholes.push(grad);
                        Some(shape)
                    }
                    None => {
                        wholes.push(Tensor::<1>::zeros([n], (&device, wire)));
                        None
                    }
                };
                let split = &splits[i];
                // A parameter the strategy has not seen whole (owned whole, adopted) keeps the shape its gradient
                // had here (or takes its parameter's when the optimizer takes it).
                let shape = if self.known().contains_key(&id) {
                    Some(Shape::from(split.local_dims(me)))
                } else {
                    whole_shape
                };
                stored.push((id, split.local_len(me), own_dtypes[i], shape));
            }
            let bucket_splits: Vec<&Slicing> = members.iter().map(|&i| &splits[i]).collect();
            let pending = exchange::start_reduce_scatter(
                self.shards.as_ref(),
                &bucket_splits,
                wholes,
                (self.within_shards(scale), "sharded gradient reduce-scatter"),
                (&device, wire),
            )?;
            buckets.push(Reducing {
                pending,
                members: stored,
            });
        }
        Ok(ReduceStarted {
            grads,
            buckets,
            replicas,
        })
    }
}
