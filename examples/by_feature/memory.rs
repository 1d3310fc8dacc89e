//! The Troubleshoot guide's answer to out-of-memory errors: let the accelerator find the largest batch size that
//! fits. Everything that holds device memory is built inside the function the search calls, which starts by
//! freeing memory; `check_step` makes a GPU backend report an out-of-memory failure before the optimizer step.
//!
//! ```sh
//! # GPU backends meet real out-of-memory failures (here: Vulkan's software driver, whose buffers are limited)
//! cargo run --release --example memory --no-default-features --features wgpu -- --start 16777216
//! # CPU backends abort the process on a failed allocation, so the demo injects the failure above a size
//! cargo run --release --example memory -- --start 4096 --fits-up-to 1000
//! # several ranks agree on one size (the largest that fits on every rank)
//! cargo run --release --example memory -- --start 4096 --fits-up-to 1000 --processes 2
//! ```
//! Prints `batch_size=<n>` and `final_loss=<x>`.

#[path = "../support/mlp.rs"]
mod mlp;
#[path = "../support/ranks.rs"]
mod ranks;

use burn::optim::AdamConfig;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::memory::BatchSizeError;
use burn_accelerate::{Accelerator, Error, Result};
use clap::Parser;
use mlp::Mlp;

#[derive(Parser, Debug)]
struct Args {
    /// The batch size to try first.
    #[arg(long, default_value_t = 4096)]
    start: usize,
    /// Pretend that batches above this size run out of memory (for CPU backends, where a real failure aborts).
    #[arg(long)]
    fits_up_to: Option<usize>,
    /// Optimizer steps to train once a size fits.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
}

/// Trains the quicktour MLP for `steps` steps on batches of `batch_size` synthetic samples built on the device;
/// returns the last loss.
fn train(accelerator: &Accelerator, batch_size: usize, args: &Args) -> Result<f32> {
    accelerator.free_memory();
    if args.fits_up_to.is_some_and(|fits| batch_size > fits) {
        return Err(Error::Execution {
            operation: "train",
            device: format!("{:?}", accelerator.device()),
            reason: format!(
                "out of device memory allocating {} bytes (injected)",
                batch_size * 4096
            ),
        });
    }
    let device = accelerator.device();
    device.seed(3);
    let mut model = accelerator.prepare_model(Mlp::new(device))?;
    let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 3e-3);
    let target = Tensor::<2>::random([mlp::FEATURES, 1], Distribution::Normal(0.0, 1.0), device);
    let mut last = f32::NAN;
    for _ in 0..args.steps {
        let x = Tensor::<2>::random(
            [batch_size, mlp::FEATURES],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        let y = x.clone().matmul(target.clone());
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        accelerator.backward(loss.clone(), &model)?;
        accelerator.check_step(&loss)?; // an out-of-memory failure surfaces here, before the weights change
        model = optimizer.step(model);
        last = loss
            .try_into_scalar::<f32>()
            .map_err(|e| Error::Execution {
                operation: "reading the loss",
                device: format!("{device:?}"),
                reason: e.to_string(),
            })?;
    }
    Ok(last)
}

pub fn main() {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let result = ranks::run_ranks(Accelerator::builder(), args.processes, |accelerator| {
        accelerator
            .find_executable_batch_size(args.start, |batch_size| {
                train(&accelerator, batch_size, &args).map(|loss| (batch_size, loss))
            })
            .map_err(|e| match e {
                BatchSizeError::Failed(error) => error,
                other => Error::InvalidArgument(other.to_string()),
            })
    });
    match result {
        Ok(Some((batch_size, loss))) => {
            println!("batch_size={batch_size}");
            println!("final_loss={loss:.5}");
        }
        Ok(None) => {}
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
