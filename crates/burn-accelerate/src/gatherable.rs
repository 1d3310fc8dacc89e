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

use crate::accelerator::Accelerator;
use crate::error::Result;

/// A value whose tensors [`Accelerator::gather_for_metrics`] gathers across ranks.
pub trait Gatherable: Sized {
    /// Gathers every tensor in `self` for metrics (see
    /// [`Accelerator::gather_for_metrics`](crate::Accelerator::gather_for_metrics)).
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self>;
}

impl<const D: usize, K: Basic> Gatherable for Tensor<D, K> {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        accelerator.gather_tensor_for_metrics(self)
    }
}

impl<T: Gatherable> Gatherable for Vec<T> {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        self.into_iter()
            .map(|v| v.gather_for_metrics(accelerator))
            .collect()
    }
}

impl<T: Gatherable, const N: usize> Gatherable for [T; N] {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        let gathered: Vec<T> = Vec::from(self).gather_for_metrics(accelerator)?;
        Ok(gathered
            .try_into()
            .unwrap_or_else(|_| unreachable!("gathering keeps the array's length")))
    }
}

impl<T: Gatherable> Gatherable for Option<T> {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        self.map(|v| v.gather_for_metrics(accelerator)).transpose()
    }
}

impl<T: Gatherable> Gatherable for Box<T> {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        Ok(Box::new((*self).gather_for_metrics(accelerator)?))
    }
}

impl<K: Ord, V: Gatherable> Gatherable for std::collections::BTreeMap<K, V> {
    fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
        self.into_iter()
            .map(|(k, v)| Ok((k, v.gather_for_metrics(accelerator)?)))
            .collect()
    }
}

macro_rules! gatherable_tuples {
    ($(($($name:ident),+)),+ $(,)?) => {
        $(
            #[allow(non_snake_case)]
            impl<$($name: Gatherable),+> Gatherable for ($($name,)+) {
                fn gather_for_metrics(self, accelerator: &Accelerator) -> Result<Self> {
                    let ($($name,)+) = self;
                    Ok(($($name.gather_for_metrics(accelerator)?,)+))
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
        impl $crate::gatherable::Gatherable for $ty {
            fn gather_for_metrics(
                self,
                accelerator: &$crate::Accelerator,
            ) -> $crate::Result<Self> {
                Ok($ty {
                    $($field: $crate::gatherable::Gatherable::gather_for_metrics(self.$field, accelerator)?,)*
                })
            }
        }
    };
}
