//! The in-place reduction kernels of the in-process engine: a rank's buffer shared with the other ranks, and
//! the unsafe loops that reduce and copy slices of it under the all-reduce protocol of `InProcessComm`.

use std::fmt;
use std::sync::Arc;

use crate::reduce::{ReduceBuffer, ReduceOp};

/// A rank's all-reduce buffer, shared with the other ranks for an in-place reduce-scatter and all-gather.
///
/// The element pointer is taken once, from the owning `Vec`, before the buffer is shared; every rank then
/// reads and writes through it only, following a protocol that keeps every element either read by any ranks
/// or written by one, never both, between two rounds (see [`InProcessComm::all_reduce_in_place`]). The `Arc`
/// keeps the memory alive even when a rank fails mid-way, so a slower rank never reads freed memory.
pub(super) struct InPlaceBuffer {
    pub(super) owner: std::cell::UnsafeCell<ReduceBuffer>,
    data: RawElements,
    pub(super) len: usize,
}

/// The first element of a buffer, by kind.
#[derive(Clone, Copy)]
enum RawElements {
    F32(*mut f32),
    F64(*mut f64),
    I64(*mut i64),
}

// SAFETY: the pointers are only dereferenced under the all-reduce protocol described above.
unsafe impl Sync for InPlaceBuffer {}
unsafe impl Send for InPlaceBuffer {}

impl InPlaceBuffer {
    pub(super) fn new(mut buffer: ReduceBuffer) -> Self {
        let len = buffer.len();
        let data = match &mut buffer {
            ReduceBuffer::F32(v) => RawElements::F32(v.as_mut_ptr()),
            ReduceBuffer::F64(v) => RawElements::F64(v.as_mut_ptr()),
            ReduceBuffer::I64(v) => RawElements::I64(v.as_mut_ptr()),
        };
        Self {
            owner: std::cell::UnsafeCell::new(buffer),
            data,
            len,
        }
    }

    pub(super) fn kind(&self) -> &'static str {
        match self.data {
            RawElements::F32(_) => "f32",
            RawElements::F64(_) => "f64",
            RawElements::I64(_) => "i64",
        }
    }
}

impl fmt::Debug for InPlaceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InPlaceBuffer({} x {})", self.len, self.kind())
    }
}

/// Elements a slice is reduced in at a time, in a small scratch buffer that stays in cache.
const CHUNK: usize = 4096;

/// Reduces `range` of `inputs` (rank order) into the same range of `out`, chunk by chunk.
///
/// # Safety
/// Every pointer addresses at least `range.end` elements; during the call no other thread writes `range` of
/// any input, and no other thread reads or writes `range` of `out` (which may be one of the inputs).
unsafe fn reduce_raw<T: Copy + Default>(
    inputs: &[*mut T],
    out: *mut T,
    range: std::ops::Range<usize>,
    combine: impl Fn(&mut [T], &[T]),
    finish: impl Fn(&mut [T]),
) {
    let mut scratch = vec![T::default(); CHUNK.min(range.len())];
    let mut start = range.start;
    while start < range.end {
        let k = CHUNK.min(range.end - start);
        let acc = &mut scratch[..k];
        // SAFETY: in bounds, and not written by anyone during the call (the caller's contract).
        acc.copy_from_slice(unsafe { std::slice::from_raw_parts(inputs[0].add(start), k) });
        for input in &inputs[1..] {
            combine(acc, unsafe {
                std::slice::from_raw_parts(input.add(start), k)
            });
        }
        finish(acc);
        // SAFETY: this thread alone accesses `out`'s range now; the reads above have ended.
        unsafe { std::slice::from_raw_parts_mut(out.add(start), k) }.copy_from_slice(acc);
        start += k;
    }
}

/// Reduces `range` of every buffer of `buffers` (rank order) with `op` into the same range of `buffers[out]`,
/// dividing by the number of buffers for a mean.
///
/// # Safety
/// As [`reduce_raw`]: no other thread writes `range` of any buffer, nor reads or writes `range` of
/// `buffers[out]`, during the call; every buffer holds at least `range.end` elements of one kind.
pub(super) unsafe fn reduce_buffers(
    buffers: &[Arc<InPlaceBuffer>],
    out: usize,
    range: std::ops::Range<usize>,
    op: ReduceOp,
) {
    let n = buffers.len();
    let mean = op == ReduceOp::Mean;
    macro_rules! kernel {
        ($variant:ident, $t:ty, $is_nan:expr, $divide:expr) => {{
            let is_nan: fn($t) -> bool = $is_nan;
            let divide: fn(&mut [$t], usize) = $divide;
            let inputs: Vec<*mut $t> = buffers
                .iter()
                .map(|b| match b.data {
                    RawElements::$variant(p) => p,
                    _ => unreachable!("the kinds were checked"),
                })
                .collect();
            let combine = |acc: &mut [$t], x: &[$t]| match op {
                ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b),
                ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| {
                    if *b > *a || is_nan(*b) {
                        *a = *b
                    }
                }),
                ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| {
                    if *b < *a || is_nan(*b) {
                        *a = *b
                    }
                }),
            };
            let finish = |acc: &mut [$t]| {
                if mean {
                    divide(acc, n)
                }
            };
            // SAFETY: the caller's contract.
            unsafe { reduce_raw(&inputs, inputs[out], range, combine, finish) };
        }};
    }
    match buffers[out].data {
        RawElements::F32(_) => kernel!(F32, f32, f32::is_nan, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as f32)),
        RawElements::F64(_) => kernel!(F64, f64, f64::is_nan, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as f64)),
        RawElements::I64(_) => kernel!(I64, i64, |_| false, |v, n| v
            .iter_mut()
            .for_each(|x| *x /= n as i64)),
    }
}

/// Copies `range` of `from` into the same range of `to` (buffers of one kind).
///
/// # Safety
/// Both hold at least `range.end` elements of one kind; during the call no other thread writes `range` of
/// `from`, nor reads or writes `range` of `to`.
pub(super) unsafe fn copy_range(
    from: &InPlaceBuffer,
    to: &InPlaceBuffer,
    range: std::ops::Range<usize>,
) {
    let (bytes, width) = match (from.data, to.data) {
        (RawElements::F32(p), RawElements::F32(_)) => (p.cast::<u8>(), 4),
        (RawElements::F64(p), RawElements::F64(_)) => (p.cast::<u8>(), 8),
        (RawElements::I64(p), RawElements::I64(_)) => (p.cast::<u8>(), 8),
        _ => unreachable!("the kinds were checked"),
    };
    let target = match to.data {
        RawElements::F32(p) => p.cast::<u8>(),
        RawElements::F64(p) => p.cast::<u8>(),
        RawElements::I64(p) => p.cast::<u8>(),
    };
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.add(range.start * width),
            target.add(range.start * width),
            range.len() * width,
        )
    };
}
