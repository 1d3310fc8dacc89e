//! How a batch is cut into micro-batches for a pipeline ([`Split`]), torch's `TensorChunkSpec` as a trait.

use burn::tensor::{Tensor, kind::Basic};

use crate::error::{Error, Result};

/// A batch that can be cut into micro-batches along its first dimension, for
/// [`Accelerator::backward_batch`](crate::Accelerator::backward_batch): a pipeline runs each micro-batch through
/// its stages in turn (torch's `TensorChunkSpec(0)`). Tensors split along dimension 0 into parts whose sizes
/// differ by at most one (the first ones larger, as `torch.tensor_split`); tuples and `Vec`s split each member
/// alike; implement it for a batch type of your own by splitting each of its tensors (the method is
/// `micro_batches`, so that it never hides Burn's own `Tensor::split`):
///
/// ```
/// use burn::tensor::{Int, Tensor};
/// use burn_accelerate::Split;
///
/// struct Batch {
///     tokens: Tensor<2, Int>,
///     targets: Tensor<2, Int>,
/// }
///
/// impl Split for Batch {
///     fn micro_batches(self, parts: usize) -> burn_accelerate::Result<Vec<Self>> {
///         let tokens = self.tokens.micro_batches(parts)?;
///         let targets = self.targets.micro_batches(parts)?;
///         Ok(tokens.into_iter().zip(targets).map(|(tokens, targets)| Batch { tokens, targets }).collect())
///     }
/// }
///
/// let device = Default::default();
/// let batch = Batch { tokens: Tensor::zeros([5, 3], &device), targets: Tensor::zeros([5, 3], &device) };
/// let parts = batch.micro_batches(2)?;
/// assert_eq!(parts[0].tokens.dims(), [3, 3]);
/// assert_eq!(parts[1].targets.dims(), [2, 3]);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
pub trait Split: Sized {
    /// `parts` micro-batches, in order, that together are `self`.
    ///
    /// # Errors
    /// The batch holds fewer samples than `parts`, or its members disagree on how many they hold.
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>>;

    /// How many samples the batch holds, where it can tell (a tensor: its first dimension; a tuple: its first
    /// member that can tell; a `Vec`: its length; `None` by default). Debug mode compares it between the stages
    /// of a pipeline, which must all get the same batch.
    fn samples(&self) -> Option<usize> {
        None
    }
}

/// The ranges of `len` samples cut into `parts` parts whose sizes differ by at most one, the first ones larger.
pub(crate) fn even_ranges(len: usize, parts: usize) -> Result<Vec<std::ops::Range<usize>>> {
    if parts == 0 || len < parts {
        return Err(Error::InvalidArgument(format!(
            "split: a batch of {len} sample(s) cannot be cut into {parts} micro-batch(es); give each batch at least \
             pp_microbatches samples, or lower pp_microbatches"
        )));
    }
    let (base, extra) = (len / parts, len % parts);
    let mut start = 0;
    Ok((0..parts)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let range = start..start + size;
            start += size;
            range
        })
        .collect())
}

impl<const D: usize, K: Basic> Split for Tensor<D, K> {
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>> {
        let ranges = even_ranges(self.dims()[0], parts)?;
        Ok(ranges
            .into_iter()
            .map(|range| self.clone().narrow(0, range.start, range.len()))
            .collect())
    }

    fn samples(&self) -> Option<usize> {
        self.dims().first().copied()
    }
}

impl<A: Split, B: Split> Split for (A, B) {
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>> {
        let (a, b) = (self.0.micro_batches(parts)?, self.1.micro_batches(parts)?);
        Ok(a.into_iter().zip(b).collect())
    }

    fn samples(&self) -> Option<usize> {
        self.0.samples().or_else(|| self.1.samples())
    }
}

impl<A: Split, B: Split, C: Split> Split for (A, B, C) {
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>> {
        let (a, b, c) = (
            self.0.micro_batches(parts)?,
            self.1.micro_batches(parts)?,
            self.2.micro_batches(parts)?,
        );
        Ok(a.into_iter()
            .zip(b)
            .zip(c)
            .map(|((a, b), c)| (a, b, c))
            .collect())
    }

    fn samples(&self) -> Option<usize> {
        self.0
            .samples()
            .or_else(|| self.1.samples())
            .or_else(|| self.2.samples())
    }
}

/// A list of samples (items not yet collated) splits into consecutive runs of samples.
impl<T> Split for Vec<T> {
    fn micro_batches(self, parts: usize) -> Result<Vec<Self>> {
        let ranges = even_ranges(self.len(), parts)?;
        let mut items = self.into_iter();
        Ok(ranges
            .into_iter()
            .map(|range| items.by_ref().take(range.len()).collect())
            .collect())
    }

    fn samples(&self) -> Option<usize> {
        Some(self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_differ_by_at_most_one_sample_and_cover_the_batch_in_order() {
        assert_eq!(even_ranges(7, 3).unwrap(), vec![0..3, 3..5, 5..7]);
        assert_eq!(even_ranges(4, 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert!(even_ranges(2, 3).is_err());
        assert!(even_ranges(2, 0).is_err());
        let device = Default::default();
        let batch = Tensor::<1>::from_floats([1.0, 2.0, 3.0, 4.0, 5.0], &device);
        let labels = vec![10, 20, 30, 40, 50];
        let parts = (batch, labels).micro_batches(2).unwrap();
        assert_eq!(
            parts[0].0.to_data().try_to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 3.0]
        );
        assert_eq!(parts[1].1, vec![40, 50]);
    }
}
