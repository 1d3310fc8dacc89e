//! Bucketing: many small tensors grouped into fewer collective calls, and large ones alone, for every strategy
//! (data parallelism's all-reduce buckets, a sharded strategy's reduce-scatter and all-gather rounds).

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};

/// Tensors with at least this many elements (1 MiB of f32) travel on their own: copying them into a bucket would
/// cost more than the extra collective saves (and a single tensor travels without a copy on CPU backends).
pub(crate) const ALONE_ELEMENTS: usize = 1 << 18;

/// The most elements of a bucket of `bucket_bytes` (f32 elements, at least one).
pub(crate) fn max_elements(bucket_bytes: usize) -> usize {
    (bucket_bytes / 4).max(1)
}

/// Consecutive groups of `params` holding at most `max_elems` elements each; a parameter of `alone_elems` or
/// more is a group of its own. Every rank forms the same groups from the same list, so they make the same calls.
pub(crate) fn buckets(
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

/// The dtype a bucket of tensors of `dtypes` travels in: theirs when they share one; f32 when they mix (f64 if one
/// of them is f64), so that no value is narrowed on the way.
pub(crate) fn common_dtype(dtypes: impl IntoIterator<Item = DType>) -> Option<DType> {
    let mut common: Option<DType> = None;
    for dtype in dtypes {
        common = Some(match common {
            None => dtype,
            Some(c) if c == dtype => c,
            Some(c) if c == DType::F64 || dtype == DType::F64 => DType::F64,
            Some(_) => DType::F32,
        });
    }
    common
}

/// `parts` as one flat tensor: a single part as it is (nothing copied), else their concatenation in their
/// [`common_dtype`]; no parts make an empty tensor on `device` in `dtype`.
pub(crate) fn concat(parts: Vec<Tensor<1>>, (device, dtype): (&Device, DType)) -> Tensor<1> {
    let Some(common) = common_dtype(parts.iter().map(Tensor::dtype)) else {
        return Tensor::zeros([0], (device, dtype));
    };
    if parts.len() == 1 {
        return parts
            .into_iter()
            .next()
            .unwrap_or_else(|| Tensor::zeros([0], (device, dtype)));
    }
    let parts = parts.into_iter().map(|p| in_dtype(p, common)).collect();
    Tensor::cat(parts, 0)
}

/// `flat` in `dtype`: itself when it is in it already, else cast (a gradient or parameter back in its own dtype
/// after travelling in a bucket's).
pub(crate) fn in_dtype(flat: Tensor<1>, dtype: DType) -> Tensor<1> {
    if flat.dtype() == dtype {
        flat
    } else {
        flat.cast(dtype)
    }
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
        assert_eq!(max_elements(0), 1);
    }

    #[test]
    fn mixed_dtypes_travel_without_narrowing() {
        use DType::*;
        assert_eq!(common_dtype([]), None);
        assert_eq!(common_dtype([F16, F16]), Some(F16));
        assert_eq!(common_dtype([F16, F32]), Some(F32));
        assert_eq!(common_dtype([BF16, F16]), Some(F32));
        assert_eq!(common_dtype([F16, F64, F32]), Some(F64));
        let device = Device::default();
        let parts = vec![
            Tensor::<1>::from_floats([1.0, 2.0], &device).cast(F16),
            Tensor::<1>::from_floats([0.1], &device),
        ];
        let all = concat(parts, (&device, F32));
        assert_eq!(all.dtype(), F32);
        assert_eq!(
            all.into_data().try_to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 0.1]
        );
        assert_eq!(concat(Vec::new(), (&device, BF16)).dims(), [0]);
        assert_eq!(max_elements(4 << 20), 1 << 20);
    }
}
