//! More than one model, and parameters that come and go, under every strategy: two models trained in alternation
//! with gradient accumulation (a GAN's generator and discriminator: the second model's loss runs through the
//! first), a layer frozen at `prepare_model` and unfrozen later, and data-dependent routing that leaves some
//! parameters without a gradient on some ranks. Each run on 1–4 in-process ranks, every strategy (`NO_SHARD`,
//! `SHARD_GRAD_OP`, `FULL_SHARD` whole and block by block, `HYBRID_SHARD`), is compared with the loop a Burn user
//! writes by hand on one process, which sees the whole batch.

#[path = "support/isolation.rs"]
mod isolation;

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_accelerate::{Accelerator, AcceleratorBuilder, Blocks, ShardingStrategy};

/// Input features.
const IN: usize = 4;
/// Width of the blocks.
const WIDTH: usize = 8;
/// Samples of one micro-batch over all ranks (divisible by 1, 2, 3 and 4).
const GLOBAL: usize = 12;

/// A small stack: an input layer, two blocks, and two heads (the second is used by the routing test only).
#[derive(Module, Debug)]
struct Stack {
    input: Linear,
    layers: Vec<Linear>,
    heads: Vec<Linear>,
}

impl Stack {
    fn new(device: &Device) -> Self {
        Self {
            input: LinearConfig::new(IN, WIDTH).init(device),
            layers: (0..2)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
            heads: (0..2)
                .map(|_| LinearConfig::new(WIDTH, 1).init(device))
                .collect(),
        }
    }

    fn block(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
        layer.forward(x).tanh()
    }

    /// The output of head `head` for `x`.
    fn forward(&self, x: Tensor<2>, head: usize) -> Tensor<2> {
        let mut h = self.input.forward(x);
        for layer in &self.layers {
            h = Self::block(layer, h);
        }
        self.heads[head].forward(h)
    }
}

impl Blocks for Stack {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.layers
    }
}

fn mse(prediction: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    MseLoss::new().forward(prediction, target, Reduction::Mean)
}

/// Two models drawn from one seed under one lock (the tests of this binary share the device's generator).
fn initial() -> (Stack, Stack) {
    static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _draw = DRAW.lock().unwrap_or_else(|p| p.into_inner());
    let device = Device::default().autodiff();
    device.seed(23);
    let pair = (Stack::new(&device), Stack::new(&device));
    let _ = (weights(&pair.0), weights(&pair.1));
    pair
}

/// Rows `rows` of micro-batch `micro` of step `step`: inputs and two targets, a smooth function of the indices.
fn batch(
    step: usize,
    micro: usize,
    rows: std::ops::Range<usize>,
    device: &Device,
) -> [Tensor<2>; 3] {
    let n = rows.len();
    let value = |i: usize, j: usize, salt: usize| {
        ((step * 131 + micro * 17 + i * 7 + j * 3 + salt) as f32 * 0.37).sin()
    };
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|i| (0..IN).map(move |j| value(i, j, 0)))
        .collect();
    let t1: Vec<f32> = rows.clone().map(|i| value(i, 0, 5) * 0.5).collect();
    let t2: Vec<f32> = rows.map(|i| value(i, 1, 9) * 0.5).collect();
    let tensor =
        |v: Vec<f32>, cols: usize| Tensor::<2>::from_data(TensorData::new(v, [n, cols]), device);
    [tensor(x, IN), tensor(t1, 1), tensor(t2, 1)]
}

/// This rank's rows of a micro-batch of [`GLOBAL`] samples.
fn rows(rank: usize, ranks: usize) -> std::ops::Range<usize> {
    let per = GLOBAL / ranks;
    rank * per..(rank + 1) * per
}

/// Every parameter's values, in visiting order.
fn weights<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Read(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(
                param
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut read = Read(Vec::new());
    model.visit(&mut read);
    read.0
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "the same parameters");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "the same sizes");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

/// Every parameter of a module set to train (a frozen layer unfrozen).
struct Unfreeze;
impl ModuleMapper for Unfreeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.set_require_grad(true)
    }
}

/// How a run is distributed: a name for messages, the ranks, and the builder.
struct Setup {
    name: String,
    ranks: usize,
    builder: AcceleratorBuilder,
    /// Whether the passes run block by block (`backward_blocks`).
    blockwise: bool,
}

/// Every strategy on 1–4 ranks, whole and block by block.
fn setups() -> Vec<Setup> {
    let mut all = Vec::new();
    let builder = || Accelerator::builder().collective_timeout(std::time::Duration::from_secs(60));
    for ranks in [1, 2, 3] {
        all.push(Setup {
            name: format!("NO_SHARD P={ranks}"),
            ranks,
            builder: builder(),
            blockwise: false,
        });
    }
    all.push(Setup {
        name: "NO_SHARD P=2, activation checkpointing".into(),
        ranks: 2,
        builder: builder().activation_checkpointing(true),
        blockwise: true,
    });
    for ranks in [2, 3] {
        for mode in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
            all.push(Setup {
                name: format!("{mode} P={ranks}"),
                ranks,
                builder: builder().sharding(mode),
                blockwise: false,
            });
        }
        all.push(Setup {
            name: format!("FULL_SHARD block-wise P={ranks}"),
            ranks,
            builder: builder().sharding(ShardingStrategy::FullShard),
            blockwise: true,
        });
    }
    for mode in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        all.push(Setup {
            name: format!("{mode} 2x2"),
            ranks: 4,
            builder: builder().sharding(mode).dp_shard_size(2),
            blockwise: false,
        });
    }
    all
}

/// One micro-batch's backward pass of `model` on `x`, whole or block by block, through head `head`; `extra` is
/// added to the prediction (another model's output, whose gradients are not this model's). With no head, the
/// loss reaches none of the model's parameters (this rank's samples were all routed elsewhere): it depends on
/// the input alone.
#[allow(clippy::too_many_arguments)]
fn backward(
    acc: &Accelerator,
    model: &Stack,
    blockwise: bool,
    x: &Tensor<2>,
    head: Option<usize>,
    extra: Option<Tensor<2>>,
    target: &Tensor<2>,
    skip_blocks: bool,
) -> burn_accelerate::Result<()> {
    let rows = x.dims()[0];
    let routed_elsewhere = |h: Tensor<2>| h.slice([0..rows, 0..1]);
    let predict = |m: &Stack, h: Tensor<2>| {
        let y = match head {
            Some(head) => m.heads[head].forward(h),
            None => routed_elsewhere(h),
        };
        match &extra {
            Some(e) => y + e.clone(),
            None => y,
        }
    };
    let skip_blocks = skip_blocks || head.is_none();
    let input = |m: &Stack| match head {
        Some(_) => m.input.forward(x.clone()),
        None => x.clone().require_grad(),
    };
    if blockwise {
        acc.backward_blocks(
            model,
            input,
            |layer, h| {
                if skip_blocks {
                    h
                } else {
                    Stack::block(layer, h)
                }
            },
            |m, h| mse(predict(m, h), target.clone()),
        )?;
        return Ok(());
    }
    let whole = acc.unshard(model)?;
    let mut h = input(&whole);
    if !skip_blocks {
        for layer in &whole.layers {
            h = Stack::block(layer, h);
        }
    }
    acc.backward(mse(predict(&whole, h), target.clone()), &whole)
}

/// Two models, `a` and `b`, trained in alternation with 2 micro-batches per step and SGD: `a` on its own loss,
/// `b` on a loss that runs through `a` too (as a GAN's generator loss runs through the discriminator), of which
/// only `b`'s gradients are used. Each model's gradients must be the mean over its own 2 micro-batches, whatever
/// the other model does in between (Accelerate divides every loss by the accumulation steps).
#[test]
fn two_models_with_accumulation_train_as_a_plain_burn_loop() {
    const STEPS: usize = 3;
    const K: usize = 2;
    const LR: f64 = 0.1;
    let (a0, b0) = initial();

    // The loop a Burn user writes by hand: one process, the whole batch, each model's loss summed over the
    // window and divided by its length.
    let device = Device::default().autodiff();
    let (mut a, mut b) = (a0.clone(), b0.clone());
    let (mut opt_a, mut opt_b) = (SgdConfig::new().init(), SgdConfig::new().init());
    for step in 0..STEPS {
        let mut loss_a: Option<Tensor<1>> = None;
        let mut loss_b: Option<Tensor<1>> = None;
        for micro in 0..K {
            let [x, t1, t2] = batch(step, micro, 0..GLOBAL, &device);
            let la = mse(a.forward(x.clone(), 0), t1).div_scalar(K as f32);
            let lb = mse(b.forward(x.clone(), 0) + a.forward(x, 0), t2).div_scalar(K as f32);
            loss_a = Some(loss_a.map_or(la.clone(), |l| l + la));
            loss_b = Some(loss_b.map_or(lb.clone(), |l| l + lb));
        }
        let grads_a = GradientsParams::from_grads(loss_a.unwrap().backward(), &a);
        let grads_b = GradientsParams::from_grads(loss_b.unwrap().backward(), &b);
        a = opt_a.step(LR, a, grads_a);
        b = opt_b.step(LR, b, grads_b);
    }
    let expected = [weights(&a), weights(&b)];

    for setup in setups() {
        let Setup {
            name,
            ranks,
            builder,
            blockwise,
        } = setup;
        let out = builder
            .gradient_accumulation_steps(K)
            .launch(ranks, |acc| {
                let device = acc.device().clone();
                let rank = acc.process_index();
                let mut a = acc.prepare_model(a0.clone())?;
                let mut b = acc.prepare_model(b0.clone())?;
                let mut opt_a = acc.prepare_optimizer(SgdConfig::new().init(), LR);
                let mut opt_b = acc.prepare_optimizer(SgdConfig::new().init(), LR);
                for step in 0..STEPS {
                    for micro in 0..K {
                        acc.accumulate();
                        let [x, t1, t2] = batch(step, micro, rows(rank, ranks), &device);
                        backward(&acc, &a, blockwise, &x, Some(0), None, &t1, false)?;
                        // The second model's loss runs through the first: its gradients there are not `b`'s.
                        let through_a = acc.unshard(&a)?.forward(x.clone(), 0);
                        backward(
                            &acc,
                            &b,
                            blockwise,
                            &x,
                            Some(0),
                            Some(through_a),
                            &t2,
                            false,
                        )?;
                        a = opt_a.try_step(a)?;
                        b = opt_b.try_step(b)?;
                    }
                }
                Ok([weights(&acc.unshard(&a)?), weights(&acc.unshard(&b)?)])
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (rank, got) in out.iter().enumerate() {
            for (model, (got, want)) in got.iter().zip(&expected).enumerate() {
                let diff = max_abs_diff(got, want);
                assert!(
                    diff <= 1e-5,
                    "{name}, rank {rank}, model {}: max |Δ| against the plain Burn loop = {diff:e}",
                    ["a", "b"][model]
                );
            }
        }
    }
}

/// A head frozen at `prepare_model` and unfrozen after two steps trains from then on, with Adam (its state starts
/// at the unfreezing), as in a plain Burn loop: a sharded strategy gives it an owner without moving any other
/// parameter (and its optimizer state) to another rank. A teacher model that stays frozen throughout (a
/// distillation's) is prepared too and is never changed.
#[test]
fn a_layer_frozen_at_prepare_and_unfrozen_later_trains() {
    const STEPS: usize = 5;
    const UNFREEZE_AT: usize = 2;
    const LR: f64 = 1e-2;
    let (student0, teacher0) = initial();
    let freeze = |mut m: Stack| {
        m.heads[0] = m.heads[0].clone().no_grad();
        m
    };
    let unfreeze = |mut m: Stack| {
        m.heads[0] = m.heads[0].clone().map(&mut Unfreeze);
        m
    };
    let teacher0 = teacher0.no_grad();

    let device = Device::default().autodiff();
    let mut student = freeze(student0.clone());
    let mut opt = AdamConfig::new().init();
    for step in 0..STEPS {
        if step == UNFREEZE_AT {
            student = unfreeze(student);
        }
        let [x, t1, _] = batch(step, 0, 0..GLOBAL, &device);
        let target = (teacher0.forward(x.clone(), 0).detach() + t1).div_scalar(2.0);
        let loss = mse(student.forward(x, 0), target);
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = opt.step(LR, student, grads);
    }
    let expected = weights(&student);
    assert!(
        max_abs_diff(&weights(&student0), &expected) > 0.0,
        "the reference trained"
    );

    for setup in setups() {
        let Setup {
            name,
            ranks,
            builder,
            blockwise,
        } = setup;
        let out = builder
            .launch(ranks, |acc| {
                let device = acc.device().clone();
                let rank = acc.process_index();
                let mut student = acc.prepare_model(freeze(student0.clone()))?;
                let teacher = acc.prepare_model(teacher0.clone())?;
                let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), LR);
                for step in 0..STEPS {
                    if step == UNFREEZE_AT {
                        student = unfreeze(student);
                    }
                    let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
                    let taught = acc.unshard(&teacher)?.forward(x.clone(), 0).detach();
                    let target = (taught + t1).div_scalar(2.0);
                    backward(&acc, &student, blockwise, &x, Some(0), None, &target, false)?;
                    student = opt.try_step(student)?;
                }
                Ok((
                    weights(&acc.unshard(&student)?),
                    weights(&acc.unshard(&teacher)?),
                ))
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (rank, (student, teacher)) in out.iter().enumerate() {
            let diff = max_abs_diff(student, &expected);
            assert!(
                diff <= 1e-5,
                "{name}, rank {rank}: max |Δ| against the plain Burn loop = {diff:e}"
            );
            assert_eq!(
                max_abs_diff(teacher, &weights(&teacher0)),
                0.0,
                "{name}, rank {rank}: the frozen teacher changed"
            );
        }
    }
}

/// Data-dependent routing (DDP's `find_unused_parameters` case): in each step, each rank's samples go through one
/// of two heads, chosen by step and rank, on some ranks past no block at all, and on the last of three or more
/// ranks in odd steps through no parameter of the model at all (its loss depends on the input alone), so a rank
/// may hold no gradient for a head, for every block, or for anything. Every rank still takes part in every
/// reduction, and the weights are those of a plain Burn loop whose loss is the mean of the ranks' losses. With two
/// or more ranks, both heads and the blocks are used somewhere in every step, so Adam steps every parameter in both
/// loops.
#[test]
fn parameters_unused_on_some_ranks_train_as_a_plain_burn_loop() {
    const STEPS: usize = 4;
    const LR: f64 = 1e-2;
    let route = |step: usize, rank: usize, ranks: usize| {
        let elsewhere = ranks >= 3 && rank == ranks - 1 && step % 2 == 1;
        (!elsewhere).then_some((step + rank) % 2)
    };
    let skips_blocks = |step: usize, rank: usize| (step + rank) % 3 == 1;
    let (start, _) = initial();

    let reference = |ranks: usize| {
        let device = Device::default().autodiff();
        let mut model = start.clone();
        let mut opt = AdamConfig::new().init();
        for step in 0..STEPS {
            let mut total: Option<Tensor<1>> = None;
            for rank in 0..ranks {
                let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
                let y = match route(step, rank, ranks) {
                    Some(head) => {
                        let mut h = model.input.forward(x);
                        if !skips_blocks(step, rank) {
                            for layer in &model.layers {
                                h = Stack::block(layer, h);
                            }
                        }
                        model.heads[head].forward(h)
                    }
                    None => {
                        let rows = x.dims()[0];
                        x.require_grad().slice([0..rows, 0..1])
                    }
                };
                let loss = mse(y, t1).div_scalar(ranks as f32);
                total = Some(total.map_or(loss.clone(), |t| t + loss));
            }
            let grads = GradientsParams::from_grads(total.unwrap().backward(), &model);
            model = opt.step(LR, model, grads);
        }
        weights(&model)
    };

    for setup in setups() {
        let Setup {
            name,
            ranks,
            builder,
            blockwise,
        } = setup;
        let expected = reference(ranks);
        let out = builder
            .launch(ranks, |acc| {
                let device = acc.device().clone();
                let rank = acc.process_index();
                let mut model = acc.prepare_model(start.clone())?;
                let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), LR);
                for step in 0..STEPS {
                    let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
                    let skip = skips_blocks(step, rank);
                    backward(
                        &acc,
                        &model,
                        blockwise,
                        &x,
                        route(step, rank, ranks),
                        None,
                        &t1,
                        skip,
                    )?;
                    model = opt.try_step(model)?;
                }
                Ok(weights(&acc.unshard(&model)?))
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (rank, got) in out.iter().enumerate() {
            let diff = max_abs_diff(got, &expected);
            assert!(
                diff <= 1e-5,
                "{name}, rank {rank}: max |Δ| against the plain Burn loop = {diff:e}"
            );
        }
    }
}

/// An error returned by one rank's own code (here at the third step, before its backward pass) ends every rank at
/// once: each peer's collective fails with an error naming that rank and its error, not after the collective
/// timeout (60 s here), and `launch` returns the failing rank's own error.
#[test]
fn an_error_on_one_rank_ends_every_rank_naming_it() {
    let (start, _) = initial();
    for setup in setups().into_iter().filter(|s| s.ranks > 1) {
        let Setup {
            name,
            ranks,
            builder,
            blockwise,
        } = setup;
        let bad = 1;
        let own = format!("the user's own failure on rank {bad}");
        let peers = std::sync::Mutex::new(Vec::new());
        let began = std::time::Instant::now();
        let result = builder.launch(ranks, |acc| {
            let device = acc.device().clone();
            let rank = acc.process_index();
            let mut model = acc.prepare_model(start.clone())?;
            let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            for step in 0..4 {
                if rank == bad && step == 2 {
                    return Err(burn_accelerate::Error::InvalidArgument(own.clone()));
                }
                let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
                let pass = backward(&acc, &model, blockwise, &x, Some(0), None, &t1, false)
                    .and_then(|()| opt.try_step(model.clone()));
                match pass {
                    Ok(stepped) => model = stepped,
                    Err(error) => {
                        peers.lock().unwrap().push((rank, error.to_string()));
                        return Err(error);
                    }
                }
            }
            Ok(())
        });
        let elapsed = began.elapsed();
        let error = result.expect_err(&name).to_string();
        assert!(error.contains(&own), "{name}: launch returned {error}");
        let peers = peers.into_inner().unwrap();
        assert_eq!(
            peers.len(),
            ranks - 1,
            "{name}: every peer stopped with an error: {peers:?}"
        );
        for (rank, message) in &peers {
            assert!(
                message.contains(&format!("rank {bad}")) && message.contains(&own),
                "{name}, rank {rank}: the error names neither the failing rank nor its error: {message}"
            );
            assert!(
                !message.contains("timed out") && !message.contains("timeout"),
                "{name}, rank {rank}: a timeout instead of the failure: {message}"
            );
        }
        assert!(
            elapsed < std::time::Duration::from_secs(30),
            "{name}: the ranks waited {elapsed:?} (the collective timeout is 60 s)"
        );
    }
}
