//! Block-wise passes (`Accelerator::backward_blocks`): block-wise `FULL_SHARD` and `HYBRID_SHARD` on 2, 3 and 4
//! in-process ranks train the weights of `NO_SHARD` with the plain `backward` on the same ranks (with
//! accumulation, fp16 loss scaling and both kinds of clipping; a model with fewer parameters than ranks
//! included), activation checkpointing alone trains the weights of no checkpointing bit for bit, a block-wise
//! run saved and resumed equals one trained straight through, and a rank holds at most one block's gathered
//! parameters at a time. The same under `mpirun` is in `tests/mpi/parity_mpi.rs`.

use crate::deep;

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Tensor;
use deep::{Deep, WIDTH, batch, deterministic, model};

use burn_accelerate::{
    AcceleratedOptimizer, Accelerator, AcceleratorBuilder, Blocks, MixedPrecision, Result,
    ShardingStrategy, StateToSave,
};

/// Rows of a global batch, divided between the ranks.
const GLOBAL_BATCH: usize = 12;

/// How a run trains.
#[derive(Clone, Copy, Debug)]
struct Setup {
    processes: usize,
    sharding: ShardingStrategy,
    checkpointing: bool,
    blocks: bool,
    accumulation: usize,
    fp16: bool,
    clip: Clip,
    steps: usize,
    /// Burn's own gradient checkpointing on the autodiff device.
    autodiff: bool,
    /// Counts the calls of the `block` closure, when given (a recompute calls it twice per block and step).
    block_calls: Option<&'static AtomicUsize>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Clip {
    None,
    Norm,
    Value,
}

impl Setup {
    fn new(processes: usize, sharding: ShardingStrategy) -> Self {
        Self {
            processes,
            sharding,
            checkpointing: false,
            blocks: true,
            accumulation: 1,
            fp16: false,
            clip: Clip::None,
            steps: 20,
            autodiff: false,
            block_calls: None,
        }
    }

    fn builder(&self) -> AcceleratorBuilder {
        let mut builder = Accelerator::builder()
            .sharding(self.sharding)
            .activation_checkpointing(self.checkpointing)
            .autodiff_checkpointing(self.autodiff)
            .gradient_accumulation_steps(self.accumulation);
        if self.sharding.is_hybrid() {
            builder = builder.dp_shard_size(2);
        }
        if self.fp16 {
            builder = builder.mixed_precision(MixedPrecision::Fp16);
        }
        builder
    }
}

/// Every float parameter's values, in visiting order.
fn flatten<M: Module>(model: &M) -> Vec<f32> {
    deep::params(model).concat()
}

/// Trains `model` for `setup.steps` micro-batches from micro-batch `from`, with `backward_blocks` (or the
/// plain `backward` when `setup.blocks` is off).
fn train(
    acc: &Accelerator,
    setup: &Setup,
    mut model: Deep,
    optimizer: &mut AcceleratedOptimizer,
    from: usize,
) -> Result<Deep> {
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let rows = GLOBAL_BATCH / ranks;
    let device = acc.device().clone();
    for step in from..from + setup.steps {
        let (x, y) = batch(step * GLOBAL_BATCH + rank * rows, rows, &device);
        acc.accumulate();
        let loss_of =
            |out: Tensor<2>, y: Tensor<2>| (out - y).powi_scalar(2).sum().div_scalar(rows as f32);
        if setup.blocks {
            acc.backward_blocks(
                &model,
                |m| m.input.forward(x.clone()).tanh(),
                |layer, h| {
                    if let Some(calls) = setup.block_calls {
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                    layer.forward(h).tanh()
                },
                |m, h| loss_of(m.head.forward(h), y.clone()),
            )?;
        } else {
            let whole = acc.unshard(&model)?;
            let mut h = whole.input.forward(x).tanh();
            for layer in &whole.layers {
                h = layer.forward(h).tanh();
            }
            let loss = loss_of(whole.head.forward(h), y);
            acc.backward(loss, &whole)?;
        }
        if acc.sync_gradients() {
            match setup.clip {
                Clip::Norm => {
                    acc.clip_grad_norm(&model, 0.05)?;
                }
                Clip::Value => acc.clip_grad_value(&model, 0.01)?,
                Clip::None => {}
            }
        }
        model = optimizer.try_step(model)?;
    }
    Ok(model)
}

/// The whole weights rank 0 ends with.
fn run(setup: Setup, layers: usize) -> Vec<f32> {
    let weights = setup
        .builder()
        .launch(setup.processes, |acc| {
            let model = acc.prepare_model(model(layers, acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let model = train(&acc, &setup, model, &mut optimizer, 0)?;
            Ok(flatten(&acc.unshard(&model)?))
        })
        .unwrap_or_else(|e| panic!("{setup:?}: {e}"));
    weights.into_iter().next().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn block_wise_full_shard_trains_the_weights_of_no_shard() {
    let mut worst = 0.0f32;
    for processes in [2, 3, 4] {
        for (accumulation, fp16, clip) in [
            (1, false, Clip::None),
            (3, false, Clip::None),
            (1, true, Clip::None),
            (2, false, Clip::Norm),
            (1, false, Clip::Value),
        ] {
            let setup = |sharding, blocks| Setup {
                accumulation,
                fp16,
                clip,
                blocks,
                ..Setup::new(processes, sharding)
            };
            let reference = run(setup(ShardingStrategy::NoShard, false), 4);
            let initial = run(
                Setup {
                    steps: 0,
                    ..setup(ShardingStrategy::NoShard, false)
                },
                4,
            );
            assert!(
                max_diff(&reference, &initial) > 1e-2,
                "the reference trained"
            );
            let mut modes = vec![ShardingStrategy::FullShard];
            if processes == 4 {
                modes.push(ShardingStrategy::HybridShard);
            }
            for sharding in modes {
                let blockwise = run(setup(sharding, true), 4);
                let diff = max_diff(&reference, &blockwise);
                println!(
                    "P={processes} {sharding} accumulation {accumulation} fp16 {fp16} clip {clip:?}: \
                     max |Δ| vs NO_SHARD = {diff:e}"
                );
                let bound = if fp16 { 1e-5 } else { 1e-6 };
                assert!(
                    diff <= bound,
                    "P={processes} {sharding} accumulation {accumulation} fp16 {fp16} clip {clip:?}: \
                     {diff:e} > {bound:e}"
                );
                worst = worst.max(diff);
            }
        }
    }
    println!("block-wise FULL_SHARD vs NO_SHARD, worst: {worst:e}");
}

/// Activation checkpointing alone (no `FULL_SHARD`) trains the weights of no checkpointing, bit for bit, and does
/// recompute: every block runs twice per step with it (forward, then recompute), once without.
#[test]
fn activation_checkpointing_alone_trains_the_weights_of_no_checkpointing() {
    const LAYERS: usize = 3;
    for (processes, sharding) in [
        (1, ShardingStrategy::NoShard),
        (2, ShardingStrategy::NoShard),
        (3, ShardingStrategy::ShardGradOp),
    ] {
        let counted = |checkpointing: bool| {
            let calls: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
            let setup = Setup {
                checkpointing,
                block_calls: Some(calls),
                ..Setup::new(processes, sharding)
            };
            let weights = run(setup, LAYERS);
            (weights, calls.load(Ordering::Relaxed))
        };
        let (plain, plain_calls) = counted(false);
        let (checkpointed, checkpointed_calls) = counted(true);
        let once = processes * 20 * LAYERS;
        assert_eq!(
            (plain_calls, checkpointed_calls),
            (once, 2 * once),
            "P={processes} {sharding}: block calls without and with checkpointing"
        );
        assert_eq!(
            plain, checkpointed,
            "P={processes} {sharding}: checkpointing changed the weights"
        );
    }
}

/// Burn's own gradient checkpointing (`autodiff_checkpointing`: element-wise operations recomputed in backward)
/// trains the weights of plain autodiff, alone and with activation checkpointing.
#[test]
fn burns_gradient_checkpointing_trains_the_weights_of_plain_autodiff() {
    let plain = run(Setup::new(2, ShardingStrategy::NoShard), 3);
    for checkpointing in [false, true] {
        let autodiff = run(
            Setup {
                autodiff: true,
                checkpointing,
                ..Setup::new(2, ShardingStrategy::NoShard)
            },
            3,
        );
        assert_eq!(plain, autodiff, "checkpointing {checkpointing}");
    }
    let checkpointed = Accelerator::builder()
        .autodiff_checkpointing(true)
        .build()
        .unwrap();
    assert!(
        checkpointed
            .device()
            .gradient_checkpointing_strategy()
            .is_some_and(|s| format!("{s:?}").contains("Balanced")),
        "{:?}",
        checkpointed.device().gradient_checkpointing_strategy()
    );
}

/// One block of one parameter (no bias, no input layer, no head): 1 parameter on 4 ranks, and 2 blocks (2
/// parameters) on 4 ranks, under `FULL_SHARD` and as 2 x 2 `HYBRID_SHARD`: ranks that own nothing still take
/// part in every collective.
#[test]
fn fewer_parameters_than_ranks_train_as_no_shard() {
    #[derive(Module, Debug)]
    struct Tiny {
        layers: Vec<Linear>,
    }
    impl Blocks for Tiny {
        type Block = Linear;
        fn blocks(&self) -> &[Linear] {
            &self.layers
        }
    }
    for layers in [1, 2] {
        let run_tiny = |sharding| {
            Accelerator::builder()
                .sharding(sharding)
                .dp_shard_size(2)
                .launch(4, |acc| {
                    let device = acc.device().clone();
                    let tiny = deterministic(Tiny {
                        layers: (0..layers)
                            .map(|_| LinearConfig::new(4, 4).with_bias(false).init(&device))
                            .collect(),
                    });
                    let mut model = acc.prepare_model(tiny)?;
                    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                    for step in 0..20 {
                        let (x, _) = batch(step * 8 + acc.process_index() * 2, 2, &device);
                        let x = x.narrow(1, 0, 4);
                        acc.backward_blocks(
                            &model,
                            |_| x.clone(),
                            |layer, h| layer.forward(h),
                            |_, h| (h - 0.5).powi_scalar(2).mean(),
                        )?;
                        model = optimizer.try_step(model)?;
                    }
                    Ok(flatten(&acc.unshard(&model)?))
                })
                .unwrap()
                .remove(0)
        };
        let plain = run_tiny(ShardingStrategy::NoShard);
        for sharding in [ShardingStrategy::FullShard, ShardingStrategy::HybridShard] {
            let diff = max_diff(&plain, &run_tiny(sharding));
            assert!(
                diff <= 1e-6,
                "{layers} parameters on 4 ranks, {sharding}: {diff:e}"
            );
        }
    }
}

/// Saved after 10 block-wise `FULL_SHARD` steps and resumed by new accelerators for 10 more: the weights of 20
/// steps straight through, bit for bit.
#[test]
fn a_block_wise_run_resumes_with_the_weights_of_one_straight_through() {
    let dir = std::env::temp_dir().join(format!("blockwise-resume-{}", std::process::id()));
    let setup = Setup::new(3, ShardingStrategy::FullShard);
    let straight = run(setup, 3);
    let half = Setup { steps: 10, ..setup };
    setup
        .builder()
        .launch(3, |acc| {
            let model = acc.prepare_model(model(3, acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let model = train(&acc, &half, model, &mut optimizer, 0)?;
            let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
            acc.save_state(Some(&dir), &parts)
        })
        .unwrap();
    let resumed = setup
        .builder()
        .launch(3, |acc| {
            let model = acc.prepare_model(model(3, acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let mut state = acc.load_state(Some(&dir))?;
            let model = state.model(model)?;
            state.optimizer(&mut optimizer)?;
            state.finish()?;
            let model = train(&acc, &half, model, &mut optimizer, 10)?;
            Ok(flatten(&acc.unshard(&model)?))
        })
        .unwrap()
        .remove(0);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(straight, resumed, "resumed weights differ");
}

/// A block-wise `FULL_SHARD` pass gathers what is outside the blocks without them (`before` sees the blocks as
/// this rank's dim-0 slices, in its forward pass and in its recompute) and each block whole only when it runs,
/// once forward and once recomputed.
#[test]
fn a_block_wise_pass_gathers_each_block_only_when_it_runs() {
    let calls = AtomicUsize::new(0);
    let whole_blocks = Setup::new(2, ShardingStrategy::FullShard)
        .builder()
        .launch(2, |acc| {
            let device = acc.device().clone();
            let model = acc.prepare_model(model(4, &device))?;
            let (x, y) = batch(0, 6, &device);
            let whole_blocks = std::cell::Cell::new(usize::MAX);
            acc.accumulate();
            acc.backward_blocks(
                &model,
                |m| {
                    // Outside the blocks: whole. The blocks: this rank's slice of each.
                    assert_eq!(m.input.weight.dims(), [6, WIDTH]);
                    whole_blocks.set(
                        m.layers
                            .iter()
                            .filter(|l| l.weight.dims()[0] == WIDTH)
                            .count(),
                    );
                    assert!(
                        m.layers
                            .iter()
                            .all(|l| l.weight.dims() == [WIDTH.div_ceil(2), WIDTH]),
                        "each block is this rank's half of its rows"
                    );
                    m.input.forward(x.clone()).tanh()
                },
                |layer, h| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    assert_eq!(layer.weight.dims(), [WIDTH, WIDTH], "the block is whole");
                    layer.forward(h).tanh()
                },
                |m, h| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
            )?;
            Ok(whole_blocks.get())
        })
        .unwrap();
    // Before the blocks run no rank holds a block whole (a pass that gathered them up front would show 4).
    assert_eq!(
        whole_blocks,
        vec![0, 0],
        "whole blocks on each rank before the block pass"
    );
    // Each of 2 ranks: 4 blocks forward, 4 recomputed.
    assert_eq!(calls.load(Ordering::Relaxed), 16);
}

/// A model mixing f32 and f16 parameters (its blocks in f16) trains under `SHARD_GRAD_OP` and `FULL_SHARD`
/// (whole and block-wise) to the weights of `NO_SHARD`, each gradient reduced back into its own dtype.
#[test]
fn mixed_dtypes_shard_as_no_shard() {
    use burn::tensor::DType;
    /// Every parameter of the blocks in f16.
    struct Half;
    impl ModuleMapper for Half {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.cast(DType::F16))
        }
    }
    let run_mixed = |processes: usize, sharding: ShardingStrategy, blocks: bool| {
        Accelerator::builder()
            .sharding(sharding)
            .launch(processes, |acc| {
                let device = acc.device().clone();
                let mut deep = model(3, &device);
                deep.layers = deep.layers.into_iter().map(|l| l.map(&mut Half)).collect();
                let mut model = acc.prepare_model(deep)?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let rows = GLOBAL_BATCH / processes;
                let half = |layer: &Linear, h: Tensor<2>| {
                    layer.forward(h.cast(DType::F16)).tanh().cast(DType::F32)
                };
                for step in 0..10 {
                    let (x, y) = batch(
                        step * GLOBAL_BATCH + acc.process_index() * rows,
                        rows,
                        &device,
                    );
                    let loss_of = |out: Tensor<2>, y: Tensor<2>| {
                        (out - y).powi_scalar(2).sum().div_scalar(rows as f32)
                    };
                    if blocks {
                        acc.backward_blocks(
                            &model,
                            |m| m.input.forward(x.clone()).tanh(),
                            half,
                            |m, h| loss_of(m.head.forward(h), y.clone()),
                        )?;
                    } else {
                        let whole = acc.unshard(&model)?;
                        let mut h = whole.input.forward(x).tanh();
                        for layer in &whole.layers {
                            h = half(layer, h);
                        }
                        acc.backward(loss_of(whole.head.forward(h), y), &whole)?;
                    }
                    model = optimizer.try_step(model)?;
                }
                let whole = acc.unshard(&model)?;
                assert_eq!(whole.layers[0].weight.val().dtype(), DType::F16);
                assert_eq!(whole.head.weight.val().dtype(), DType::F32);
                Ok(flatten(&whole))
            })
            .unwrap_or_else(|e| panic!("P={processes} {sharding} blocks {blocks}: {e}"))
            .remove(0)
    };
    for processes in [2, 3] {
        let plain = run_mixed(processes, ShardingStrategy::NoShard, false);
        for (sharding, blocks) in [
            (ShardingStrategy::ShardGradOp, false),
            (ShardingStrategy::FullShard, false),
            (ShardingStrategy::FullShard, true),
        ] {
            let diff = max_diff(&plain, &run_mixed(processes, sharding, blocks));
            assert!(
                diff <= 1e-6,
                "P={processes} {sharding} blocks {blocks}: {diff:e}"
            );
        }
    }
}

/// `find_executable_batch_size` around a block-wise `FULL_SHARD` step: an out-of-memory failure in the middle of
/// the backward pass (the second block's recompute, on every rank, as a GPU fails on every rank of a too large
/// batch, after the last block's gradients were reduced) drops what the failed attempt had reduced, and the
/// smaller batch that fits trains to the weights of `NO_SHARD` (failing in its forward pass) with that batch.
#[test]
fn find_executable_batch_size_retries_a_block_wise_step() {
    // Block calls: 3 forward, then the recomputes of blocks 2, 1, 0 (block-wise); 3 forward only (plain).
    let train_fitted = |sharding: ShardingStrategy, failing_call: usize| {
        Setup::new(2, sharding)
            .builder()
            .launch(2, |acc| {
                let device = acc.device().clone();
                let mut model = acc.prepare_model(model(3, &device))?;
                // SGD: the step is the gradient itself, so a gradient the failed attempt left behind shows (after
                // one Adam step, about lr × sign(g), it would barely).
                let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 0.5);
                let fitted = acc
                    .find_executable_batch_size(32, |batch_size| {
                        let rows = batch_size / 2;
                        let (x, y) = batch(acc.process_index() * rows, rows, &device);
                        let calls = AtomicUsize::new(0);
                        acc.accumulate();
                        acc.backward_blocks(
                            &model,
                            |m| m.input.forward(x.clone()).tanh(),
                            |layer, h| {
                                let call = calls.fetch_add(1, Ordering::Relaxed);
                                if call == failing_call && batch_size > 20 {
                                    panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
                                }
                                layer.forward(h).tanh()
                            },
                            |m, h| (m.head.forward(h) - y.clone()).powi_scalar(2).mean(),
                        )?;
                        Ok::<_, burn_accelerate::Error>(batch_size)
                    })
                    .map_err(|e| burn_accelerate::Error::InvalidArgument(e.to_string()))?;
                model = optimizer.try_step(model)?;
                Ok((fitted, flatten(&acc.unshard(&model)?)))
            })
            .unwrap()
            .remove(0)
    };
    let (fitted, blockwise) = train_fitted(ShardingStrategy::FullShard, 4);
    let (plain_fitted, plain) = train_fitted(ShardingStrategy::NoShard, 1);
    assert_eq!((fitted, plain_fitted), (19, 19));
    let diff = max_diff(&plain, &blockwise);
    assert!(diff <= 1e-6, "{diff:e}");
}

/// `save_model` under `FULL_SHARD` fetches one parameter at a time from its owner while the main process writes
/// it (never the whole model on one rank): the files, in one piece or in shards of 1 KB, in PyTorch's layout
/// (weights transposed) or Burn's, load back into the whole model's weights exactly.
#[test]
fn save_model_under_full_shard_writes_the_whole_model_tensor_by_tensor() {
    use burn_accelerate::checkpoint::{LoadOptions, SaveOptions, WeightLayout};
    let dir = std::env::temp_dir().join(format!("blockwise-save-{}", std::process::id()));
    let setup = Setup {
        steps: 5,
        ..Setup::new(3, ShardingStrategy::FullShard)
    };
    for (layout, shard) in [(WeightLayout::PyTorch, "10GB"), (WeightLayout::Burn, "1KB")] {
        let out = dir.join(format!("{layout:?}-{shard}"));
        let (whole, files) = setup
            .builder()
            .launch(3, |acc| {
                let model = acc.prepare_model(model(3, acc.device()))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let model = train(&acc, &setup, model, &mut optimizer, 0)?;
                let options = SaveOptions {
                    layout,
                    max_shard_size: shard.into(),
                    ..SaveOptions::default()
                };
                let files = acc.save_model_with(&model, &out, &options)?;
                Ok((flatten(&acc.unshard(&model)?), files.len()))
            })
            .unwrap()
            .remove(0);
        assert!(files >= if shard == "1KB" { 3 } else { 1 }, "{files} files");
        let acc = Accelerator::new().unwrap();
        let (loaded, report) = acc
            .load_checkpoint_in_model(
                model(3, acc.device()),
                &out,
                &LoadOptions {
                    strict: true,
                    ..LoadOptions::default()
                },
            )
            .unwrap();
        assert_eq!(flatten(&loaded), whole, "{layout:?} {shard}: {report:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
