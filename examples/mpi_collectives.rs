//! The collectives suite of `tests/suite/collectives.rs`, for real processes: run it with
//! `mpirun -np 2 target/release/examples/mpi_collectives` after
//! `cargo build --release --features mpi --example mpi_collectives`. Each rank prints `suite passed on rank i of n`
//! and the program exits non-zero on the first failed check.

#[path = "../tests/support/collectives_suite.rs"]
mod suite;

use burn_accelerate::Accelerator;

/// `--skip`: the last rank skips a reduce; the others must get a timeout naming it.
fn skip_scenario() {
    use burn::tensor::Tensor;
    use std::time::Duration;
    let accelerator = Accelerator::builder()
        .collective_timeout(Duration::from_secs(1))
        .build()
        .expect("accelerator");
    let last = accelerator.num_processes() - 1;
    if accelerator.process_index() == last {
        // Long enough that the others can only be released by their 1 s timeout.
        std::thread::sleep(Duration::from_secs(8));
        println!("rank {last} skipped the reduce");
        return;
    }
    let start = std::time::Instant::now();
    let t = Tensor::<1>::ones([8], accelerator.device());
    match accelerator.reduce(t, burn_accelerate::ReduceOp::Sum) {
        Err(e) => println!(
            "rank {} got after {:.1}s: {e}",
            accelerator.process_index(),
            start.elapsed().as_secs_f64()
        ),
        Ok(_) => println!(
            "rank {} unexpectedly completed",
            accelerator.process_index()
        ),
    }
    // Leave the other waiting ranks time to print before this one's exit aborts the job.
    std::thread::sleep(Duration::from_secs(1));
}

/// `--silent-peer`: rank 0 waits for a message the last rank never sends; rank 0 must get a timeout naming it.
fn silent_peer_scenario() {
    use burn_accelerate::distributed::comm::ReduceBuffer;
    use std::time::Duration;
    let accelerator = Accelerator::builder()
        .collective_timeout(Duration::from_secs(1))
        .build()
        .expect("accelerator");
    let last = accelerator.num_processes() - 1;
    if accelerator.process_index() == 0 {
        let start = std::time::Instant::now();
        let comm = accelerator.process_group().comm();
        match comm.send_recv(vec![], vec![(last, ReduceBuffer::F32(vec![0.0; 4]))]) {
            Err(e) => println!(
                "rank 0 got after {:.1}s: {e}",
                start.elapsed().as_secs_f64()
            ),
            Ok(_) => println!("rank 0 unexpectedly received"),
        }
    } else if accelerator.process_index() == last {
        // Long enough that rank 0 can only be released by its 1 s timeout.
        std::thread::sleep(Duration::from_secs(4));
    }
}

fn main() {
    if std::env::args().any(|a| a == "--skip") {
        skip_scenario();
        return;
    }
    if std::env::args().any(|a| a == "--silent-peer") {
        silent_peer_scenario();
        return;
    }
    let run = || -> burn_accelerate::Result<(usize, usize)> {
        for debug in [false, true] {
            let accelerator = Accelerator::builder().debug(debug).build()?;
            suite::run_all(&accelerator)?;
        }
        let accelerator = Accelerator::new()?;
        Ok((accelerator.process_index(), accelerator.num_processes()))
    };
    match run() {
        Ok((rank, world)) => println!("suite passed on rank {rank} of {world}"),
        Err(e) => {
            eprintln!("suite failed: {e}");
            std::process::exit(1);
        }
    }
}
