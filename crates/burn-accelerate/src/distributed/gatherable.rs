//! What [`Accelerator::gather_for_metrics`](crate::Accelerator::gather_for_metrics) takes: a tensor, or a
//! tuple, `Vec`, array, `Option`, `Box` or `BTreeMap` of them, nested as deep as needed, or a struct of them
//! with [`impl_gatherable!`](crate::impl_gatherable) — Accelerate's nested `gather_for_metrics` in one call.
//!
//! Every tensor inside is gathered in a fixed order (tuple and struct fields in order, `Vec` and array items
//! in order, map entries by key), so every rank must pass the same structure. `HashMap` is left out on purpose:
//! its order differs between processes, which would pair different tensors across ranks.
//!
//! ```
//! use burn::tensor::{Int, Tensor};
//! use burn_accelerate::{impl_gatherable, launch};
//!
//! struct Outputs {
//!     predictions: Tensor<1, Int>,
//!     losses: Tensor<1>,
//! }
//! impl_gatherable!(Outputs { predictions, losses });
//!
//! let sizes = launch(2, |acc| {
//!     let device = acc.device();
//!     let outputs = Outputs {
//!         predictions: Tensor::zeros([3], device),
//!         losses: Tensor::ones([3], device),
//!     };
//!     let (outputs, labels) = acc.gather_for_metrics((outputs, Tensor::<1, Int>::zeros([3], device)))?;
//!     Ok((outputs.predictions.dims()[0], outputs.losses.dims()[0], labels.dims()[0]))
//! })?;
//! assert_eq!(sizes, vec![(6, 6, 6); 2]);
//! # Ok::<(), burn_accelerate::Error>(())
//! ```

use burn::tensor::Tensor;
use burn::tensor::kind::Basic;

use super::ProcessGroup;
use super::collectives;
use crate::error::Result;

/// One `gather_for_metrics` call: the rank's group, and how many gathered samples are real (on the last batch
/// of an epoch, the samples that even batches repeated are dropped).
#[derive(Debug, Clone, Copy)]
pub struct MetricsGather<'a> {
    group: &'a ProcessGroup,
    keep: Option<usize>,
}

impl<'a> MetricsGather<'a> {
    /// A gather over `group` that keeps the first `keep` gathered samples (`None`: all of them).
    pub fn new(group: &'a ProcessGroup, keep: Option<usize>) -> Self {
        Self { group, keep }
    }

    /// Gathers one per-sample tensor along dimension 0 and drops the repeated tail.
    ///
    /// # Errors
    /// As [`collectives::gather`].
    pub fn tensor<const D: usize, K: Basic>(&self, tensor: Tensor<D, K>) -> Result<Tensor<D, K>> {
        let gathered = collectives::gather(self.group, tensor)?;
        match self.keep {
            Some(keep) if keep < gathered.dims()[0] => Ok(gathered.narrow(0, 0, keep)),
            _ => Ok(gathered),
        }
    }
}

/// A value whose tensors [`Accelerator::gather_for_metrics`](crate::Accelerator::gather_for_metrics) gathers
/// across ranks.
pub trait Gatherable: Sized {
    /// Gathers every tensor in `self` for metrics, each through [`MetricsGather::tensor`].
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self>;
}

impl<const D: usize, K: Basic> Gatherable for Tensor<D, K> {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        gather.tensor(self)
    }
}

impl<T: Gatherable> Gatherable for Vec<T> {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        self.into_iter()
            .map(|v| v.gather_for_metrics(gather))
            .collect()
    }
}

impl<T: Gatherable, const N: usize> Gatherable for [T; N] {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        let gathered: Vec<T> = Vec::from(self).gather_for_metrics(gather)?;
        Ok(gathered
            .try_into()
            .unwrap_or_else(|_| unreachable!("gathering keeps the array's length")))
    }
}

impl<T: Gatherable> Gatherable for Option<T> {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        self.map(|v| v.gather_for_metrics(gather)).transpose()
    }
}

impl<T: Gatherable> Gatherable for Box<T> {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        Ok(Box::new((*self).gather_for_metrics(gather)?))
    }
}

impl<K: Ord, V: Gatherable> Gatherable for std::collections::BTreeMap<K, V> {
    fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
        self.into_iter()
            .map(|(k, v)| Ok((k, v.gather_for_metrics(gather)?)))
            .collect()
    }
}

macro_rules! gatherable_tuples {
    ($(($($name:ident),+)),+ $(,)?) => {
        $(
            #[allow(non_snake_case)]
            impl<$($name: Gatherable),+> Gatherable for ($($name,)+) {
                fn gather_for_metrics(self, gather: &MetricsGather<'_>) -> Result<Self> {
                    let ($($name,)+) = self;
                    Ok(($($name.gather_for_metrics(gather)?,)+))
                }
            }
        )+
    };
}
gatherable_tuples!(
    (A),
    (A, B),
    (A, B, C),
    (A, B, C, D),
    (A, B, C, D, E),
    (A, B, C, D, E, F),
    (A, B, C, D, E, F, G),
    (A, B, C, D, E, F, G, H),
);

/// Implements [`Gatherable`] for a struct whose fields are all gatherable: every field must be listed (the
/// struct is rebuilt from them, so a missing field is a compile error), and they are gathered in the order
/// listed.
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_accelerate::impl_gatherable;
///
/// struct Eval {
///     logits: Tensor<2>,
///     mask: Option<Tensor<1>>,
/// }
/// impl_gatherable!(Eval { logits, mask });
/// ```
#[macro_export]
macro_rules! impl_gatherable {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl $crate::distributed::Gatherable for $ty {
            fn gather_for_metrics(
                self,
                gather: &$crate::distributed::MetricsGather<'_>,
            ) -> $crate::Result<Self> {
                Ok($ty {
                    $($field: $crate::distributed::Gatherable::gather_for_metrics(self.$field, gather)?,)*
                })
            }
        }
    };
}
