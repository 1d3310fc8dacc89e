//! Host tensor data filled in place, in an allocation Burn takes as it is.
//!
//! `TensorData::from_bytes_vec` copies every byte of its `Vec<u8>` into a new, 16-byte-aligned allocation
//! (a `Vec<u8>` promises no alignment), which for a 100 MB tensor is a second 100 MB of fresh pages to fault
//! in and fill. [`filled`] allocates a vector of an integer type as wide as the element instead, lets the
//! caller write its bytes, and hands that vector to Burn: the backend (Flex keeps host bytes as they are)
//! gets the tensor without another copy, and its in-place kernels can reuse the allocation.

use burn::tensor::{Bytes, DType, TensorData};

/// Tensor data of `shape` and `dtype` whose bytes `fill` writes (they start zeroed), without the copy
/// `TensorData::from_bytes_vec` makes. `fill` gets exactly `product(shape) * dtype.size()` bytes, aligned to
/// the element width.
pub(crate) fn filled(shape: Vec<usize>, dtype: DType, fill: impl FnOnce(&mut [u8])) -> TensorData {
    let elements: usize = shape.iter().product();
    fn with<E: bytemuck::Pod + Send + Sync>(
        elements: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Bytes {
        let mut values = vec![E::zeroed(); elements];
        fill(bytemuck::cast_slice_mut(&mut values));
        Bytes::from_elems(values)
    }
    let typed = match (dtype, dtype.size()) {
        // Quantized data packs its values and parameters; it keeps the generic path.
        (DType::QFloat(_), _) => Err(fill),
        (_, 1) => Ok(with::<u8>(elements, fill)),
        (_, 2) => Ok(with::<u16>(elements, fill)),
        (_, 4) => Ok(with::<u32>(elements, fill)),
        (_, 8) => Ok(with::<u64>(elements, fill)),
        _ => Err(fill),
    };
    match typed {
        Ok(bytes) => TensorData::from_bytes(bytes, shape, dtype),
        Err(fill) => {
            let mut bytes = vec![0u8; elements * dtype.size()];
            fill(&mut bytes);
            TensorData::from_bytes_vec(bytes, shape, dtype)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_data_holds_the_written_values_in_every_width() {
        let data = filled(vec![2, 3], DType::F32, |bytes| {
            let values: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            bytes.copy_from_slice(&values);
        });
        assert_eq!(data.shape().to_vec(), vec![2, 3]);
        assert_eq!(
            data.try_to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        for dtype in [
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::I8,
            DType::U8,
        ] {
            let data = filled(vec![5], dtype, |bytes| {
                assert_eq!(bytes.len(), 5 * dtype.size());
                assert_eq!(bytes.as_ptr() as usize % dtype.size(), 0);
                bytes.fill(0);
            });
            assert_eq!(data.as_bytes().len(), 5 * dtype.size());
            assert_eq!(data.dtype(), dtype);
        }
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_takes_the_filled_allocation_without_copying_it() {
        use burn::tensor::{Device, Tensor};
        let data = filled(vec![1024], DType::F32, |bytes| bytes.fill(1));
        let address = data.as_bytes().as_ptr();
        let tensor = Tensor::<1>::from_data(data, (&Device::flex(), DType::F32));
        let back = tensor.into_data();
        assert_eq!(back.as_bytes().as_ptr(), address);
        assert!(back.as_bytes().iter().all(|&b| b == 1));
    }
}
