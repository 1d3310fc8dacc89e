//! Moving batches to a device: Accelerate's `send_to_device` as a trait.
//!
//! [`ToDevice`] is implemented for tensors of every kind, `Vec`, arrays, `Option`, tuples, maps and plain values
//! (which pass through). For your own batch struct, use [`impl_to_device!`](crate::impl_to_device) or write the
//! impl by hand.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use burn_accelerate::{impl_to_device, ToDevice};
//!
//! struct Batch {
//!     images: Tensor<2>,
//!     labels: Tensor<1, Int>,
//!     ids: Vec<u64>,
//! }
//! impl_to_device!(Batch { images, labels, ids });
//!
//! let device = Device::default();
//! let batch = Batch {
//!     images: Tensor::zeros([2, 3], &device),
//!     labels: Tensor::zeros([2], &device),
//!     ids: vec![7, 8],
//! };
//! let batch = batch.to_device(&device);
//! assert_eq!(batch.ids, vec![7, 8]);
//! ```

use burn::tensor::{Device, Tensor, kind::Basic};

/// A value that can be moved to a device. Non-tensor parts are left as they are.
///
/// Moving keeps each tensor's autodiff association (a plain input stays plain on an autodiff device), as Burn's
/// `Tensor::to_device` does.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be placed on a device: it does not implement `ToDevice`",
    note = "for your own batch struct, `burn_accelerate::impl_batch!(Name {{ field, .. }})` (the same macro as \
            `impl_to_device!`) implements both `ToDevice` and `CastFloats`"
)]
pub trait ToDevice: Sized {
    /// Returns the value with every tensor it holds on `device`.
    fn to_device(self, device: &Device) -> Self;
}

impl<const D: usize, K: Basic> ToDevice for Tensor<D, K> {
    fn to_device(self, device: &Device) -> Self {
        if &self.device() == device {
            self
        } else {
            Tensor::to_device(self, device)
        }
    }
}

crate::traverse::traverse_impls!(ToDevice, to_device, &Device);

/// Implements [`ToDevice`] and [`CastFloats`](crate::CastFloats) for a struct by moving or casting each named
/// field (every listed field must implement both; fields not listed are left as they are). The same macro as
/// [`impl_batch!`](crate::impl_batch), whose name says that it serves both `prepare_dataloader`'s placement
/// and `autocast`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_accelerate::{impl_to_device, ToDevice};
///
/// struct Pair { x: Tensor<2>, y: Tensor<2>, name: String }
/// impl_to_device!(Pair { x, y });
///
/// let device = Device::default();
/// let pair = Pair { x: Tensor::ones([1, 2], &device), y: Tensor::zeros([1, 2], &device), name: "a".into() };
/// let pair = pair.to_device(&device);
/// assert_eq!(pair.name, "a");
/// ```
#[macro_export]
macro_rules! impl_to_device {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl $crate::ToDevice for $ty {
            fn to_device(self, device: &$crate::burn::tensor::Device) -> Self {
                #[allow(unused_mut)]
                let mut value = self;
                $(value.$field = $crate::ToDevice::to_device(value.$field, device);)*
                value
            }
        }
        impl $crate::CastFloats for $ty {
            fn cast_floats(self, dtype: $crate::burn::tensor::FloatDType) -> Self {
                #[allow(unused_mut)]
                let mut value = self;
                $(value.$field = $crate::CastFloats::cast_floats(value.$field, dtype);)*
                value
            }
        }
    };
}

/// Makes a struct usable as a batch or model output everywhere the accelerator takes one: implements
/// [`ToDevice`] (placement by prepared dataloaders and
/// [`Accelerator::to_device`](crate::Accelerator::to_device)) and [`CastFloats`](crate::CastFloats) (inputs and
/// outputs of [`Accelerator::autocast`](crate::Accelerator::autocast)) for the named fields. Another name for [`impl_to_device!`](crate::impl_to_device).
///
/// ```
/// use burn::tensor::{DType, Device, Tensor};
/// use burn_accelerate::{CastFloats, impl_batch};
///
/// struct Batch { x: Tensor<2>, id: u32 }
/// impl_batch!(Batch { x });
///
/// let batch = Batch { x: Tensor::ones([1, 2], &Device::default()), id: 7 };
/// let batch = batch.cast_floats(burn::tensor::FloatDType::BF16);
/// assert_eq!((batch.x.dtype(), batch.id), (DType::BF16, 7));
/// ```
#[macro_export]
macro_rules! impl_batch {
    ($($tokens:tt)*) => {
        $crate::impl_to_device!($($tokens)*);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Bool, Int};
    use std::collections::{BTreeMap, HashMap};

    use std::sync::{Arc, Mutex};

    /// A leaf that records every device it is moved to, so the tests see whether recursion reached it.
    #[derive(Clone)]
    struct Probe(Arc<Mutex<Vec<Device>>>);
    impl ToDevice for Probe {
        fn to_device(self, device: &Device) -> Self {
            self.0.lock().unwrap().push(device.clone());
            self
        }
    }
    impl crate::CastFloats for Probe {
        fn cast_floats(self, _: burn::tensor::FloatDType) -> Self {
            self
        }
    }

    struct Batch {
        x: Tensor<2>,
        mask: Option<Tensor<1, Bool>>,
        labels: Vec<Tensor<1, Int>>,
        meta: BTreeMap<String, (Probe, u32)>,
        extra: (Probe, Option<Probe>, Vec<Probe>, [Probe; 2]),
        name: &'static str,
    }
    impl_to_device!(Batch {
        x,
        mask,
        labels,
        meta,
        extra
    });

    #[test]
    fn nested_batch_moves_every_leaf() {
        let device = Device::default();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let probe = Probe(calls.clone());
        let mut meta = BTreeMap::new();
        meta.insert("w".to_string(), (probe.clone(), 5u32));
        let batch = Batch {
            x: Tensor::ones([2, 2], &device),
            mask: Some(Tensor::<1, Bool>::from_data([true, false], &device)),
            labels: vec![Tensor::<1, Int>::from_data([1, 2], &device); 3],
            meta,
            extra: (
                probe.clone(),
                Some(probe.clone()),
                vec![probe.clone(); 3],
                [probe.clone(), probe.clone()],
            ),
            name: "batch",
        };
        let target = Device::default().autodiff();
        let moved = batch.to_device(&target);
        let calls = calls.lock().unwrap();
        assert_eq!(
            calls.len(),
            1 + 1 + 1 + 3 + 2,
            "every probe leaf is visited once"
        );
        assert!(calls.iter().all(|d| d == &target));
        assert_eq!(moved.name, "batch");
        assert_eq!(moved.meta["w"].1, 5);
        assert_eq!(moved.labels.len(), 3);
        assert_eq!(
            moved
                .mask
                .unwrap()
                .into_data()
                .try_to_vec::<bool>()
                .unwrap(),
            vec![true, false]
        );
        assert_eq!(
            moved.x.into_data().try_to_vec::<f32>().unwrap(),
            vec![1.0; 4]
        );
    }

    #[test]
    fn tuples_maps_and_arrays() {
        let device = Device::default();
        let mut map = HashMap::new();
        map.insert(1u8, Tensor::<1>::zeros([3], &device));
        let value = (
            Tensor::<1>::ones([1], &device),
            [
                Tensor::<1>::ones([1], &device),
                Tensor::<1>::ones([1], &device),
            ],
            map,
            Box::new(3.5f32),
        );
        let (a, b, c, d) = value.to_device(&device);
        assert_eq!(a.dims(), [1]);
        assert_eq!(b.len(), 2);
        assert_eq!(c[&1].dims(), [3]);
        assert_eq!(*d, 3.5);
    }
}
