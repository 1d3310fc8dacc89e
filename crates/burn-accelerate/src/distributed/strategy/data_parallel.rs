//! Data parallelism: every rank holds the whole model and steps every parameter; gradients are averaged across
//! ranks in buckets through a [`GradientTransport`], and every rank starts from rank 0's weights.

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};

use super::Strategy;
use super::transport::GradientTransport;
use crate::error::Result;
use crate::grad::GradientBuffer;

/// Gradients with at least this many elements (1 MiB of f32) are all-reduced on their own (see [`buckets`]).
const ALONE_ELEMENTS: usize = 1 << 18;

/// One rank and one device: averaging is only the scaling, and nothing crosses ranks.
#[derive(Debug)]
pub(crate) struct SingleDevice;

impl Strategy for SingleDevice {
    fn name(&self) -> String {
        "single device".into()
    }

    fn is_distributed(&self) -> bool {
        false
    }

    fn rank(&self) -> usize {
        0
    }

    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        if scale != 1.0 {
            let ids: Vec<ParamId> = params.iter().map(|(id, _)| *id).collect();
            grads.map_flat(&ids, |g| g.mul_scalar(scale));
        }
        Ok(())
    }

    fn broadcast(&self, flat: Tensor<1>, _root: usize) -> Result<Tensor<1>> {
        Ok(flat)
    }
}

/// Data parallelism over `transport`, in buckets of at most `bucket_bytes`.
#[derive(Debug)]
pub(crate) struct DataParallel {
    transport: Box<dyn GradientTransport>,
    bucket_bytes: usize,
}

impl DataParallel {
    /// Data parallelism whose gradients cross ranks through `transport`.
    pub fn new(transport: Box<dyn GradientTransport>, bucket_bytes: usize) -> Self {
        Self {
            transport,
            bucket_bytes,
        }
    }

    /// Averages one bucket. A bucket of one gradient goes to the transport as it is (no copy on CPU backends);
    /// a larger one is concatenated, averaged and split.
    fn average_bucket(
        &self,
        grads: &mut GradientBuffer,
        bucket: &[(ParamId, usize)],
        scale: f32,
        (device, dtype): (&Device, DType),
    ) -> Result<()> {
        // A gradient this rank lacks (its parameter was unused here) takes part as zeros.
        let zeros = |n: usize| Tensor::zeros([n], (device, dtype));
        if let [(id, n)] = bucket {
            if !grads.replace_flat(*id, |flat| self.transport.average(flat, scale))? {
                grads.set_flat(*id, self.transport.average(zeros(*n), scale)?);
            }
            return Ok(());
        }
        // A model may mix dtypes (f32 and f16 parameters): a bucket travels in the first gradient's dtype and
        // each gradient comes back in its own.
        let (parts, dtypes): (Vec<Tensor<1>>, Vec<DType>) = bucket
            .iter()
            .map(|(id, n)| {
                let part = grads.flat(&[*id]).pop().unwrap_or_else(|| zeros(*n));
                let own = part.dtype();
                let part = if own == dtype { part } else { part.cast(dtype) };
                (part, own)
            })
            .unzip();
        let all = self.transport.average(Tensor::cat(parts, 0), scale)?;
        let sizes: Vec<usize> = bucket.iter().map(|(_, n)| *n).collect();
        for (((id, _), grad), own) in bucket
            .iter()
            .zip(all.split_with_sizes(sizes, 0))
            .zip(dtypes)
        {
            grads.set_flat(*id, if own == dtype { grad } else { grad.cast(own) });
        }
        Ok(())
    }
}

impl Strategy for DataParallel {
    fn name(&self) -> String {
        format!("data parallel over {}", self.transport.name())
    }

    fn is_distributed(&self) -> bool {
        true
    }

    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        let Some((device, dtype)) = grads.device_and_dtype(params.iter().map(|(id, _)| *id)) else {
            return Ok(());
        };
        let max_elems = (self.bucket_bytes / 4).max(1);
        for bucket in buckets(params, max_elems, ALONE_ELEMENTS.min(max_elems)) {
            self.average_bucket(grads, bucket, scale, (&device, dtype))?;
        }
        Ok(())
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.transport.broadcast(flat, root)
    }
}

/// Consecutive groups of `params` holding at most `max_elems` elements each; a parameter of `alone_elems` or
/// more is a group of its own (reduced without a copy into a bucket, which would cost more than the extra
/// collective saves). Every rank forms the same groups, so they call the same collectives.
fn buckets(
    params: &[(ParamId, usize)],
    max_elems: usize,
    alone_elems: usize,
) -> impl Iterator<Item = &[(ParamId, usize)]> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= params.len() {
            return None;
        }
        let (mut end, mut elems) = (start, 0);
        let first_alone = params[start].1 >= alone_elems;
        let joins =
            |n: usize, elems: usize| !first_alone && n < alone_elems && elems + n <= max_elems;
        while end < params.len() && (end == start || joins(params[end].1, elems)) {
            elems += params[end].1;
            end += 1;
        }
        let bucket = &params[start..end];
        start = end;
        Some(bucket)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_respect_the_size_and_keep_large_parameters_whole() {
        let ids: Vec<ParamId> = (0..4).map(|_| ParamId::new()).collect();
        let params = vec![(ids[0], 3), (ids[1], 3), (ids[2], 10), (ids[3], 1)];
        let sizes: Vec<Vec<usize>> = buckets(&params, 6, 6)
            .map(|b| b.iter().map(|(_, n)| *n).collect())
            .collect();
        assert_eq!(sizes, vec![vec![3, 3], vec![10], vec![1]]);
        // Parameters of `alone_elems` or more get a bucket of their own, even when they would fit.
        let params = vec![(ids[0], 1), (ids[1], 4), (ids[2], 1), (ids[3], 1)];
        let sizes: Vec<Vec<usize>> = buckets(&params, 100, 4)
            .map(|b| b.iter().map(|(_, n)| *n).collect())
            .collect();
        assert_eq!(sizes, vec![vec![1], vec![4], vec![1, 1]]);
        // Small ones still fill a bucket up to its size, past `alone_elems` in total.
        let params = vec![(ids[0], 1), (ids[1], 1), (ids[2], 1), (ids[3], 1)];
        assert_eq!(buckets(&params, 100, 2).count(), 1);
    }
}
