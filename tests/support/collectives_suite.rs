//! The collective checks of Accelerate's `test_ops.py`, written against any rank count, so that the same
//! suite runs on in-process ranks and under `mpirun`.

#![allow(dead_code)]

use burn::tensor::{Bool, DType, FloatDType, Int, Tensor};
use burn_accelerate::{Accelerator, ReduceOp, Result};

fn floats<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(burn_accelerate::Error::InvalidArgument(what()))
    }
}

/// gather: rank r holds `P*r+1 ..= P*r+P`; the result is `1 ..= P*P` on every rank.
pub fn gather_values(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    let mine: Vec<f32> = (0..p).map(|i| (p * r + i + 1) as f32).collect();
    let out = acc.gather(Tensor::<1>::from_floats(mine.as_slice(), acc.device()))?;
    let expected: Vec<f32> = (1..=p * p).map(|v| v as f32).collect();
    let got = floats(out);
    check(got == expected, || {
        format!("gather: {got:?} != {expected:?}")
    })
}

/// Uneven gather: rank r holds `r+1` rows of 2 columns filled with r; no padding in the result.
pub fn gather_uneven(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    let mine = Tensor::<2, Int>::full([r + 1, 2], r as i64, acc.device());
    let out = acc.gather(mine)?;
    let rows: usize = (1..=p).sum();
    check(out.dims() == [rows, 2], || {
        format!("uneven gather dims {:?}", out.dims())
    })?;
    let got: Vec<i64> = out
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap();
    let expected: Vec<i64> = (0..p)
        .flat_map(|q| std::iter::repeat_n(q as i64, 2 * (q + 1)))
        .collect();
    check(got == expected, || {
        format!("uneven gather: {got:?} != {expected:?}")
    })
}

/// gather_object: `[rank]` from everyone is `[0, 1, .., P-1]`; strings and structs travel too.
pub fn gather_object(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    let got = acc.gather_object(&r)?;
    check(got == (0..p).collect::<Vec<_>>(), || {
        format!("gather_object: {got:?}")
    })?;
    let names = acc.gather_object(&(format!("rank-{r}"), vec![r; r]))?;
    check(names.len() == p && names[p - 1].1.len() == p - 1, || {
        format!("gather_object: {names:?}")
    })
}

/// Empty payloads on every rank (what every rank sends when all of a save's steps succeed): nothing to move,
/// which MPI's variable-count gather refuses unless the engine leaves it out.
pub fn empty_payloads(acc: &Accelerator) -> Result<()> {
    let p = acc.num_processes();
    let gathered = acc.process_group().comm().all_gather(Vec::new())?;
    check(gathered == vec![Vec::<u8>::new(); p], || {
        format!("all_gather of nothing: {gathered:?}")
    })?;
    let sent = acc.process_group().comm().broadcast(Vec::new(), p - 1)?;
    check(sent.is_empty(), || {
        format!("broadcast of nothing: {sent:?}")
    })?;
    acc.process_group().agree("empty_payloads", Ok(()))
}

/// reduce: rank r holds `arange(P) + 1 + P*r`; sum, mean, max, min as in `test_ops.py`.
pub fn reduce_ops(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    let mine: Vec<f32> = (0..p).map(|i| (i + 1 + p * r) as f32).collect();
    let t = || Tensor::<1>::from_floats(mine.as_slice(), acc.device());
    let column = |i: usize| (0..p).map(move |q| (i + 1 + p * q) as f32);
    for (op, f) in [
        (
            ReduceOp::Sum,
            (|c: Vec<f32>| c.iter().sum::<f32>()) as fn(Vec<f32>) -> f32,
        ),
        (ReduceOp::Mean, |c: Vec<f32>| {
            c.iter().sum::<f32>() / c.len() as f32
        }),
        (ReduceOp::Max, |c: Vec<f32>| {
            c.iter().cloned().fold(f32::MIN, f32::max)
        }),
        (ReduceOp::Min, |c: Vec<f32>| {
            c.iter().cloned().fold(f32::MAX, f32::min)
        }),
    ] {
        let got = floats(acc.reduce(t(), op)?);
        let expected: Vec<f32> = (0..p).map(|i| f(column(i).collect())).collect();
        check(got == expected, || {
            format!("reduce {op}: {got:?} != {expected:?}")
        })?;
    }
    // Integers keep their dtype.
    let ints = acc.reduce(
        Tensor::<1, Int>::from_data([r as i64, 1], acc.device()),
        ReduceOp::Sum,
    )?;
    let got: Vec<i64> = ints
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap();
    let expected = vec![(0..p as i64).sum::<i64>(), p as i64];
    check(got == expected, || {
        format!("int reduce: {got:?} != {expected:?}")
    })
}

/// broadcast: everyone gets rank 0's `[1..P]`, then the last rank's value.
pub fn broadcast(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    let mine: Vec<f32> = if r == 0 {
        (1..=p).map(|v| v as f32).collect()
    } else {
        vec![0.0; p]
    };
    let got = floats(acc.broadcast(Tensor::<1>::from_floats(mine.as_slice(), acc.device()), 0)?);
    let expected: Vec<f32> = (1..=p).map(|v| v as f32).collect();
    check(got == expected, || format!("broadcast: {got:?}"))?;
    let last = acc.broadcast_object(&r, p - 1)?;
    check(last == p - 1, || format!("broadcast_object: {last}"))
}

/// pad_across_processes: rank r has `r+2` rows of 10; all become `P+1` rows, data first (or last).
pub fn pad(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    for pad_first in [false, true] {
        let t = Tensor::<2>::ones([r + 2, 10], acc.device());
        let out = acc.pad_across_processes(t, 0, 0.0, pad_first)?;
        check(out.dims() == [p + 1, 10], || {
            format!("pad dims {:?}", out.dims())
        })?;
        let rows: Vec<f32> = floats(out.sum_dim(1)).into_iter().collect();
        let data = vec![10.0; r + 2];
        let zeros = vec![0.0; p + 1 - (r + 2)];
        let expected: Vec<f32> = if pad_first {
            zeros.iter().chain(&data).cloned().collect()
        } else {
            data.iter().chain(&zeros).cloned().collect()
        };
        check(rows == expected, || {
            format!("pad_first={pad_first}: {rows:?}")
        })?;
    }
    // Bool tensors keep their dtype, padded with the pad value.
    let b = Tensor::<1, Bool>::from_data(vec![true; r + 1].as_slice(), acc.device());
    let out = acc.pad_across_processes(b, 0, 0.0, false)?;
    let got: Vec<bool> = out.into_data().try_into_vec::<bool>().unwrap();
    let mut expected = vec![true; r + 1];
    expected.resize(p, false);
    check(got == expected, || format!("bool pad: {got:?}"))
}

/// Triggers: off, then set by the main process only, seen by everyone once, then off again.
pub fn triggers(acc: &Accelerator) -> Result<()> {
    check(!acc.check_trigger()?, || {
        "trigger set before any set_trigger".into()
    })?;
    if acc.is_main_process() {
        acc.set_trigger();
    }
    check(acc.check_trigger()?, || "trigger not seen".into())?;
    check(!acc.check_trigger()?, || "trigger not reset".into())
}

/// dtypes: bf16 and f16 gather and reduce keep their dtype; bool reduce is or/and.
pub fn dtypes(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        if !acc.device().supports_dtype(dtype) {
            continue;
        }
        let t = Tensor::<1>::from_floats([r as f32 + 0.5], acc.device()).cast(dtype);
        let g = acc.gather(t.clone())?;
        check(g.dtype() == DType::from(dtype), || {
            format!("gather dtype {:?}", g.dtype())
        })?;
        let expected: Vec<f32> = (0..p).map(|q| q as f32 + 0.5).collect();
        check(floats(g) == expected, || format!("{dtype:?} gather"))?;
        let s = acc.reduce(t, ReduceOp::Sum)?;
        check(s.dtype() == DType::from(dtype), || {
            format!("reduce dtype {:?}", s.dtype())
        })?;
        let total: f32 = expected.iter().sum();
        check(floats(s) == vec![total], || format!("{dtype:?} reduce"))?;
    }
    let b = Tensor::<1, Bool>::from_data([r == 0, true], acc.device());
    let any: Vec<bool> = acc
        .reduce(b.clone(), ReduceOp::Max)?
        .into_data()
        .try_into_vec()
        .unwrap();
    let all: Vec<bool> = acc
        .reduce(b.clone(), ReduceOp::Min)?
        .into_data()
        .try_into_vec()
        .unwrap();
    check(any == vec![true, true], || format!("bool any: {any:?}"))?;
    check(all == vec![p == 1, true], || format!("bool all: {all:?}"))?;
    let gathered: Vec<bool> = acc.gather(b)?.into_data().try_into_vec().unwrap();
    check(gathered.len() == 2 * p && gathered[0], || {
        format!("bool gather: {gathered:?}")
    })
}

/// split_between_processes: shares are contiguous and cover the input once.
pub fn split(acc: &Accelerator) -> Result<()> {
    let items: Vec<u32> = (0..11).collect();
    let mine = acc.split_between_processes(&items, false);
    let all: Vec<u32> = acc.gather_object(&mine)?.into_iter().flatten().collect();
    check(all == items, || format!("split: {all:?}"))
}

/// Buffers of 256 KiB and more (MPI's blocking path; below it the engine posts non-blocking calls), at the
/// threshold, just past it and well past it, checked value by value: every reduce op in f32, bf16 and f16,
/// integer and bool reductions, gather and broadcast. Values are small integers, exact in every dtype, so
/// sums, maxima and minima must match exactly; a mean may round once in its dtype.
pub fn large_buffers(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    // Rank q's element i is `value(q, i)`, which depends on i only through `i % PERIOD`: each column's expected
    // reduction is looked up in a table of PERIOD entries (computing it element by element, in this unoptimised
    // test code, took longer than the collectives under test).
    const PERIOD: usize = 61;
    let value = |rank: usize, i: usize| ((i * 31 + rank * 17) % PERIOD) as f32 - 30.0;
    let columns: Vec<Vec<f32>> = (0..PERIOD)
        .map(|k| (0..p).map(|q| value(q, k)).collect())
        .collect();
    let expected_of = |op: ReduceOp| -> Vec<f32> {
        columns
            .iter()
            .map(|column| match op {
                ReduceOp::Sum => column.iter().sum::<f32>(),
                ReduceOp::Mean => column.iter().sum::<f32>() / p as f32,
                ReduceOp::Max => column.iter().copied().fold(f32::MIN, f32::max),
                _ => column.iter().copied().fold(f32::MAX, f32::min),
            })
            .collect()
    };
    for bytes in [256 << 10, (256 << 10) + 8, (1 << 20) + 24, 4 << 20] {
        for (dtype, size, eps) in [
            (FloatDType::F32, 4, f32::EPSILON),
            (FloatDType::BF16, 2, 1.0 / 128.0),
            (FloatDType::F16, 2, 1.0 / 1024.0),
        ] {
            if !acc.device().supports_dtype(dtype) {
                continue;
            }
            let n = bytes / size;
            let mine: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
            let t = || Tensor::<1>::from_floats(mine.as_slice(), acc.device()).cast(dtype);
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                let out = acc.reduce(t(), op)?;
                check(out.dtype() == DType::from(dtype), || {
                    format!("{bytes} B {dtype:?} {op}: dtype {:?}", out.dtype())
                })?;
                let got = floats(out);
                check(got.len() == n, || {
                    format!("{bytes} B {dtype:?} {op}: length")
                })?;
                // Only a mean rounds: a sum, max or min of these small integers is exact in every dtype.
                let table: Vec<(f32, f32)> = expected_of(op)
                    .into_iter()
                    .map(|e| match op {
                        ReduceOp::Mean => (e, e.abs() * eps),
                        _ => (e, 0.0),
                    })
                    .collect();
                let bad = got.iter().enumerate().find(|&(i, g)| {
                    let (expected, tolerance) = table[i % PERIOD];
                    (g - expected).abs() > tolerance
                });
                check(bad.is_none(), || {
                    let (i, g) = bad.unwrap();
                    let expected = table[i % PERIOD].0;
                    format!("{bytes} B {dtype:?} {op}: element {i} is {g}, expected {expected}")
                })?;
            }
        }
        let n = bytes / 8;
        let ints = Tensor::<1, Int>::from_data(
            (0..n)
                .map(|i| value(r, i) as i64)
                .collect::<Vec<_>>()
                .as_slice(),
            acc.device(),
        );
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let got: Vec<i64> = acc
                .reduce(ints.clone(), op)?
                .into_data()
                .convert::<i64>()
                .try_into_vec::<i64>()
                .unwrap();
            let table: Vec<i64> = expected_of(op).into_iter().map(|e| e as i64).collect();
            let bad = (0..n).find(|&i| got.get(i) != Some(&table[i % PERIOD]));
            check(got.len() == n && bad.is_none(), || {
                format!("{bytes} B i64 {op}: element {bad:?} of {}", got.len())
            })?;
        }
        // Rank q's flag i is set when `(i + q) % 3 == 0`: each column depends on `i % 3` only.
        let flags: Vec<bool> = (0..bytes).map(|i| (i + r) % 3 == 0).collect();
        let flags = Tensor::<1, Bool>::from_data(flags.as_slice(), acc.device());
        let hits: Vec<usize> = (0..3)
            .map(|k| (0..p).filter(|q| (k + q) % 3 == 0).count())
            .collect();
        for (op, expected) in [
            (
                ReduceOp::Max,
                (|hits: usize, _p: usize| hits > 0) as fn(usize, usize) -> bool,
            ),
            (ReduceOp::Min, |hits: usize, p: usize| hits == p),
        ] {
            let got: Vec<bool> = acc
                .reduce(flags.clone(), op)?
                .into_data()
                .try_into_vec()
                .unwrap();
            let table: Vec<bool> = hits.iter().map(|&h| expected(h, p)).collect();
            let bad = (0..bytes).find(|&i| got.get(i) != Some(&table[i % 3]));
            check(got.len() == bytes && bad.is_none(), || {
                format!("{bytes} B bool {op}: element {bad:?}")
            })?;
        }
        let n = bytes / 4;
        let mine: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        let gathered = floats(acc.gather(Tensor::<1>::from_floats(mine.as_slice(), acc.device()))?);
        let bad = (0..p * n).find(|&j| gathered.get(j) != Some(&value(j / n, j % n)));
        check(gathered.len() == p * n && bad.is_none(), || {
            format!("{bytes} B gather: element {bad:?} of {}", gathered.len())
        })?;
        let root = p - 1;
        let sent = floats(acc.broadcast(
            Tensor::<1>::from_floats(mine.as_slice(), acc.device()),
            root,
        )?);
        let bad = (0..n).find(|&i| sent.get(i) != Some(&value(root, i)));
        check(sent.len() == n && bad.is_none(), || {
            format!("{bytes} B broadcast from rank {root}: element {bad:?}")
        })?;
    }
    Ok(())
}

/// reduce_scatter: every rank's part of the element-wise reduction, for equal parts, uneven parts with an empty
/// one, and parts past 256 KiB in all (MPI's blocking path); every op in f32, sums in i64.
pub fn reduce_scatter(acc: &Accelerator) -> Result<()> {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    let (p, r) = (acc.num_processes(), acc.process_index());
    let comm = acc.process_group().comm();
    let value = |rank: usize, i: usize| ((i * 7 + rank * 13) % 29) as f32 - 14.0;
    for counts in [
        vec![3; p],
        (0..p).map(|q| 2 * q).collect::<Vec<_>>(),
        (0..p).map(|q| (1 << 16) + 5 * q).collect(),
    ] {
        let len: usize = counts.iter().sum();
        let start: usize = counts[..r].iter().sum();
        let mine = || (0..len).map(|i| value(r, i)).collect::<Vec<f32>>();
        let column = |i: usize| (0..p).map(move |q| value(q, i));
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let got = comm.reduce_scatter(ReduceBuffer::F32(mine()), &counts, op)?;
            let expected: Vec<f32> = (start..start + counts[r])
                .map(|i| match op {
                    ReduceOp::Sum => column(i).sum(),
                    ReduceOp::Mean => column(i).sum::<f32>() / p as f32,
                    ReduceOp::Max => column(i).fold(f32::MIN, f32::max),
                    _ => column(i).fold(f32::MAX, f32::min),
                })
                .collect();
            check(got == ReduceBuffer::F32(expected), || {
                format!("reduce_scatter {op} of {len} into {counts:?}: rank {r} got another part")
            })?;
        }
        let ints = (0..len).map(|i| value(r, i) as i64).collect();
        let got = comm.reduce_scatter(ReduceBuffer::I64(ints), &counts, ReduceOp::Sum)?;
        let expected: Vec<i64> = (start..start + counts[r])
            .map(|i| column(i).map(|v| v as i64).sum())
            .collect();
        check(got == ReduceBuffer::I64(expected), || {
            format!("i64 reduce_scatter of {len} into {counts:?}: rank {r}")
        })?;
    }
    // A small part right after a large call holds no more memory than it needs: a sharded rank keeps each
    // reduced gradient slice, and a slice that kept a whole-sized buffer alive held the whole gradient.
    let large = vec![1.0f32; (1 << 18) * p];
    comm.reduce_scatter(ReduceBuffer::F32(large), &vec![1 << 18; p], ReduceOp::Sum)?;
    // And the second of two equal calls, whose previous buffer is P parts (2 on 2 ranks).
    for part_len in [4, 1 << 17, 1 << 17] {
        let small = vec![1.0; part_len * p];
        let got =
            comm.reduce_scatter(ReduceBuffer::F32(small), &vec![part_len; p], ReduceOp::Sum)?;
        if let ReduceBuffer::F32(part) = &got {
            check(part.capacity() <= part_len + part_len / 8 + 64, || {
                format!(
                    "reduce_scatter of {part_len} values a rank after one of 2^18 a rank: the part holds {} \
                     values of memory",
                    part.capacity()
                )
            })?;
        }
    }
    Ok(())
}

/// all_gather_parts: every rank's part, in rank order, for equal parts, uneven parts with an empty one, and
/// parts past 256 KiB in all (MPI's blocking path); f32, f64 and i64; a rank whose part does not match the
/// counts is named on every rank.
pub fn all_gather_parts(acc: &Accelerator) -> Result<()> {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    let (p, r) = (acc.num_processes(), acc.process_index());
    let comm = acc.process_group().comm();
    let value =
        |rank: usize, i: usize| ((i * 7 + rank * 13) % 29) as f32 - 14.0 + rank as f32 * 0.25;
    for counts in [
        vec![3; p],
        (0..p).map(|q| 2 * q).collect::<Vec<_>>(),
        (0..p).map(|q| (1 << 16) + 5 * q).collect(),
    ] {
        let mine: Vec<f32> = (0..counts[r]).map(|i| value(r, i)).collect();
        let expected: Vec<f32> = (0..p)
            .flat_map(|q| (0..counts[q]).map(move |i| value(q, i)))
            .collect();
        let got = comm.all_gather_parts(ReduceBuffer::F32(mine.clone()), &counts)?;
        check(got == ReduceBuffer::F32(expected.clone()), || {
            format!("f32 all_gather_parts of {counts:?}: rank {r} got other values")
        })?;
        let wide = mine.iter().map(|x| f64::from(*x)).collect();
        let got = comm.all_gather_parts(ReduceBuffer::F64(wide), &counts)?;
        let expected_wide = expected.iter().map(|x| f64::from(*x)).collect();
        check(got == ReduceBuffer::F64(expected_wide), || {
            format!("f64 all_gather_parts of {counts:?}: rank {r}")
        })?;
        let ints = mine.iter().map(|x| (*x * 4.0) as i64).collect();
        let got = comm.all_gather_parts(ReduceBuffer::I64(ints), &counts)?;
        let expected_ints = expected.iter().map(|x| (*x * 4.0) as i64).collect();
        check(got == ReduceBuffer::I64(expected_ints), || {
            format!("i64 all_gather_parts of {counts:?}: rank {r}")
        })?;
    }
    if p > 1 {
        // The last rank passes one element too many: every rank's error names it.
        let counts = vec![2; p];
        let len = if r == p - 1 { 3 } else { 2 };
        let err = comm
            .all_gather_parts(ReduceBuffer::F32(vec![1.0; len]), &counts)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        check(
            err.contains(&format!("rank {} passed 3 elements", p - 1)),
            || format!("rank {r}: a part of the wrong length: {err}"),
        )?;
    }
    Ok(())
}

/// reduce (to one rank) and broadcast_buffer (typed, in place): the root gets the all-reduce's bits, the others
/// nothing; every rank gets the root's buffer; small buffers and ones past 256 KiB (MPI's blocking path).
pub fn rooted(acc: &Accelerator) -> Result<()> {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    let (p, r) = (acc.num_processes(), acc.process_index());
    let comm = acc.process_group().comm();
    let value = |rank: usize, i: usize| ((i * 7 + rank * 13) % 29) as f32 - 14.0;
    for len in [5, (1 << 16) + 3] {
        let root = p - 1;
        let mine = || (0..len).map(|i| value(r, i)).collect::<Vec<f32>>();
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let whole = comm.all_reduce(ReduceBuffer::F32(mine()), op)?;
            let reduced = comm.reduce(ReduceBuffer::F32(mine()), root, op)?;
            check(reduced == (r == root).then_some(whole), || {
                format!("reduce {op} of {len} to rank {root}: rank {r}")
            })?;
        }
        let sent = comm.broadcast_buffer(ReduceBuffer::F32(mine()), 0)?;
        let expected: Vec<f32> = (0..len).map(|i| value(0, i)).collect();
        check(sent == ReduceBuffer::F32(expected), || {
            format!("broadcast_buffer of {len} from rank 0: rank {r}")
        })?;
        let ints = (0..len).map(|i| value(r, i) as i64).collect();
        let sent = comm.broadcast_buffer(ReduceBuffer::I64(ints), root)?;
        let expected: Vec<i64> = (0..len).map(|i| value(root, i) as i64).collect();
        check(sent == ReduceBuffer::I64(expected), || {
            format!("i64 broadcast_buffer of {len} from rank {root}: rank {r}")
        })?;
    }
    Ok(())
}

/// Sub-groups (`Communicator::split`): the ranks of each parity form a group, reduce within it, and a mismatch
/// inside the odd group is an error on its ranks naming them by their world ranks (the even group is untouched
/// and goes on). Needs at least 4 ranks.
pub fn sub_groups(acc: &Accelerator) -> Result<()> {
    let (p, r) = (acc.num_processes(), acc.process_index());
    if p < 4 {
        return Ok(());
    }
    let comm = acc.process_group().comm();
    let sub = comm.split(r % 2, r)?;
    let members: Vec<usize> = (r % 2..p).step_by(2).collect();
    check(sub.world_size() == members.len(), || {
        format!("sub-group of rank {r}: {} ranks", sub.world_size())
    })?;
    let sum = sub.all_reduce(
        burn_accelerate::distributed::comm::ReduceBuffer::F64(vec![r as f64]),
        ReduceOp::Sum,
    )?;
    let expected: f64 = members.iter().map(|m| *m as f64).sum();
    check(
        sum == burn_accelerate::distributed::comm::ReduceBuffer::F64(vec![expected]),
        || format!("sub-group sum on rank {r}: {sum:?}, expected {expected}"),
    )?;
    if r % 2 == 1 {
        // The odd group's first member calls something else than the others.
        let outcome = if r == 1 {
            sub.barrier().map(|_| ())
        } else {
            sub.broadcast(vec![1, 2, 3], 0).map(|_| ())
        };
        let err = match outcome {
            Ok(()) => {
                return check(false, || {
                    format!("rank {r}: a mismatch in a sub-group passed")
                });
            }
            Err(e) => e.to_string(),
        };
        let names_world = members.iter().all(|m| err.contains(&format!("rank {m}:")));
        check(names_world, || {
            format!("rank {r}: the sub-group's error does not name world ranks {members:?}: {err}")
        })?;
    }
    acc.wait_for_everyone()
}

/// Point-to-point batches (`Communicator::send_recv`): a ring in which each rank sends to the next and receives
/// from the previous in one batch (two messages each way, in order, one past 256 KiB, MPI's rendezvous size), a
/// message to itself, pairs that exchange both ways, and a receive that expects another length than was sent: an
/// error on the receiving rank, naming both, while the sender completes.
pub fn point_to_point(acc: &Accelerator) -> Result<()> {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    let (p, r) = (acc.num_processes(), acc.process_index());
    let comm = acc.process_group().comm();
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    let small = |rank: usize| ReduceBuffer::F32((0..5).map(|i| (rank * 10 + i) as f32).collect());
    let large = |rank: usize| {
        ReduceBuffer::I64((0..(1 << 16) + 3).map(|i| (rank * 7 + i) as i64).collect())
    };
    let got = comm.send_recv(
        vec![(next, small(r)), (next, large(r)), (r, small(r + 100))],
        vec![
            (prev, ReduceBuffer::F32(vec![0.0; 5])),
            (prev, ReduceBuffer::I64(vec![0; (1 << 16) + 3])),
            (r, ReduceBuffer::F32(vec![0.0; 5])),
        ],
    )?;
    check(
        got == vec![small(prev), large(prev), small(r + 100)],
        || format!("ring send_recv on rank {r}: wrong messages or order"),
    )?;
    if p >= 2 && r < p - p % 2 {
        let partner = r ^ 1;
        let got = comm.send_recv(
            vec![(partner, ReduceBuffer::F64(vec![r as f64; 3]))],
            vec![(partner, ReduceBuffer::F64(vec![0.0; 3]))],
        )?;
        check(
            got == vec![ReduceBuffer::F64(vec![partner as f64; 3])],
            || format!("pair exchange on rank {r}: {got:?}"),
        )?;
    }
    if p >= 2 && r < 2 {
        let outcome = if r == 0 {
            comm.send_recv(vec![(1, ReduceBuffer::F32(vec![1.0; 3]))], vec![])
        } else {
            comm.send_recv(vec![], vec![(0, ReduceBuffer::F32(vec![0.0; 4]))])
        };
        match (r, outcome) {
            (0, outcome) => {
                outcome?;
            }
            (_, Ok(_)) => return check(false, || "a receive of the wrong length passed".into()),
            (_, Err(e)) => {
                let e = e.to_string();
                check(
                    e.contains("rank 0 sent 3 x f32, rank 1 expected 4 x f32"),
                    || format!("the mismatch's error on rank 1: {e}"),
                )?;
            }
        }
    }
    acc.wait_for_everyone()
}

/// Sub-groups used from threads of their own (`Communicator::concurrent`): a copy of the world (`split` with one
/// color) runs all-reduces on a thread while the rank's own thread runs the world's, and the ranks enter them in
/// opposite orders (rank 0 starts the copy's call first, then waits in the world's barrier; the others the
/// reverse), which completes only if neither communicator holds the other up.
pub fn concurrent_sub_groups(acc: &Accelerator) -> Result<()> {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    let (p, r) = (acc.num_processes(), acc.process_index());
    let comm = acc.process_group().comm();
    if !comm.concurrent() {
        return Ok(());
    }
    let copy = comm.split(0, r)?;
    let (barrier_done, after_barrier) = std::sync::mpsc::channel::<()>();
    let worker = {
        let copy = copy.clone();
        std::thread::spawn(
            move || -> burn_accelerate::distributed::comm::CommResult<Vec<ReduceBuffer>> {
                if r != 0 {
                    // Ranks other than 0 reach the copy's calls only once their world barrier has completed,
                    // which needs rank 0's: rank 0's copy call must not keep its world barrier waiting.
                    let _ = after_barrier.recv();
                }
                (0..20)
                    .map(|i| {
                        copy.all_reduce(ReduceBuffer::I64(vec![(r + i) as i64; 3]), ReduceOp::Sum)
                    })
                    .collect()
            },
        )
    };
    comm.barrier()?;
    let _ = barrier_done.send(());
    let mut world = Vec::new();
    for i in 0..20 {
        world.push(comm.all_reduce(ReduceBuffer::F64(vec![(r * i) as f64]), ReduceOp::Max)?);
    }
    let copied = worker
        .join()
        .map_err(|_| burn_accelerate::Error::other("the sub-group's thread panicked"))??;
    let ranks: i64 = (0..p as i64).sum();
    for (i, (c, w)) in copied.iter().zip(&world).enumerate() {
        check(
            *c == ReduceBuffer::I64(vec![ranks + (p * i) as i64; 3]),
            || format!("rank {r}: the copy's all-reduce {i}: {c:?}"),
        )?;
        check(*w == ReduceBuffer::F64(vec![((p - 1) * i) as f64]), || {
            format!("rank {r}: the world's all-reduce {i}: {w:?}")
        })?;
    }
    acc.wait_for_everyone()
}

/// Every check above, in one order on every rank.
pub fn run_all(acc: &Accelerator) -> Result<()> {
    gather_values(acc)?;
    gather_uneven(acc)?;
    gather_object(acc)?;
    empty_payloads(acc)?;
    reduce_ops(acc)?;
    broadcast(acc)?;
    pad(acc)?;
    triggers(acc)?;
    dtypes(acc)?;
    split(acc)?;
    large_buffers(acc)?;
    reduce_scatter(acc)?;
    all_gather_parts(acc)?;
    rooted(acc)?;
    sub_groups(acc)?;
    point_to_point(acc)?;
    concurrent_sub_groups(acc)?;
    acc.wait_for_everyone()
}
