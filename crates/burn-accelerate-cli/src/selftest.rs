//! `burn-accelerate test`: checks that this machine (and the machines of a hostfile) can run distributed
//! training: collectives, Accelerate's data sharding, and a short training whose result must equal one process
//! with the combined batch. Prints Accelerate's success line, or what failed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{Accelerator, ReduceOp, Result};
use clap::Args;

use crate::launch::{LaunchArgs, LaunchError};

/// Accelerate's line for a working setup.
pub const SUCCESS: &str = "Test is a success! You are ready for your distributed training!";

/// What `test` takes.
#[derive(Args, Debug, Clone)]
pub struct TestArgs {
    /// Processes to test with (default: the config file's num_processes, else 1).
    #[arg(long = "num-processes", visible_alias = "num_processes")]
    pub num_processes: Option<usize>,
    /// mpirun's hostfile: every machine is checked for reachability first.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// The GPU kit's checks of NCCL's communicator lifecycle instead of the usual ones (one in-process rank per
    /// GPU): `split` or `failing-group`.
    #[arg(long = "nccl-lifecycle", hide = true)]
    pub nccl_lifecycle: Option<String>,
}

/// The checks one rank runs; every rank learns whether all passed.
pub fn worker(acc: Accelerator) -> Result<Vec<String>> {
    let mut failures = Vec::new();
    let (rank, world) = (acc.process_index(), acc.num_processes());
    let device = acc.device().clone();
    // Drawn by the local main rank on a terminal only.
    let bar = acc.progress_bar(5, "checks");
    bar.set_message("collectives");
    // Collectives.
    let sum = acc
        .reduce(
            Tensor::<1>::from_floats([rank as f32 + 1.0], &device),
            ReduceOp::Sum,
        )?
        .into_scalar::<f32>();
    if sum != (world * (world + 1) / 2) as f32 {
        failures.push(format!("reduce: rank {rank} got {sum}"));
    }
    let gathered = acc.gather_object(&rank)?;
    if gathered != (0..world).collect::<Vec<_>>() {
        failures.push(format!("gather_object: rank {rank} got {gathered:?}"));
    }
    let root = acc
        .broadcast(
            Tensor::<1>::from_floats([rank as f32 * 10.0 + 7.0], &device),
            0,
        )?
        .into_scalar::<f32>();
    if root != 7.0 {
        failures.push(format!("broadcast: rank {rank} got {root}"));
    }
    bar.inc(1);
    bar.set_message("data sharding");
    // Data sharding: every sample seen exactly once over the ranks, with batches dealt as Accelerate does.
    let n = 4 * world + 3;
    let loader = acc.prepare_dataloader(
        DataLoaderBuilder::new(Ids)
            .batch_size(2)
            .shuffle(5)
            .build(InMemDataset::new((0..n as i64).collect())),
    )?;
    let mut seen = Vec::new();
    for batch in loader.iter() {
        let ids: Vec<i64> = acc.gather_for_metrics_objects(&batch?)?;
        seen.extend(ids);
    }
    seen.sort();
    if seen != (0..n as i64).collect::<Vec<_>>() {
        failures.push(format!("data sharding: rank {rank} saw {seen:?} of 0..{n}"));
    }
    bar.inc(1);
    bar.set_message("training parity");
    // A short training equals one process with the combined batch.
    let (got, want) = parity(&acc)?;
    let diff = if got.len() != want.len() || got.is_empty() {
        f32::NAN
    } else {
        got.iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, |m, d| {
                if m.is_nan() || d.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            })
    };
    // A NaN difference, or weights of different lengths, fail too.
    if diff.is_nan() || diff > 1e-5 {
        failures.push(format!(
            "training parity: rank {rank} differs from one process by {diff}"
        ));
    }
    bar.inc(1);
    bar.set_message("gpu");
    failures.extend(gpu_checks(&acc)?);
    bar.inc(1);
    bar.set_message("agreement");
    let failed = acc.reduce(
        Tensor::<1>::from_floats([failures.len() as f32], &device),
        ReduceOp::Sum,
    )?;
    bar.inc(1);
    bar.finish_and_clear();
    if failed.into_scalar::<f32>() > 0.0 && failures.is_empty() {
        failures.push(format!("rank {rank} passed, another rank did not"));
    }
    Ok(failures)
}

/// On a GPU: the device gradient transport against host memory, and a half-precision step (bf16 and fp16
/// where the device has them) against f32. Prints what ran on the main rank; returns the failures.
fn gpu_checks(acc: &Accelerator) -> Result<Vec<String>> {
    let group = acc.process_group();
    let on_gpu = group
        .backend()
        .is_some_and(|b| !b.is_cpu() && b != burn_accelerate::Backend::LibTorch);
    let main = acc.is_main_process();
    if !on_gpu {
        if main {
            println!(
                "GPU checks: skipped (the ranks run on {})",
                describe_backend(group.backend())
            );
        }
        return Ok(Vec::new());
    }
    let mut failures = Vec::new();
    let rank = acc.process_index();
    match acc.check_gradient_transport()? {
        Some(check) => {
            for dtype in &check.dtypes {
                if main {
                    println!(
                        "GPU: {}: {:?} max |device - f64 reference| = {:.2e} (bound {:.2e})",
                        check.transport, dtype.dtype, dtype.max_error, dtype.bound
                    );
                }
                if !dtype.passed() {
                    let which = dtype
                        .first_wrong
                        .map(|i| format!(", the first at index {i}"))
                        .unwrap_or_default();
                    failures.push(format!(
                        "device all-reduce ({:?}): rank {rank} differs from the exact mean by {} (bound {}): {} of \
                         {} elements beyond the bound{which}",
                        dtype.dtype, dtype.max_error, dtype.bound, dtype.wrong, dtype.checked
                    ));
                }
            }
            for (name, collective) in &check.collectives {
                if main {
                    println!(
                        "GPU: {}: {name} max |device - f64 reference| = {:.2e} (bound {:.2e})",
                        check.transport, collective.max_error, collective.bound
                    );
                }
                if !collective.passed() {
                    let which = collective
                        .first_wrong
                        .map(|i| format!(", the first at index {i}"))
                        .unwrap_or_default();
                    failures.push(format!(
                        "device {name}: rank {rank} differs from the exact values by {} (bound {}): {} of {} \
                         elements beyond the bound{which}",
                        collective.max_error, collective.bound, collective.wrong, collective.checked
                    ));
                }
            }
            for (name, training) in &check.training {
                if main {
                    println!(
                        "GPU: {}: {name}: max |weights - the device alone's| = {:.2e} (bound {:.2e})",
                        check.transport, training.max_error, training.bound
                    );
                }
                if !training.passed() {
                    failures.push(format!(
                        "{name} through the device transport: rank {rank}'s weights differ from training on the \
                         device alone by {} (bound {}): {} of {} weights beyond the bound",
                        training.max_error, training.bound, training.wrong, training.checked
                    ));
                }
            }
            for (name, training) in &check.without_host_buffers {
                let control = check
                    .control_bytes
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(0, |(_, c)| *c);
                if main {
                    println!(
                        "GPU: {}: {name} with no buffer through host memory: max |weights - the host path's| = \
                         {:.2e} (bound {:.2e}), control_bytes={control} (budget {})",
                        check.transport, training.max_error, training.bound, check.control_budget
                    );
                }
                if control > check.control_budget {
                    failures.push(format!(
                        "{name} with no buffer through host memory: {control} control bytes through host memory, \
                         past the budget of {}",
                        check.control_budget
                    ));
                }
                if !training.passed() {
                    failures.push(format!(
                        "{name} with no buffer through host memory: its weights differ from the host path's by \
                         {} (bound {}): {} of {} weights beyond the bound",
                        training.max_error, training.bound, training.wrong, training.checked
                    ));
                }
            }
            if check.dtypes.is_empty() {
                failures.push(format!("device all-reduce: rank {rank} checked no dtype"));
            }
        }
        None if main && acc.num_processes() > 1 => {
            println!(
                "GPU: gradients go through host memory ({})",
                burn_accelerate::distributed::describe_gradient_transport(acc.config())
            );
        }
        None if main => {
            // One rank: NCCL would have been checked on a one-rank communicator where it can run.
            println!(
                "GPU: no device transport was checked: one rank, and no one-rank NCCL communicator here ({})",
                burn_accelerate::distributed::describe_gradient_transport(acc.config())
            );
        }
        None => {}
    }
    let device = acc.device().clone();
    for dtype in [burn::tensor::DType::BF16, burn::tensor::DType::F16] {
        if !device.supports_dtype(dtype) {
            if main {
                println!("GPU: {dtype:?} not supported by {device:?}, skipped");
            }
            continue;
        }
        match half_step_difference(&device, dtype) {
            Ok(relative) if relative <= 2e-2 => {
                if main {
                    println!("GPU: {dtype:?} step within {relative:.1e} of f32");
                }
            }
            Ok(relative) => failures.push(format!(
                "{dtype:?} step: rank {rank} is {relative} (relative) from f32"
            )),
            Err(e) => failures.push(format!("{dtype:?} step: rank {rank}: {e}")),
        }
    }
    Ok(failures)
}

fn describe_backend(backend: Option<burn_accelerate::Backend>) -> String {
    backend.map_or_else(|| "an explicit device".into(), |b| b.to_string())
}

/// The gradient of a small matmul loss in `dtype` against f32, as the largest difference relative to the f32
/// gradient's largest value.
fn half_step_difference(device: &Device, dtype: burn::tensor::DType) -> Result<f32> {
    let grad = |dtype: burn::tensor::DType| -> Result<Vec<f32>> {
        let x: Vec<f32> = (0..64 * 32)
            .map(|i| ((i * 13) % 17) as f32 * 0.05 - 0.4)
            .collect();
        let w: Vec<f32> = (0..32 * 16)
            .map(|i| ((i * 7) % 11) as f32 * 0.04 - 0.2)
            .collect();
        let x = Tensor::<1>::from_floats(x.as_slice(), device)
            .reshape([64, 32])
            .cast(dtype);
        let w = Tensor::<1>::from_floats(w.as_slice(), device)
            .reshape([32, 16])
            .cast(dtype)
            .require_grad();
        let loss = x.matmul(w.clone()).tanh().powi_scalar(2).mean();
        let grads = loss.backward();
        let g = w.grad(&grads).ok_or_else(|| {
            burn_accelerate::Error::InvalidArgument("no gradient for the weight".into())
        })?;
        g.cast(burn::tensor::DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| burn_accelerate::Error::InvalidArgument(format!("{e:?}")))
    };
    let reference = grad(burn::tensor::DType::F32)?;
    let half = grad(dtype)?;
    let scale = reference
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(1e-12);
    Ok(reference
        .iter()
        .zip(&half)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f32::max))
}

/// Batches of sample ids.
#[derive(Clone)]
struct Ids;

impl Batcher<i64, Vec<i64>> for Ids {
    fn batch(&self, items: Vec<i64>, _: &Device) -> Vec<i64> {
        items
    }
}

/// Weights after 3 SGD steps through the accelerator (4 samples per rank per step), and the same from one
/// process with the combined batch.
fn parity(acc: &Accelerator) -> Result<(Vec<f32>, Vec<f32>)> {
    let (rank, world) = (acc.process_index(), acc.num_processes());
    let device = acc.device().clone();
    let sample = |i: usize| -> (Vec<f32>, f32) {
        let x = vec![(i % 7) as f32 / 7.0, (i % 5) as f32 / 5.0, 1.0];
        let y = 0.5 * x[0] - 2.0 * x[1] + 0.25;
        (x, y)
    };
    let batch = |ids: Vec<usize>, device: &Device| -> (Tensor<2>, Tensor<2>) {
        let (xs, ys): (Vec<Vec<f32>>, Vec<f32>) = ids.iter().map(|&i| sample(i)).unzip();
        let n = ids.len();
        let x = Tensor::from_data(TensorData::new(xs.concat(), [n, 3]), device);
        let y = Tensor::from_data(TensorData::new(ys, [n, 1]), device);
        (x, y)
    };
    let weights = |model: &Linear| {
        model
            .weight
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap_or_default()
    };
    let start: Linear = LinearConfig::new(3, 1).with_bias(false).init(&device);
    let start = acc.prepare_model(start)?; // rank 0's weights everywhere
    // Reference: one process, batches of 4 * world, plain Burn.
    let mut reference = start.clone();
    let mut sgd = SgdConfig::new().init();
    for step in 0..3 {
        let (x, y) = batch(
            (step * 4 * world..(step + 1) * 4 * world).collect(),
            &device,
        );
        let loss = (reference.forward(x) - y).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = sgd.step(0.1, reference, grads);
    }
    // Through the accelerator: this rank's 4 samples of each step.
    let mut model = start;
    let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 0.1);
    for step in 0..3 {
        let first = step * 4 * world + rank * 4;
        let (x, y) = batch((first..first + 4).collect(), &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        acc.backward(loss, &model)?;
        model = optimizer.step(model);
    }
    Ok((weights(&model), weights(&reference)))
}

/// The hosts of a hostfile (`host slots=N` lines; `#` comments).
fn hosts(hostfile: &Path) -> std::result::Result<Vec<String>, LaunchError> {
    let text = std::fs::read_to_string(hostfile).map_err(|e| {
        LaunchError(
            format!("reading the hostfile {}: {e}", hostfile.display()),
            2,
        )
    })?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect())
}

/// The Troubleshoot guide's first step: can mpirun start a process on every host? Returns the unreachable ones.
fn unreachable_hosts(hostfile: &Path) -> std::result::Result<Vec<String>, LaunchError> {
    let mut unreachable = Vec::new();
    for host in hosts(hostfile)? {
        let mut probe = Command::new("mpirun");
        probe.args(["-np", "1", "--host", &host, "hostname"]);
        crate::launch::allow_root(&mut probe);
        let mut child = probe
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| LaunchError(format!("cannot run mpirun: {e}"), 2))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let ok = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status.success(),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = child.kill();
                    break false;
                }
            }
        };
        if !ok {
            unreachable.push(host);
        }
    }
    Ok(unreachable)
}

/// Runs the test; returns the exit code.
pub fn run(args: &TestArgs) -> std::result::Result<i32, LaunchError> {
    let configured = burn_accelerate::config::AcceleratorConfig::read_file_and_env()
        .map_err(|e| LaunchError(e.to_string(), 2))?
        .launch
        .num_processes;
    let n = args.num_processes.or(configured).unwrap_or(1).max(1);
    if let Some(which) = &args.nccl_lifecycle {
        return nccl_lifecycle(n, which);
    }
    if let Some(hostfile) = &args.hostfile {
        let unreachable = unreachable_hosts(hostfile)?;
        if !unreachable.is_empty() {
            eprintln!(
                "Test failed: mpirun cannot start a process on {}; check that each is reachable by ssh without a \
                 password and has the same MPI installed",
                unreachable.join(", ")
            );
            return Ok(1);
        }
    }
    let distributed = n > 1 || args.hostfile.is_some();
    if distributed && cfg!(feature = "mpi") {
        let exe = std::env::current_exe().map_err(|e| LaunchError(e.to_string(), 2))?;
        let launch = LaunchArgs {
            num_processes: Some(n),
            num_machines: None,
            machine_rank: None,
            main_process_ip: None,
            main_process_port: None,
            hostfile: args.hostfile.clone(),
            mixed_precision: None,
            gradient_accumulation_steps: None,
            use_fsdp: false,
            fsdp_sharding_strategy: None,
            parallelism_config_dp_shard_size: None,
            pp_size: None,
            pp_microbatches: None,
            pp_schedule: None,
            pp_stage_blocks: None,
            fsdp_param_dtype: None,
            fsdp_reduce_dtype: None,
            fsdp_activation_checkpointing: None,
            debug: false,
            cpu: false,
            num_cpu_threads_per_process: None,
            max_restarts: 0,
            restart_on_error: false,
            restart_backoff: 1.0,
            min_processes: None,
            program: vec![exe.into_os_string(), "test-worker".into()],
        };
        return crate::launch::run(&launch);
    }
    if distributed {
        println!(
            "(this burn-accelerate was built without its `mpi` feature: testing {n} in-process ranks)"
        );
    }
    let failures = burn_accelerate::launch(n, worker)
        .map_err(|e| LaunchError(format!("Test failed: {e}"), 1))?;
    Ok(report(&failures[0]))
}

/// The GPU kit's NCCL lifecycle check `which` (`split` or `failing-group`) on `n` in-process ranks: one line per
/// rank's result (`NCCL <check>: passed|failed: ...`), then the usual verdict.
fn nccl_lifecycle(n: usize, which: &str) -> std::result::Result<i32, LaunchError> {
    if !["split", "failing-group"].contains(&which) {
        return Err(LaunchError(
            format!("--nccl-lifecycle {which}: the checks are `split` and `failing-group`"),
            2,
        ));
    }
    let outcomes = burn_accelerate::launch(n, |acc| acc.check_nccl_lifecycle())
        .map_err(|e| LaunchError(format!("Test failed: {e}"), 1))?;
    let mut failures = Vec::new();
    for (rank, checks) in outcomes.into_iter().enumerate() {
        let Some(checks) = checks else {
            failures.push(format!(
                "rank {rank}: no CUDA device here, so no NCCL to check"
            ));
            continue;
        };
        for check in checks.into_iter().filter(|c| c.name == which) {
            let verdict = if check.passed { "passed" } else { "failed" };
            println!("NCCL {}: rank {rank} {verdict}: {}", check.name, check.seen);
            if !check.passed {
                failures.push(format!(
                    "NCCL {} on rank {rank}: {}",
                    check.name, check.seen
                ));
            }
        }
    }
    Ok(report(&failures))
}

/// Prints the outcome of one rank's checks (the main rank's, which includes whether all passed).
pub fn report(failures: &[String]) -> i32 {
    if failures.is_empty() {
        println!("{SUCCESS}");
        0
    } else {
        eprintln!("Test failed:");
        for failure in failures {
            eprintln!("  - {failure}");
        }
        1
    }
}

/// The hidden worker that `test` starts on every rank under mpirun.
pub fn run_worker() -> i32 {
    match Accelerator::new().and_then(|acc| {
        let main = acc.is_main_process();
        worker(acc).map(|f| (main, f))
    }) {
        Ok((main, failures)) => {
            if main || !failures.is_empty() {
                report(&failures)
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("Test failed: {e}");
            1
        }
    }
}
