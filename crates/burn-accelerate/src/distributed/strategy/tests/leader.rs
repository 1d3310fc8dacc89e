//! A strategy of the tests' own, written from the trait's actions alone (the trait has nothing else): rank 0, the
//! leader, owns and steps every parameter; each gradient is reduced onto it, and its stepped parameters are
//! broadcast to the others. It drives `backward`, `backward_blocks`, the prepared optimizer, `save_state` /
//! `load_state` and burn-train's Learner, and every one of them ends with data parallelism's weights.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::{Module, ParamId};
use burn::nn::Linear;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};

use super::super::{
    GradientSync, ModuleParams, ParamPlacement, StateScope, StateScopes, StrategyInfo,
};
use crate::accelerator::AcceleratorBuilder;
use crate::distributed::comm::ReduceOp;
use crate::distributed::tensor_comm::{Checked, Reduction, TensorComm};
use crate::error::{Error, Result};
use crate::grad::{GradientBuffer, NormType};
use crate::{Accelerator, Blocks, StateToSave};

/// How often each hook ran on a rank.
#[derive(Debug, Default)]
struct Calls {
    reduced: AtomicUsize,
    set_up: AtomicUsize,
    unsharded: AtomicUsize,
    shared: AtomicUsize,
}

/// Rank 0 steps everything; the other ranks hold no gradient and no optimizer state after a reduction.
#[derive(Debug)]
struct Leader {
    comm: Arc<dyn TensorComm>,
    calls: Arc<Calls>,
}

const LEADER: usize = 0;

impl StrategyInfo for Leader {
    fn name(&self) -> String {
        "the leader steps".into()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }
}

impl GradientSync for Leader {
    fn reduce_gradients(
        &self,
        grads: &mut GradientBuffer,
        params: &[(ParamId, usize)],
        scale: f32,
    ) -> Result<()> {
        self.calls.reduced.fetch_add(1, Ordering::Relaxed);
        let Some((device, dtype)) = grads.device_and_dtype(params.iter().map(|(id, _)| *id)) else {
            return Err(Error::other(
                "the pipeline hands over at least one gradient",
            ));
        };
        for &(id, n) in params {
            let flat = grads
                .take(id)
                .map(|(_, flat)| flat)
                .unwrap_or_else(|| Tensor::zeros([n], (&device, dtype)));
            let mean = self
                .comm
                .reduce(flat, LEADER, Reduction::Average(scale), "leader gradient")?
                .wait()?;
            if let Some(mean) = mean {
                grads.set_flat(id, mean);
            }
        }
        Ok(())
    }

    fn broadcast(&self, flat: Tensor<1>, root: usize) -> Result<Tensor<1>> {
        self.comm.broadcast(flat, root, "leader broadcast")?.wait()
    }

    fn no_gradients_held(&self, operation: &'static str) -> Result<()> {
        if self.rank() == LEADER {
            return Err(Error::NoGradients { operation });
        }
        Ok(())
    }

    fn gradient_norm(&self, norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
        crate::grad::combined_norm(norms, norm_type, |partial, op| {
            self.comm.all_reduce_value(partial, op, "leader norm")
        })
    }

    fn any_rank(&self, local: bool) -> Result<bool> {
        let any = self.comm.all_reduce_value(
            f64::from(u8::from(local)),
            ReduceOp::Max,
            "leader verdict",
        )?;
        Ok(any != 0.0)
    }
}

impl ParamPlacement for Leader {
    fn setup(&self, _params: &mut ModuleParams<'_>) -> Result<()> {
        self.calls.set_up.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn unshard(&self, _params: &mut ModuleParams<'_>, _kept: &HashSet<ParamId>) -> Result<()> {
        self.calls.unsharded.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn after_step(&self, params: &mut ModuleParams<'_>) -> Result<()> {
        self.calls.shared.fetch_add(1, Ordering::Relaxed);
        let table = params.table();
        let trainable: Vec<(ParamId, Vec<usize>)> = table
            .entries()
            .iter()
            .filter(|e| e.trainable)
            .map(|e| (e.id, e.dims.clone()))
            .collect();
        for (id, dims) in trainable {
            let Some(entry) = table.get(id) else {
                continue;
            };
            let value = self
                .comm
                .broadcast(entry.value(), LEADER, "leader parameters")?
                .wait()?;
            table.replace(id, value, dims, true);
        }
        Ok(())
    }
}

impl StateScopes for Leader {
    fn optimizer_state(&self) -> StateScope {
        StateScope::PerRank
    }
}

/// The builder of runs through [`Leader`]; `calls` counts rank 0's hooks.
fn leader(calls: Arc<Calls>) -> AcceleratorBuilder {
    AcceleratorBuilder::default().strategy(Arc::new(move |group| {
        let calls = if group.process_index() == LEADER {
            calls.clone()
        } else {
            Arc::default()
        };
        Ok(Arc::new(Leader {
            comm: Arc::new(Checked::host(group.clone())),
            calls,
        }))
    }))
}

/// Two layers in a stack of blocks, a head outside them.
#[derive(Module, Debug)]
pub(super) struct Stack {
    blocks: Vec<Linear>,
    pub(super) head: Linear,
}

impl Blocks for Stack {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.blocks
    }
}

pub(super) fn stack(device: &Device) -> Stack {
    Stack {
        blocks: vec![
            super::linear(4, 6, 0.2, device),
            super::linear(6, 6, 0.7, device),
        ],
        head: super::linear(6, 1, 1.1, device),
    }
}

pub(super) fn stack_weights(stack: &Stack) -> Vec<f32> {
    stack
        .blocks
        .iter()
        .chain([&stack.head])
        .flat_map(|l| l.weight.val().into_data().iter::<f32>().collect::<Vec<_>>())
        .collect()
}

pub(super) fn input(rank: usize, step: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..20)
        .map(|i| ((i * (rank + 2) + step) as f32 * 0.31).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape([5, 4])
}

/// Six steps of `optimizer` on the stack: a whole backward on even steps, a checkpointed `backward_blocks` with
/// clipping on odd ones.
pub(super) fn stack_steps(
    acc: &Accelerator,
    mut net: Stack,
    optimizer: &mut crate::AcceleratedOptimizer,
) -> Result<Stack> {
    let device = acc.device().clone();
    let rank = acc.process_index();
    for step in 0..6 {
        let x = input(rank, step, &device);
        if step % 2 == 0 {
            let whole = acc.unshard(&net)?;
            let mut h = x;
            for b in &whole.blocks {
                h = b.forward(h).tanh();
            }
            let loss = whole.head.forward(h).powi_scalar(2).mean();
            acc.backward(loss, &whole)?;
        } else {
            acc.backward_blocks(
                &net,
                |_| x.clone(),
                |b, h| b.forward(h).tanh(),
                |m, h| m.head.forward(h).powi_scalar(2).mean(),
            )?;
            acc.clip_grad_norm(&net, 0.05)?;
        }
        net = optimizer.try_step(net)?;
    }
    Ok(net)
}

/// `steps` steps of Adam on 2 ranks, alternating `backward` and a checkpointed `backward_blocks`, clipping every
/// other step; then a save and a load. Each rank's weights, its number of optimizer records, and the number it
/// read back.
fn train_stack(
    builder: AcceleratorBuilder,
    dir: std::path::PathBuf,
) -> Vec<(Vec<f32>, usize, usize)> {
    builder
        .launch(2, move |acc: Accelerator| {
            let device = acc.device().clone();
            let mut net = acc.prepare_model(stack(&device))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            net = stack_steps(&acc, net, &mut optimizer)?;
            let parts = StateToSave::new().model(&net)?.optimizer(&optimizer)?;
            acc.save_state(Some(&dir), &parts)?;
            let mut fresh = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let mut state = acc.load_state(Some(&dir))?;
            let net = state.model(net)?;
            state.optimizer(&mut fresh)?;
            state.finish()?;
            Ok((
                stack_weights(&net),
                optimizer.inner().to_record().len(),
                fresh.inner().to_record().len(),
            ))
        })
        .unwrap()
}

#[test]
fn a_strategy_of_actions_alone_drives_backward_blocks_the_optimizer_and_checkpoints() {
    let base = std::env::temp_dir().join(format!("burn-accelerate-leader-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let calls = Arc::new(Calls::default());
    // Block-wise passes recompute each block (activation checkpointing), their gradients reduced at the end.
    let led = train_stack(
        leader(calls.clone()).activation_checkpointing(true),
        base.join("leader"),
    );
    let replicated = train_stack(
        AcceleratorBuilder::default().activation_checkpointing(true),
        base.join("replicated"),
    );

    assert_eq!(led[0].0, led[1].0, "the ranks agree");
    let diff = super::max_relative_difference(&led[0].0, &replicated[0].0);
    assert!(
        diff < 1e-5,
        "the leader's weights against data parallelism's: {diff}"
    );
    // Three parameters with a weight and a bias each: the leader holds all their state, the other rank none.
    assert_eq!(led[0].1, replicated[0].1);
    assert!(led[0].1 > 0);
    assert_eq!(led[1].1, 0, "only the leader steps");
    assert_eq!(
        (led[0].2, led[1].2),
        (led[0].1, 0),
        "each rank read its own slice"
    );
    assert!(base.join("leader").join("optimizer_rank1.bpk").is_file());
    // One reduction per pass (a block-wise pass of blocks kept whole reduces at its end), every step shared, the
    // model set up once, and unsharded for each whole pass and for each block of a block-wise one.
    assert_eq!(calls.reduced.load(Ordering::Relaxed), 6);
    assert_eq!(calls.shared.load(Ordering::Relaxed), 6);
    assert_eq!(calls.set_up.load(Ordering::Relaxed), 1);
    assert!(calls.unsharded.load(Ordering::Relaxed) >= 3 + 3 * 2);
    let _ = std::fs::remove_dir_all(&base);
}

#[cfg(feature = "train")]
mod learner {
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::InMemDataset;
    use burn::nn::loss::{MseLoss, Reduction as LossReduction};
    use burn::optim::SgdConfig;

    use super::*;
    use crate::data::DataLoaderBuilder;
    use crate::learner::burn_train::{
        InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    };
    use crate::learner::{LearnerLoader, autocast, backward};

    #[derive(Module, Debug)]
    struct Regressor {
        hidden: Linear,
        out: Linear,
    }

    #[derive(Debug, Clone)]
    struct Batch {
        x: Tensor<2>,
        y: Tensor<2>,
    }
    crate::impl_to_device!(Batch { x, y });

    #[derive(Debug, Clone)]
    struct Stacker;

    impl Batcher<[f32; 4], Batch> for Stacker {
        fn batch(&self, items: Vec<[f32; 4]>, device: &Device) -> Batch {
            let n = items.len();
            let xs: Vec<f32> = items.iter().flatten().copied().collect();
            let ys: Vec<f32> = items.iter().map(|x| x[0] * 0.5 - x[2] * x[3]).collect();
            Batch {
                x: Tensor::<1>::from_floats(xs.as_slice(), device).reshape([n, 4]),
                y: Tensor::<1>::from_floats(ys.as_slice(), device).reshape([n, 1]),
            }
        }
    }

    fn regression(model: &Regressor, batch: Batch) -> RegressionOutput {
        let (output, targets) = autocast(model, batch, |m, b| {
            (m.out.forward(m.hidden.forward(b.x).tanh()), b.y)
        });
        let loss = MseLoss::new().forward(output.clone(), targets.clone(), LossReduction::Mean);
        RegressionOutput {
            loss,
            output,
            targets,
        }
    }

    impl TrainStep for Regressor {
        type Input = Batch;
        type Output = RegressionOutput;
        fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
            let item = regression(self, batch);
            TrainOutput::new(self, backward(item.loss.clone()), item)
        }
    }

    impl InferenceStep for Regressor {
        type Input = Batch;
        type Output = RegressionOutput;
        fn step(&self, batch: Batch) -> RegressionOutput {
            regression(self, batch)
        }
    }

    fn samples(n: usize, salt: f32) -> InMemDataset<[f32; 4]> {
        InMemDataset::new(
            (0..n)
                .map(|i| std::array::from_fn(|j| ((i * 4 + j) as f32 * 0.173 + salt).sin()))
                .collect(),
        )
    }

    /// One epoch of burn-train's Learner on 2 ranks, clipping gradients to a norm of 0.5; each rank's weights.
    fn fit(
        builder: AcceleratorBuilder,
        dir: std::path::PathBuf,
        optimizer: fn() -> burn::optim::ModuleOptimizer,
    ) -> Vec<Vec<f32>> {
        builder
            .launch(2, move |acc| {
                let acc = Arc::new(acc);
                let device = acc.device().clone();
                let loader = |n, salt, batch| {
                    acc.prepare_dataloader(
                        DataLoaderBuilder::new(Stacker)
                            .batch_size(batch)
                            .build(samples(n, salt)),
                    )
                };
                let train = LearnerLoader::train(loader(96, 0.3, 8)?);
                let valid = LearnerLoader::valid(loader(32, 1.9, 16)?);
                let training = SupervisedTraining::new(
                    dir.join(format!("rank{}", acc.process_index())),
                    train,
                    valid,
                )
                .num_epochs(1)
                .with_application_logger(None);
                let training = acc.prepare_training_with(training, |s| s.max_grad_norm(0.5))?;
                let model = Regressor {
                    hidden: super::super::linear(4, 8, 0.4, &device),
                    out: super::super::linear(8, 1, 2.2, &device),
                };
                let result = training.launch(Learner::new(model, optimizer(), 0.1));
                assert!(result.error.is_none(), "{:?}", result.error);
                let m = result.model;
                Ok([m.hidden.weight.val(), m.out.weight.val()]
                    .into_iter()
                    .flat_map(|w| w.into_data().iter::<f32>().collect::<Vec<_>>())
                    .collect())
            })
            .unwrap()
    }

    #[test]
    fn a_strategy_of_actions_alone_drives_the_learner() {
        let base = std::env::temp_dir().join(format!(
            "burn-accelerate-leader-learner-{}",
            std::process::id()
        ));
        let calls = Arc::new(Calls::default());
        let sgd = || SgdConfig::new().init();
        let led = fit(leader(calls.clone()), base.join("leader"), sgd);
        let replicated = fit(AcceleratorBuilder::default(), base.join("replicated"), sgd);
        assert_eq!(led[0], led[1], "the ranks agree");
        let diff = super::super::max_relative_difference(&led[0], &replicated[0]);
        assert!(
            diff < 1e-5,
            "the leader's weights against data parallelism's: {diff}"
        );
        assert_ne!(led[0], {
            let start = Regressor {
                hidden: super::super::linear(4, 8, 0.4, &Device::default()),
                out: super::super::linear(8, 1, 2.2, &Device::default()),
            };
            [start.hidden.weight.val(), start.out.weight.val()]
                .into_iter()
                .flat_map(|w| w.into_data().iter::<f32>().collect::<Vec<_>>())
                .collect::<Vec<f32>>()
        });
        // 96 samples over 2 ranks in batches of 8: 6 steps, each reduced and shared once.
        assert_eq!(calls.reduced.load(Ordering::Relaxed), 6);
        assert_eq!(calls.shared.load(Ordering::Relaxed), 6);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn the_learner_steps_the_fused_adamw_as_burns() {
        let base = std::env::temp_dir().join(format!(
            "burn-accelerate-fused-learner-{}",
            std::process::id()
        ));
        let fused = fit(AcceleratorBuilder::default(), base.join("fused"), || {
            crate::optim::FusedAdamWConfig::new().init()
        });
        let burn = fit(AcceleratorBuilder::default(), base.join("burn"), || {
            burn::optim::AdamWConfig::new().init()
        });
        assert_eq!(
            fused, burn,
            "the same bits through burn-train's Learner on 2 ranks"
        );
        let _ = std::fs::remove_dir_all(&base);
    }
}
