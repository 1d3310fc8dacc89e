//! Partial fine-tuning: a model whose bottom (the input layer and the first k blocks), a middle block, a whole
//! middle pipeline stage, or everything but the head is frozen (`Module::no_grad`) trains in every mode to the weights of one process
//! training the same model with the same layers frozen (SGD with momentum, within 1e-6): one process with and
//! without activation checkpointing, `SHARD_GRAD_OP`, `FULL_SHARD` whole and block-wise, both hybrids, and
//! pipelines of 2 and 4 stages (GPipe and 1F1B, with and without checkpointing, with 2 data-parallel replicas per
//! stage). Frozen parameters keep their initial bits, never hold a gradient, and hold no optimizer state on any
//! rank. A subset runs under `mpirun` in `tests/mpi/mpi.rs`.

use crate::deep;

use std::collections::HashSet;

use burn::module::{Module, ParamId};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::Tensor;
use deep::{Deep, batch, params};

use burn_accelerate::{
    AcceleratedOptimizer, Accelerator, AcceleratorBuilder, PipelineSchedule, ShardingStrategy,
};

/// Blocks of the model (2 stages of 4, or 4 stages of 2).
const LAYERS: usize = 8;
/// Rows of a global batch.
const BATCH: usize = 16;
const STEPS: usize = 4;
const LR: f64 = 0.05;

/// What is frozen.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Frozen {
    /// The input layer and the first `k` blocks.
    Bottom(usize),
    /// Blocks `a..b` (one middle block; or a whole middle stage of 4, which holds no parameter that trains).
    Middle(usize, usize),
    /// Everything but the head.
    AllButHead,
}

impl Frozen {
    const ALL: [Frozen; 6] = [
        Frozen::Bottom(1),
        Frozen::Bottom(2),
        Frozen::Bottom(4),
        Frozen::Middle(5, 6),
        Frozen::Middle(2, 4),
        Frozen::AllButHead,
    ];

    fn apply(self, mut model: Deep) -> Deep {
        let k = match self {
            Frozen::Bottom(k) => k,
            Frozen::AllButHead => LAYERS,
            Frozen::Middle(a, b) => {
                for layer in &mut model.layers[a..b] {
                    *layer = layer.clone().no_grad();
                }
                return model;
            }
        };
        model.input = model.input.no_grad();
        for layer in &mut model.layers[..k] {
            *layer = layer.clone().no_grad();
        }
        model
    }

    /// Which of the model's float parameters (visiting order: input weight and bias, each block's, the head's)
    /// are frozen.
    fn mask(self) -> Vec<bool> {
        let mut mask = Vec::new();
        let input = !matches!(self, Frozen::Middle(..));
        mask.extend([input; 2]);
        for i in 0..LAYERS {
            let frozen = match self {
                Frozen::Bottom(k) => i < k,
                Frozen::Middle(a, b) => (a..b).contains(&i),
                Frozen::AllButHead => true,
            };
            mask.extend([frozen; 2]);
        }
        mask.extend([false; 2]);
        mask
    }
}

/// How a run distributes training.
#[derive(Clone, Copy, Debug)]
struct Mode {
    processes: usize,
    sharding: ShardingStrategy,
    /// `backward_blocks` (else the plain `backward` on the unsharded model).
    blocks: bool,
    checkpoint: bool,
    stages: usize,
    schedule: PipelineSchedule,
}

impl Mode {
    fn new(processes: usize, sharding: ShardingStrategy) -> Self {
        Self {
            processes,
            sharding,
            blocks: true,
            checkpoint: false,
            stages: 1,
            schedule: PipelineSchedule::OneFOneB,
        }
    }

    fn pipeline(stages: usize, replicas: usize, schedule: PipelineSchedule, ckpt: bool) -> Self {
        Self {
            stages,
            schedule,
            checkpoint: ckpt,
            ..Self::new(stages * replicas, ShardingStrategy::NoShard)
        }
    }

    fn builder(&self) -> AcceleratorBuilder {
        let builder = Accelerator::builder()
            .sharding(self.sharding)
            .activation_checkpointing(self.checkpoint)
            .pp_size(self.stages)
            .pp_microbatches(4)
            .pp_schedule(self.schedule);
        match self.sharding.is_hybrid() {
            true => builder.dp_shard_size(2),
            false => builder,
        }
    }

    /// Every mode of the matrix.
    fn all() -> Vec<Mode> {
        use PipelineSchedule::{GPipe, OneFOneB};
        use ShardingStrategy::*;
        let mut modes = vec![
            Mode {
                blocks: false,
                ..Mode::new(1, NoShard)
            },
            Mode::new(1, NoShard),
            Mode {
                checkpoint: true,
                ..Mode::new(1, NoShard)
            },
            Mode::new(2, ShardGradOp),
            Mode {
                blocks: false,
                ..Mode::new(2, FullShard)
            },
            Mode::new(2, FullShard),
            Mode {
                checkpoint: true,
                ..Mode::new(2, FullShard)
            },
            Mode::new(4, HybridShard),
            Mode::new(4, HybridShardZero2),
        ];
        for stages in [2, 4] {
            for schedule in [GPipe, OneFOneB] {
                for ckpt in [false, true] {
                    modes.push(Mode::pipeline(stages, 1, schedule, ckpt));
                }
            }
            modes.push(Mode::pipeline(stages, 2, OneFOneB, false));
        }
        // Each stage's 2 replicas shard their blocks.
        modes.push(Mode {
            sharding: FullShard,
            ..Mode::pipeline(2, 2, GPipe, false)
        });
        modes
    }
}

fn sgd(acc: &Accelerator) -> AcceleratedOptimizer {
    let sgd = SgdConfig::new().with_momentum(Some(MomentumConfig::new()));
    acc.prepare_optimizer(sgd.init(), LR)
}

fn loss(out: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    let rows = y.dims()[0] as f32;
    (out - y).powi_scalar(2).sum().div_scalar(rows)
}

/// The ids of `model`'s parameters that do not train.
fn frozen_ids(model: &Deep) -> HashSet<ParamId> {
    struct Ids(HashSet<ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if !param.is_require_grad() {
                self.0.insert(param.id);
            }
        }
    }
    let mut ids = Ids(HashSet::new());
    model.visit(&mut ids);
    ids.0
}

/// Whether any parameter of `model` in `ids` holds a gradient.
fn any_gradient(acc: &Accelerator, model: &Deep, ids: &HashSet<ParamId>) -> bool {
    let mut layers = vec![&model.input, &model.head];
    layers.extend(&model.layers);
    layers.iter().any(|l| {
        (ids.contains(&l.weight.id) && acc.grad(&l.weight).is_some())
            || l.bias
                .as_ref()
                .is_some_and(|b| ids.contains(&b.id) && acc.grad(b).is_some())
    })
}

/// What one rank ends with: the model's parameters (gathered where it holds slices; a pipeline stage's
/// placeholders empty), whether a frozen parameter ever held a gradient, and the parameters its optimizer holds
/// state for.
struct Ended {
    /// The rank's pipeline stage, and how many there are.
    stage: (usize, usize),
    params: Vec<Vec<f32>>,
    gradient_on_frozen: bool,
    state_on_frozen: bool,
}

fn run(mode: Mode, frozen: Frozen) -> Vec<Ended> {
    mode.builder()
        .launch(mode.processes, |acc| {
            let model = frozen.apply(deep::model(LAYERS, acc.device()));
            let mut model = acc.prepare_blocks(model)?;
            let frozen = frozen_ids(&model);
            let mut optimizer = sgd(&acc);
            let layout = acc.pipeline_layout();
            let replicas = layout.replicas;
            let rows = BATCH / replicas;
            let device = acc.device().clone();
            let mut gradient_on_frozen = false;
            for step in 0..STEPS {
                let (x, y) = batch(step * BATCH + layout.replica * rows, rows, &device);
                if mode.stages > 1 {
                    acc.backward_batch(
                        &model,
                        (x, y),
                        |m, (x, _)| m.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h, (_, y)| loss(m.head.forward(h), y.clone()),
                    )?;
                } else if mode.blocks {
                    acc.backward_blocks(
                        &model,
                        |m| m.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h| loss(m.head.forward(h), y.clone()),
                    )?;
                } else {
                    let whole = acc.unshard(&model)?;
                    let mut h = whole.input.forward(x).tanh();
                    for layer in &whole.layers {
                        h = layer.forward(h).tanh();
                    }
                    acc.backward(loss(whole.head.forward(h), y), &whole)?;
                }
                gradient_on_frozen |= any_gradient(&acc, &model, &frozen);
                model = optimizer.try_step(model)?;
            }
            let held = optimizer.state_params()?;
            Ok(Ended {
                stage: (layout.stage, layout.stages),
                params: params(&acc.unshard(&model)?),
                gradient_on_frozen,
                state_on_frozen: held.iter().any(|id| frozen.contains(id)),
            })
        })
        .unwrap_or_else(|e| panic!("{mode:?}, {frozen:?}: {e}"))
}

impl Ended {
    /// Parameter `j` as this rank trains it: `None` for a placeholder, and for what is outside the blocks on a
    /// stage that does not run it (the input layer is the first stage's, the head the last's; under a sharded
    /// stage the others keep untrained slices of them).
    fn trained(&self, j: usize) -> Option<&Vec<f32>> {
        let (stage, stages) = self.stage;
        let count = self.params.len();
        let here = match j {
            0 | 1 => stage == 0,
            _ if j + 2 >= count => stage + 1 == stages,
            _ => true,
        };
        let p = &self.params[j];
        (here && !p.is_empty()).then_some(p)
    }
}

/// The whole model from a run's ranks: each parameter from the first rank that trains it (a pipeline's stages
/// hold placeholders of the others' blocks).
fn merged(ranks: &[Ended]) -> Vec<Vec<f32>> {
    (0..ranks[0].params.len())
        .map(|j| {
            ranks
                .iter()
                .find_map(|r| r.trained(j))
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn frozen_layers_train_in_every_mode_to_the_weights_of_one_process() {
    let device = Default::default();
    let initial = params(&deep::model(LAYERS, &device));
    let mut worst = 0.0f32;
    for frozen in Frozen::ALL {
        let mask = frozen.mask();
        let reference = merged(&run(
            Mode {
                blocks: false,
                ..Mode::new(1, ShardingStrategy::NoShard)
            },
            frozen,
        ));
        for (j, (before, after)) in initial.iter().zip(&reference).enumerate() {
            match mask[j] {
                true => assert_eq!(before, after, "{frozen:?}: frozen parameter {j} moved"),
                false => assert_ne!(before, after, "{frozen:?}: parameter {j} did not train"),
            }
        }
        for mode in Mode::all() {
            let ranks = run(mode, frozen);
            for (r, ended) in ranks.iter().enumerate() {
                assert!(
                    !ended.gradient_on_frozen,
                    "{mode:?}, {frozen:?}: rank {r} held a gradient of a frozen parameter"
                );
                assert!(
                    !ended.state_on_frozen,
                    "{mode:?}, {frozen:?}: rank {r} holds optimizer state for a frozen parameter"
                );
                for (j, p) in ended.params.iter().enumerate() {
                    if mask[j] && !p.is_empty() {
                        assert_eq!(
                            p, &initial[j],
                            "{mode:?}, {frozen:?}: rank {r}'s frozen parameter {j} moved"
                        );
                    }
                }
            }
            let mut diff = max_diff(&reference, &merged(&ranks));
            // Every rank's copy of what it trains, replicas and stages alike.
            for ended in &ranks {
                for (j, q) in reference.iter().enumerate() {
                    if let Some(p) = ended.trained(j) {
                        diff = diff.max(max_diff(std::slice::from_ref(p), std::slice::from_ref(q)));
                    }
                }
            }
            println!("{frozen:?} {mode:?}: max |Δ| vs one process = {diff:e}");
            assert!(diff <= 1e-6, "{mode:?}, {frozen:?}: {diff:e} > 1e-6");
            worst = worst.max(diff);
        }
    }
    println!("frozen layers, every mode against one process, worst: {worst:e}");
}
