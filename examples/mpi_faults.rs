//! One rank misbehaves while the others all-reduce: the fault matrix of `tests/mpi/faults_mpi.rs`, for real processes.
//!
//! `mpirun -np 3 target/release/examples/mpi_faults --fault <kind> --bytes <n> [--timeout <secs>]`, after
//! `cargo build --release --features mpi --example mpi_faults`. Rank 1 does `<kind>` where every other rank
//! all-reduces `<n>` bytes of f32 (debug mode off):
//!
//! - `panic`: panics; `error`: returns an error (exit status 1); `sigkill`: is killed by SIGKILL;
//! - `collective`: calls `barrier` instead; `length`: all-reduces one element more; `silent`: calls nothing;
//! - `save`: every rank saves a state whose folder the main process cannot create (a file is in the way), so
//!   the failure happens on rank 0 and must reach the others at once.
//!
//! - `pipeline-oom`: every rank is a pipeline stage (`pp_size` = the ranks, 2 micro-batches) and the ranks search
//!   for a batch size with `find_executable_batch_size` from 16 rows; the last stage's `after` panics as LibTorch's
//!   out-of-memory failure does for a micro-batch of more than 3 rows. Each rank prints `rank <r> fitted <n>
//!   after trying [..] in <secs>s`.
//!
//! Each rank that gets an error prints `rank <r> got after <secs>s: <error>` and exits with status 1; the test
//! checks the words and that the whole job ends within the collective timeout plus a small margin.

use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn_accelerate::{Accelerator, ReduceOp};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn run(fault: &str, bytes: usize, timeout: Duration) -> Result<(), Box<dyn std::error::Error>> {
    let accelerator = Accelerator::builder()
        .collective_timeout(timeout)
        .debug(false)
        .build()?;
    let len = (bytes / 4).max(1);
    // One collective that every rank passes, so that the fault happens in the middle of a run.
    accelerator.wait_for_everyone()?;
    let rank = accelerator.process_index();
    // When the work starts (after mpirun started every process), for tests that time the job from here.
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    println!("rank {rank} starts at {} ms", since_epoch.as_millis());
    std::io::Write::flush(&mut std::io::stdout())?;
    let start = Instant::now();
    let result = if fault == "save" {
        let blocked =
            std::env::temp_dir().join(format!("mpi-faults-blocked-{}", std::process::id()));
        if rank == 0 {
            std::fs::write(&blocked, b"a file, not a folder")?;
        }
        accelerator.wait_for_everyone()?;
        // Every rank names rank 0's path (its pid): only the main process creates the folder.
        let blocked = accelerator.broadcast_object(&blocked, 0)?;
        let result = accelerator
            .save_state(
                Some(&blocked.join("ckpt")),
                &burn_accelerate::StateToSave::new(),
            )
            .map(|_| ());
        if rank == 0 {
            let _ = std::fs::remove_file(&blocked);
        }
        result
    } else if rank == 1 {
        match fault {
            "panic" => panic!("rank 1 panics on purpose"),
            "error" => {
                return Err("rank 1 returns an error on purpose".into());
            }
            "sigkill" => {
                let pid = std::process::id().to_string();
                std::process::Command::new("kill")
                    .args(["-KILL", &pid])
                    .status()?;
                std::thread::sleep(Duration::from_secs(60));
                unreachable!("SIGKILL ends the process");
            }
            "collective" => accelerator.wait_for_everyone(),
            "length" => {
                let x = Tensor::<1>::ones([len + 1], accelerator.device());
                accelerator.reduce(x, ReduceOp::Sum).map(|_| ())
            }
            "silent" => {
                std::thread::sleep(timeout * 3);
                return Ok(());
            }
            other => {
                return Err(format!(
                    "unknown --fault {other}: use panic, error, sigkill, collective, length, silent, save or pipeline-oom"
                )
                .into());
            }
        }
    } else {
        let x = Tensor::<1>::ones([len], accelerator.device());
        accelerator.reduce(x, ReduceOp::Sum).map(|_| ())
    };
    match result {
        Ok(()) => println!("rank {rank} completed the all-reduce"),
        Err(e) => {
            println!(
                "rank {rank} got after {:.1}s: {e}",
                start.elapsed().as_secs_f64()
            );
            // Let the other ranks print theirs before this one's error exit aborts the job.
            std::thread::sleep(Duration::from_millis(500));
            std::process::exit(1);
        }
    }
    Ok(())
}

/// A stack of linear blocks, for `pipeline-oom`.
#[derive(burn::module::Module, Debug)]
struct Stack {
    input: burn::nn::Linear,
    layers: Vec<burn::nn::Linear>,
    head: burn::nn::Linear,
}

impl burn_accelerate::Blocks for Stack {
    type Block = burn::nn::Linear;
    fn blocks(&self) -> &[burn::nn::Linear] {
        &self.layers
    }
}

/// The `pipeline-oom` fault (see the module's documentation).
fn pipeline_oom(timeout: Duration) -> Result<(), Box<dyn std::error::Error>> {
    use burn::nn::LinearConfig;
    let stages: usize = arg("--stages").and_then(|s| s.parse().ok()).unwrap_or(2);
    let accelerator = Accelerator::builder()
        .collective_timeout(timeout)
        .pp_size(stages)
        .pp_microbatches(2)
        .build()?;
    let (rank, device) = (accelerator.process_index(), accelerator.device().clone());
    let start = Instant::now();
    let mut tried = Vec::new();
    let fitted = accelerator
        .find_executable_batch_size(16, |rows| {
            tried.push(rows);
            let model = Stack {
                input: LinearConfig::new(4, 32).init(&device),
                layers: (0..2 * stages)
                    .map(|_| LinearConfig::new(32, 32).init(&device))
                    .collect(),
                head: LinearConfig::new(32, 1).init(&device),
            };
            let mut model = accelerator.prepare_blocks(model)?;
            let mut optimizer =
                accelerator.prepare_optimizer(burn::optim::SgdConfig::new().init(), 1e-2);
            for _ in 0..2 {
                let x = Tensor::<2>::ones([rows, 4], &device);
                accelerator.backward_batch(
                    &model,
                    x,
                    |m, x| m.input.forward(x.clone()),
                    |layer, h| layer.forward(h).tanh(),
                    |m, h, x| {
                        let micro_batch = x.dims()[0];
                        if micro_batch > 3 {
                            panic!("CUDA out of memory. Tried to allocate 2.00 GiB ({micro_batch} rows)");
                        }
                        m.head.forward(h).powi_scalar(2).mean()
                    },
                )?;
                model = optimizer.try_step(model)?;
            }
            Ok::<_, burn_accelerate::Error>(rows)
        })
        .map_err(|e| e.to_string())?;
    println!(
        "rank {rank} fitted {fitted} after trying {tried:?} in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() {
    let fault = arg("--fault").unwrap_or_else(|| "panic".into());
    let bytes: usize = arg("--bytes").and_then(|b| b.parse().ok()).unwrap_or(1024);
    let timeout =
        Duration::from_secs_f64(arg("--timeout").and_then(|t| t.parse().ok()).unwrap_or(5.0));
    let result = match fault.as_str() {
        "pipeline-oom" => pipeline_oom(timeout),
        _ => run(&fault, bytes, timeout),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
