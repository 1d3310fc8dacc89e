//! Where a rank's training step spends its time, phase by phase, as the library sees it: the backward pass, the
//! gradient sync across ranks, the optimizer step. The forward pass and data loading run in the user's own code
//! and are timed there (the `step_phases` bench does both).

use std::time::Duration;

/// The time one rank spent in each phase of its training steps since the accelerator was made (or since
/// [`Accelerator::reset_step_phases`](crate::Accelerator::reset_step_phases)), as Lightning's `SimpleProfiler`
/// reports it: a few clock reads per step, always on. The clock reads are on the host: on a GPU backend, whose
/// work runs behind the calls that queue it, a phase's time is its calls', and device work still queued is paid in
/// whichever later phase waits for it (a read-back, a collective).
///
/// ```
/// # use burn_accelerate::Accelerator;
/// # use burn::nn::LinearConfig;
/// # use burn::optim::AdamConfig;
/// # use burn::tensor::Tensor;
/// let accelerator = Accelerator::new()?;
/// let device = accelerator.device().clone();
/// let mut model = accelerator.prepare_model(LinearConfig::new(4, 1).init(&device))?;
/// let mut optimizer = accelerator.prepare_optimizer(AdamConfig::new().init(), 1e-3);
/// for _ in 0..3 {
///     let loss = model.forward(Tensor::<2>::ones([8, 4], &device)).powi_scalar(2).mean();
///     accelerator.backward(loss, &model)?;
///     model = optimizer.step(model);
/// }
/// let phases = accelerator.step_phases();
/// assert_eq!(phases.steps, 3);
/// assert!(phases.backward > std::time::Duration::ZERO);
/// println!("{phases}"); // backward 0.041 ms, gradient sync 0.001 ms, optimizer 0.052 ms per step (3 steps)
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepPhases {
    /// Optimizer steps taken (an fp16 overflow's skipped step and an accumulating micro-batch are not steps).
    pub steps: u64,
    /// Back-propagation (the loss's `backward` and collecting its gradients; a block-wise pass's recomputes too).
    pub backward: Duration,
    /// The gradients' reduction across ranks, with their normalisation and unscaling (a single device: only
    /// those), the fp16 overflow verdict and clipping's norm.
    pub gradient_sync: Duration,
    /// The prepared optimizer's step, with the exchange of stepped parameters of a sharded strategy.
    pub optimizer: Duration,
}

impl StepPhases {
    /// The mean time per optimizer step of `phase` (zero before the first step).
    pub fn per_step(&self, phase: Duration) -> Duration {
        match u32::try_from(self.steps) {
            Ok(0) => Duration::ZERO,
            Ok(steps) => phase / steps,
            Err(_) => Duration::from_secs_f64(phase.as_secs_f64() / self.steps as f64),
        }
    }
}

impl std::fmt::Display for StepPhases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| self.per_step(d).as_secs_f64() * 1e3;
        write!(
            f,
            "backward {:.3} ms, gradient sync {:.3} ms, optimizer {:.3} ms per step ({} steps)",
            ms(self.backward),
            ms(self.gradient_sync),
            ms(self.optimizer),
            self.steps
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::LinearConfig;
    use burn::optim::AdamConfig;
    use burn::tensor::Tensor;

    use super::*;
    use crate::accelerator::AcceleratorBuilder;

    #[test]
    fn steps_and_phases_are_counted_per_rank_accumulation_included() {
        let phases = AcceleratorBuilder::default()
            .gradient_accumulation_steps(2)
            .launch(2, |acc| {
                let device = acc.device().clone();
                let mut model = acc.prepare_model(LinearConfig::new(4, 2).init(&device))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-3);
                let mut step = || -> crate::Result<()> {
                    let x = Tensor::<2>::ones([3, 4], &device);
                    let _ = acc.accumulate();
                    acc.backward(model.forward(x).powi_scalar(2).mean(), &model)?;
                    model = optimizer.try_step(model.clone())?;
                    Ok(())
                };
                step()?;
                acc.reset_step_phases();
                for _ in 0..4 {
                    step()?;
                }
                Ok(acc.step_phases())
            })
            .unwrap();
        for (rank, p) in phases.iter().enumerate() {
            // 4 micro-batches in windows of 2: 2 optimizer steps (the warm-up's window was reset away).
            assert_eq!(p.steps, 2, "rank {rank}: {p}");
            assert!(p.backward > Duration::ZERO, "rank {rank}: {p}");
            assert!(p.gradient_sync > Duration::ZERO, "rank {rank}: {p}");
            assert!(p.optimizer > Duration::ZERO, "rank {rank}: {p}");
            assert!(p.per_step(p.backward) <= p.backward);
        }
        assert_eq!(
            StepPhases::default().per_step(Duration::from_secs(1)),
            Duration::ZERO
        );
    }
}
