//! All-reduce bandwidth, as ratios against a baseline measured in the same run.
//!
//! - In-process engine (2 ranks as threads) against a plain `memcpy` of the same size:
//!   `cargo bench -p burn-accelerate-examples --bench collectives`. Prints a table per size, the small-message latency
//!   (`inproc_allreduce_4k_latency_us`), and `inproc_allreduce_memcpy_ratio` at 16 MiB: busbw over memcpy
//!   bandwidth, the median of rounds that each time one all-reduce and one memcpy back to back, with the noise
//!   floor (`noise_floor`: the same pairing of memcpy against memcpy). Then `sync_overhead_ratio`: the gradient
//!   sync of a `backward` sync step (to the host, reduce, back to the device; buckets for small gradients) on
//!   25 MB of fresh gradients in 4 tensors, over the communicator's raw all-reduce of the same bytes in one
//!   reused buffer, with its own noise floor (raw against raw).
//! - MPI engine against raw rsmpi `all_reduce_into` on the same buffers (feature `mpi`, under `mpirun`):
//!   `cargo bench -p burn-accelerate-examples --features mpi --bench collectives --no-run`, then
//!   `mpirun -np 2 <the printed bench binary> --bench` (`-x MPI_BENCH_SELF_CHECK=1` runs raw against raw, to
//!   show the noise floor of the ratio on the machine). The same run times our reduce-scatter against raw
//!   rsmpi `reduce_scatter_block_into` (16 MiB in equal parts): `mpi_reduce_scatter_ratio`; and our all-gather
//!   of uneven parts against raw `all_gather_varcount_into` (16 MiB in all): `mpi_all_gather_parts_ratio`
//!   (the raw call gathers into a new buffer, as ours returns one) and `mpi_all_gather_parts_reused_ratio`
//!   (the raw call reuses its receive buffer).
//!
//! Sizes run from 4 KiB to 64 MiB of f32. algbw = bytes / time; busbw = algbw * 2(n-1)/n.

#[path = "../tests/support/stats.rs"]
mod stats;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use stats::{median, paired_ratio};

use burn::tensor::Tensor;
use burn_accelerate::distributed::comm::{Communicator, InProcessGroup, ReduceBuffer, ReduceOp};

const SIZES: [usize; 6] = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];
const RATIO_SIZE: usize = 16 << 20;

fn iterations(bytes: usize) -> usize {
    ((1024usize << 20) / bytes).clamp(40, 400)
}

fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

/// Time of one all-reduce on `n` in-process ranks (median over rounds), measured on rank 0.
fn in_process(n: usize, bytes: usize) -> Duration {
    let group = InProcessGroup::new(n, Duration::from_secs(120));
    let iters = iterations(bytes);
    let start_line = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let comm = group.comm(rank);
            let start_line = start_line.clone();
            std::thread::spawn(move || {
                let mut buf = ReduceBuffer::F32(vec![0.0; bytes / 4]);
                let mut times = Vec::with_capacity(iters);
                for i in 0..iters + 2 {
                    start_line.wait();
                    let t = Instant::now();
                    buf = comm.all_reduce(buf, ReduceOp::Sum).unwrap();
                    if i >= 2 {
                        times.push(t.elapsed());
                    }
                }
                times
            })
        })
        .collect();
    let mut all: Vec<Vec<Duration>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    median(all.swap_remove(0))
}

fn memcpy(bytes: usize) -> Duration {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let mut times = Vec::new();
    for i in 0..iterations(bytes) + 2 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        if i >= 2 {
            times.push(t.elapsed());
        }
    }
    median(times)
}

/// Rounds of (all-reduce on 2 ranks, then memcpy on rank 0) and of (memcpy, memcpy), each pair back to back;
/// returns (busbw / memcpy bandwidth, memcpy / memcpy) as medians of the paired ratios.
fn paired_in_process(bytes: usize, rounds: usize) -> (f64, f64) {
    let n = 2;
    let group = InProcessGroup::new(n, Duration::from_secs(120));
    let line = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let comm = group.comm(rank);
            let line = line.clone();
            std::thread::spawn(move || {
                let mut buf = ReduceBuffer::F32(vec![1.0; bytes / 4]);
                let src = vec![1.0f32; bytes / 4];
                let mut dst = vec![0.0f32; bytes / 4];
                let mut copy = || {
                    let t = Instant::now();
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                    t.elapsed()
                };
                let (mut reduce, mut first, mut second, mut third) =
                    (vec![], vec![], vec![], vec![]);
                for i in 0..rounds + 2 {
                    line.wait();
                    let t = Instant::now();
                    buf = comm.all_reduce(buf, ReduceOp::Sum).unwrap();
                    let r = t.elapsed();
                    line.wait();
                    if rank == 0 && i >= 2 {
                        reduce.push(r);
                        first.push(copy());
                        second.push(copy());
                        third.push(copy());
                    }
                }
                (reduce, first, second, third)
            })
        })
        .collect();
    let mut all: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (reduce, first, second, third) = all.swap_remove(0);
    let busbw_factor = 2.0 * (n - 1) as f64 / n as f64;
    // busbw / memcpy bandwidth = (bytes * factor / t_reduce) / (bytes / t_copy) = factor * t_copy / t_reduce.
    let ratio = busbw_factor * paired_ratio(&first, &reduce);
    let floor = paired_ratio(&third, &second);
    (ratio, floor)
}

/// (sync path / raw all-reduce, raw / raw) on 2 in-process ranks, `bytes` of f32 gradients in 4 tensors.
fn sync_overhead(bytes: usize, rounds: usize) -> (f64, f64) {
    let per_tensor = bytes / 4 / 4;
    let results = burn_accelerate::launch(2, |acc| {
        // Fresh gradients each round, as backward hands them over (owned by the gradient store alone).
        let grads = || -> Vec<Tensor<1>> {
            (0..4)
                .map(|i| Tensor::<1>::full([per_tensor], i as f32 + 0.5, acc.device()).inner())
                .collect()
        };
        let mut host = ReduceBuffer::F32(vec![0.5; per_tensor * 4]);
        let comm = acc.process_group().comm().clone();
        let (mut sync, mut raw, mut raw_again) = (vec![], vec![], vec![]);
        for i in 0..rounds + 2 {
            let round = grads();
            acc.wait_for_everyone()?;
            let t = Instant::now();
            let out = burn_accelerate::accelerator::internals::sync_flat_gradients(&acc, round)?;
            std::hint::black_box(out);
            let s = t.elapsed();
            acc.wait_for_everyone()?;
            let t = Instant::now();
            host = comm.all_reduce(host, ReduceOp::Mean)?;
            let r = t.elapsed();
            acc.wait_for_everyone()?;
            let t = Instant::now();
            host = comm.all_reduce(host, ReduceOp::Mean)?;
            let r2 = t.elapsed();
            if i >= 2 {
                sync.push(s);
                raw.push(r);
                raw_again.push(r2);
            }
        }
        Ok((paired_ratio(&sync, &raw), paired_ratio(&raw_again, &raw)))
    })
    .expect("the sync bench runs");
    results[0]
}

fn in_process_report() {
    let n = 2;
    println!("engine=in-process ranks={n} (threads) baseline=memcpy");
    for bytes in SIZES {
        let t = in_process(n, bytes);
        let m = memcpy(bytes);
        let algbw = gbps(bytes, t);
        let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
        let copy = gbps(bytes, m);
        println!(
            "size={} time_us={:.1} algbw_GBps={algbw:.2} busbw_GBps={busbw:.2} memcpy_GBps={copy:.2} ratio={:.3}",
            label(bytes),
            t.as_secs_f64() * 1e6,
            busbw / copy
        );
        if bytes == 4 << 10 {
            println!(
                "inproc_allreduce_4k_latency_us={:.1}",
                t.as_secs_f64() * 1e6
            );
        }
    }
    let (ratio, floor) = paired_in_process(RATIO_SIZE, 61);
    let (sync, sync_floor) = sync_overhead(25_000_000, 31);
    println!(
        "sync_overhead_ratio={sync:.3} (25 MB of fresh gradients in 4 tensors vs one raw all-reduce of 25 MB, 2 ranks, median of 31 paired rounds)"
    );
    println!("sync_noise_floor={sync_floor:.3} (raw all-reduce against raw all-reduce)");
    println!(
        "inproc_allreduce_memcpy_ratio={ratio:.3} (16 MiB, 2 ranks, median of 61 paired rounds)"
    );
    println!("noise_floor={floor:.3} (memcpy against memcpy, same pairing; 1.000 is no noise)");
}

#[cfg(feature = "mpi")]
fn mpi_report() {
    use burn_accelerate::mpi::MpiComm;
    use burn_accelerate::mpi::mpi::collective::SystemOperation;
    use burn_accelerate::mpi::mpi::traits::*;

    let comm = MpiComm::init(Duration::from_secs(120)).expect("MPI");
    // MPI_BENCH_SELF_CHECK=1 measures raw against raw, to show the noise floor of the ratio.
    let self_check = std::env::var_os("MPI_BENCH_SELF_CHECK").is_some();
    let world = comm.raw();
    let n = comm.world_size();
    let main = comm.rank() == 0;
    if main {
        println!("engine=mpi ranks={n} baseline=raw rsmpi all_reduce_into");
    }
    for bytes in SIZES {
        let elems = bytes / 4;
        let iters = iterations(bytes);
        let send = vec![1.0f32; elems];
        let mut recv = vec![0.0f32; elems];
        let mut ours = ReduceBuffer::F32(vec![1.0f32; elems]);
        let mut recv2 = vec![0.0f32; elems];
        let (mut raw_t, mut our_t) = (Vec::new(), Vec::new());
        for i in 0..iters + 2 {
            // Alternate which goes first, so that drift in machine load and cache state falls on both.
            let mut raw = Duration::ZERO;
            let mut our = Duration::ZERO;
            for turn in [i % 2, 1 - i % 2] {
                world.barrier();
                let t = Instant::now();
                if turn == 0 {
                    world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                    raw = t.elapsed();
                } else if self_check {
                    // Noise floor: the "ours" side runs the raw call too.
                    world.all_reduce_into(&send[..], &mut recv2[..], SystemOperation::sum());
                    our = t.elapsed();
                } else {
                    ours = comm.all_reduce(ours, ReduceOp::Sum).expect("all_reduce");
                    our = t.elapsed();
                }
            }
            if i >= 2 {
                raw_t.push(raw);
                our_t.push(our);
            }
        }
        // Paired ratios (same iteration, back to back) cancel slow drift in machine load.
        let ratio = stats::paired_ratio(&raw_t, &our_t);
        let (raw, our) = (median(raw_t), median(our_t));
        let bus = |t| gbps(bytes, t) * 2.0 * (n - 1) as f64 / n as f64;
        if main {
            println!(
                "size={} ours_us={:.1} raw_us={:.1} ours_busbw_GBps={:.2} raw_busbw_GBps={:.2} ratio={:.3}",
                label(bytes),
                our.as_secs_f64() * 1e6,
                raw.as_secs_f64() * 1e6,
                bus(our),
                bus(raw),
                ratio
            );
            if bytes == RATIO_SIZE {
                println!("mpi_allreduce_ratio={ratio:.3}");
            }
        }
    }
    mpi_reduce_scatter(&comm, self_check);
    mpi_all_gather_parts(&comm, self_check);
}

/// Our all-gather of parts (uneven: rank `r` gives `(r + 1)` shares, 16 MiB f32 in all) against raw rsmpi
/// `all_gather_varcount_into` on the same data; prints `mpi_all_gather_parts_ratio` (raw time over ours, paired
/// rounds) against a raw call that gathers into a new buffer each time, as ours returns one, and
/// `mpi_all_gather_parts_reused_ratio` against a raw call that reuses one receive buffer.
#[cfg(feature = "mpi")]
fn mpi_all_gather_parts(comm: &burn_accelerate::mpi::MpiComm, self_check: bool) {
    use burn_accelerate::mpi::mpi::datatype::PartitionMut;
    use burn_accelerate::mpi::mpi::traits::*;

    let world = comm.raw();
    let (n, rank) = (comm.world_size(), comm.rank());
    let share = RATIO_SIZE / 4 / (n * (n + 1) / 2);
    let counts: Vec<usize> = (0..n).map(|r| (r + 1) * share).collect();
    let total: usize = counts.iter().sum();
    let counts_i32: Vec<i32> = counts.iter().map(|c| *c as i32).collect();
    let displs: Vec<i32> = counts_i32
        .iter()
        .scan(0, |acc, c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect();
    let send = vec![rank as f32; counts[rank]];
    let mut reused = vec![0.0f32; total];
    let iters = iterations(RATIO_SIZE);
    for fresh in [true, false] {
        let (mut raw_t, mut our_t) = (Vec::new(), Vec::new());
        for i in 0..iters + 2 {
            let (mut raw, mut our) = (Duration::ZERO, Duration::ZERO);
            for turn in [i % 2, 1 - i % 2] {
                let mine = ReduceBuffer::F32(send.clone());
                world.barrier();
                let t = Instant::now();
                if turn == 0 || self_check {
                    if fresh {
                        let mut recv = vec![0.0f32; total];
                        let mut partition =
                            PartitionMut::new(&mut recv[..], &counts_i32[..], &displs[..]);
                        world.all_gather_varcount_into(&send[..], &mut partition);
                        std::hint::black_box(&recv);
                    } else {
                        let mut partition =
                            PartitionMut::new(&mut reused[..], &counts_i32[..], &displs[..]);
                        world.all_gather_varcount_into(&send[..], &mut partition);
                    }
                    if turn == 0 {
                        raw = t.elapsed();
                    } else {
                        our = t.elapsed();
                    }
                } else {
                    let all = comm
                        .all_gather_parts(mine, &counts)
                        .expect("all_gather_parts");
                    our = t.elapsed();
                    assert_eq!(all.len(), total);
                }
            }
            if i >= 2 {
                raw_t.push(raw);
                our_t.push(our);
            }
        }
        let ratio = stats::paired_ratio(&raw_t, &our_t);
        if comm.rank() == 0 {
            let name = if fresh {
                "mpi_all_gather_parts_ratio"
            } else {
                "mpi_all_gather_parts_reused_ratio"
            };
            println!(
                "size={} all_gather_parts ours_us={:.1} raw_us={:.1} ({}) ratio={ratio:.3}",
                label(RATIO_SIZE),
                median(our_t).as_secs_f64() * 1e6,
                median(raw_t).as_secs_f64() * 1e6,
                if fresh { "new buffer" } else { "reused buffer" }
            );
            println!("{name}={ratio:.3}");
        }
    }
}

/// Our reduce-scatter (equal parts, 16 MiB f32 in all) against raw rsmpi `reduce_scatter_block_into` on the
/// same data; prints `mpi_reduce_scatter_ratio` (raw time over ours, paired rounds).
#[cfg(feature = "mpi")]
fn mpi_reduce_scatter(comm: &burn_accelerate::mpi::MpiComm, self_check: bool) {
    use burn_accelerate::mpi::mpi::collective::SystemOperation;
    use burn_accelerate::mpi::mpi::traits::*;

    let world = comm.raw();
    let n = comm.world_size();
    let elems = RATIO_SIZE / 4;
    let block = elems / n;
    let counts = vec![block; n];
    let send = vec![1.0f32; block * n];
    let mut recv = vec![0.0f32; block];
    let (mut raw_t, mut our_t) = (Vec::new(), Vec::new());
    let iters = iterations(RATIO_SIZE);
    for i in 0..iters + 2 {
        let mut raw = Duration::ZERO;
        let mut our = Duration::ZERO;
        for turn in [i % 2, 1 - i % 2] {
            // The engine takes its buffer by value, as the gradients it reduces: made outside the timing.
            let mine = ReduceBuffer::F32(send.clone());
            world.barrier();
            let t = Instant::now();
            if turn == 0 || self_check {
                world.reduce_scatter_block_into(&send[..], &mut recv[..], SystemOperation::sum());
                if turn == 0 {
                    raw = t.elapsed();
                } else {
                    our = t.elapsed();
                }
            } else {
                let part = comm
                    .reduce_scatter(mine, &counts, ReduceOp::Sum)
                    .expect("reduce_scatter");
                our = t.elapsed();
                assert_eq!(part.len(), block);
            }
        }
        if i >= 2 {
            raw_t.push(raw);
            our_t.push(our);
        }
    }
    let ratio = stats::paired_ratio(&raw_t, &our_t);
    if comm.rank() == 0 {
        println!(
            "size={} reduce_scatter ours_us={:.1} raw_us={:.1} ratio={ratio:.3}",
            label(RATIO_SIZE),
            median(our_t).as_secs_f64() * 1e6,
            median(raw_t).as_secs_f64() * 1e6
        );
        println!("mpi_reduce_scatter_ratio={ratio:.3}");
    }
}

fn main() {
    #[cfg(feature = "mpi")]
    if burn_accelerate::distributed::cluster::launched_by_mpi() {
        mpi_report();
        return;
    }
    in_process_report();
}
