//! The scenarios of `tests/suite/many_models.rs` and the `many_models` example: more than one model, and parameters that
//! come and go, each as the loop a burn-accelerate user writes (on any ranks and strategy) and as the loop a Burn
//! user writes by hand on one process with the whole batch. Nothing is downloaded: the data is a smooth function of
//! the indices.

#![allow(dead_code)]

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_accelerate::{Accelerator, Blocks, Result};

/// Input features.
pub const IN: usize = 4;
/// Width of the blocks.
pub const WIDTH: usize = 8;
/// Samples of one micro-batch over all ranks (divisible by 1, 2, 3 and 4).
pub const GLOBAL: usize = 12;

/// A small stack: an input layer, two blocks, and two heads (the second is used by the routing test only).
#[derive(Module, Debug)]
pub struct Stack {
    /// The input layer.
    pub input: Linear,
    /// The blocks.
    pub layers: Vec<Linear>,
    /// The heads.
    pub heads: Vec<Linear>,
}

impl Stack {
    pub fn new(device: &Device) -> Self {
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

    pub fn block(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
        layer.forward(x).tanh()
    }

    /// The output of head `head` for `x`.
    pub fn forward(&self, x: Tensor<2>, head: usize) -> Tensor<2> {
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

pub fn mse(prediction: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    MseLoss::new().forward(prediction, target, Reduction::Mean)
}

/// Two models drawn from one seed under one lock (the tests of this binary share the device's generator).
pub fn initial() -> (Stack, Stack) {
    static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _draw = DRAW.lock().unwrap_or_else(|p| p.into_inner());
    let device = Device::default().autodiff();
    device.seed(23);
    let pair = (Stack::new(&device), Stack::new(&device));
    let _ = (weights(&pair.0), weights(&pair.1));
    pair
}

/// Rows `rows` of micro-batch `micro` of step `step`: inputs and two targets, a smooth function of the indices.
pub fn batch(
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
pub fn rows(rank: usize, ranks: usize) -> std::ops::Range<usize> {
    let per = GLOBAL / ranks;
    rank * per..(rank + 1) * per
}

/// Every parameter's values, in visiting order.
pub fn weights<M: Module>(model: &M) -> Vec<Vec<f32>> {
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

pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
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
pub struct Unfreeze;
impl ModuleMapper for Unfreeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.set_require_grad(true)
    }
}

/// One micro-batch's backward pass of `model` on `x`, whole or block by block, through head `head`; `extra` is
/// added to the prediction (another model's output, whose gradients are not this model's). With no head, the
/// loss reaches none of the model's parameters (this rank's samples were all routed elsewhere): it depends on
/// the input alone.
#[allow(clippy::too_many_arguments)]
pub fn backward(
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

/// The scenarios, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Two models trained in alternation with 2 micro-batches per step and SGD (see [`two_models`]).
    TwoModels,
    /// A head frozen at `prepare_model`, unfrozen after two steps, beside a frozen teacher (see [`unfreeze`]).
    Unfreeze,
    /// Data-dependent routing that leaves ranks without some gradients, or without any (see [`routing`]).
    Routing,
    /// Rank 1 returns an error of its own at the third step (see [`rank_error`]).
    RankError,
}

impl Scenario {
    /// Every scenario, with its name.
    pub const ALL: [(Scenario, &'static str); 4] = [
        (Scenario::TwoModels, "two-models"),
        (Scenario::Unfreeze, "unfreeze"),
        (Scenario::Routing, "routing"),
        (Scenario::RankError, "rank-error"),
    ];

    /// The scenario called `name`.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(s, _)| *s)
    }

    /// Micro-batches per optimizer step the scenario trains with.
    pub fn accumulation(self) -> usize {
        match self {
            Scenario::TwoModels => TWO_MODELS_K,
            _ => 1,
        }
    }

    /// The final weights of every model this rank trains (whole), through `acc`.
    pub fn train(
        self,
        acc: &Accelerator,
        start: &(Stack, Stack),
        blockwise: bool,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        match self {
            Scenario::TwoModels => two_models(acc, start, blockwise),
            Scenario::Unfreeze => unfreeze(acc, start, blockwise),
            Scenario::Routing => routing(acc, start, blockwise),
            Scenario::RankError => rank_error(acc, start, blockwise).map(|w| vec![w]),
        }
    }

    /// The final weights of the same loop written by hand with Burn alone, on one process that sees the batches of
    /// all `ranks` ranks (`RankError` has none: it fails).
    pub fn reference(self, start: &(Stack, Stack), ranks: usize) -> Option<Vec<Vec<Vec<f32>>>> {
        match self {
            Scenario::TwoModels => Some(two_models_reference(start)),
            Scenario::Unfreeze => Some(vec![unfreeze_reference(start)]),
            Scenario::Routing => Some(vec![routing_reference(start, ranks)]),
            Scenario::RankError => None,
        }
    }
}

/// Optimizer steps of [`two_models`].
const TWO_MODELS_STEPS: usize = 3;
/// Micro-batches per step of [`two_models`].
pub const TWO_MODELS_K: usize = 2;
const TWO_MODELS_LR: f64 = 0.1;

/// Two models, `a` and `b`, trained in alternation with 2 micro-batches per step (the accelerator must be built
/// with `gradient_accumulation_steps(2)`) and SGD: `a` on its own loss, `b` on a loss that runs through `a` too
/// (as a GAN's generator loss runs through the discriminator), of which only `b`'s gradients are used.
pub fn two_models(
    acc: &Accelerator,
    (a0, b0): &(Stack, Stack),
    blockwise: bool,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let device = acc.device().clone();
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let mut a = acc.prepare_model(a0.clone())?;
    let mut b = acc.prepare_model(b0.clone())?;
    let mut opt_a = acc.prepare_optimizer(SgdConfig::new().init(), TWO_MODELS_LR);
    let mut opt_b = acc.prepare_optimizer(SgdConfig::new().init(), TWO_MODELS_LR);
    for step in 0..TWO_MODELS_STEPS {
        for micro in 0..TWO_MODELS_K {
            acc.accumulate();
            let [x, t1, t2] = batch(step, micro, rows(rank, ranks), &device);
            backward(acc, &a, blockwise, &x, Some(0), None, &t1, false)?;
            // The second model's loss runs through the first: its gradients there are not `b`'s.
            let through_a = acc.unshard(&a)?.forward(x.clone(), 0);
            backward(acc, &b, blockwise, &x, Some(0), Some(through_a), &t2, false)?;
            a = opt_a.try_step(a)?;
            b = opt_b.try_step(b)?;
        }
    }
    Ok(vec![weights(&acc.unshard(&a)?), weights(&acc.unshard(&b)?)])
}

/// [`two_models`] by hand: each model's loss summed over the window and divided by its length.
pub fn two_models_reference((a0, b0): &(Stack, Stack)) -> Vec<Vec<Vec<f32>>> {
    let device = Device::default().autodiff();
    let (mut a, mut b) = (a0.clone(), b0.clone());
    let (mut opt_a, mut opt_b) = (SgdConfig::new().init(), SgdConfig::new().init());
    let k = TWO_MODELS_K as f32;
    for step in 0..TWO_MODELS_STEPS {
        let mut loss_a: Option<Tensor<1>> = None;
        let mut loss_b: Option<Tensor<1>> = None;
        for micro in 0..TWO_MODELS_K {
            let [x, t1, t2] = batch(step, micro, 0..GLOBAL, &device);
            let la = mse(a.forward(x.clone(), 0), t1).div_scalar(k);
            let lb = mse(b.forward(x.clone(), 0) + a.forward(x, 0), t2).div_scalar(k);
            loss_a = Some(loss_a.map_or(la.clone(), |l| l + la));
            loss_b = Some(loss_b.map_or(lb.clone(), |l| l + lb));
        }
        let grads_a = GradientsParams::from_grads(loss_a.unwrap().backward(), &a);
        let grads_b = GradientsParams::from_grads(loss_b.unwrap().backward(), &b);
        a = opt_a.step(TWO_MODELS_LR, a, grads_a);
        b = opt_b.step(TWO_MODELS_LR, b, grads_b);
    }
    vec![weights(&a), weights(&b)]
}

const UNFREEZE_STEPS: usize = 5;
const UNFREEZE_AT: usize = 2;
const UNFREEZE_LR: f64 = 1e-2;

fn freeze(mut m: Stack) -> Stack {
    m.heads[0] = m.heads[0].clone().no_grad();
    m
}

fn unfrozen(mut m: Stack) -> Stack {
    m.heads[0] = m.heads[0].clone().map(&mut Unfreeze);
    m
}

/// A student whose head is frozen at `prepare_model` and unfrozen after two steps (Adam: its state starts at the
/// unfreezing), learning from a teacher that stays frozen throughout (prepared too, never changed: an error says
/// so if it did).
pub fn unfreeze(
    acc: &Accelerator,
    (student0, teacher0): &(Stack, Stack),
    blockwise: bool,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let device = acc.device().clone();
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let teacher0 = teacher0.clone().no_grad();
    let mut student = acc.prepare_model(freeze(student0.clone()))?;
    let teacher = acc.prepare_model(teacher0.clone())?;
    let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), UNFREEZE_LR);
    for step in 0..UNFREEZE_STEPS {
        if step == UNFREEZE_AT {
            student = unfrozen(student);
        }
        let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
        let taught = acc.unshard(&teacher)?.forward(x.clone(), 0).detach();
        let target = (taught + t1).div_scalar(2.0);
        backward(acc, &student, blockwise, &x, Some(0), None, &target, false)?;
        student = opt.try_step(student)?;
    }
    if weights(&acc.unshard(&teacher)?) != weights(&teacher0) {
        return Err(burn_accelerate::Error::InvalidArgument(
            "the frozen teacher changed".into(),
        ));
    }
    Ok(vec![weights(&acc.unshard(&student)?)])
}

/// [`unfreeze`] by hand.
pub fn unfreeze_reference((student0, teacher0): &(Stack, Stack)) -> Vec<Vec<f32>> {
    let device = Device::default().autodiff();
    let teacher0 = teacher0.clone().no_grad();
    let mut student = freeze(student0.clone());
    let mut opt = AdamConfig::new().init();
    for step in 0..UNFREEZE_STEPS {
        if step == UNFREEZE_AT {
            student = unfrozen(student);
        }
        let [x, t1, _] = batch(step, 0, 0..GLOBAL, &device);
        let target = (teacher0.forward(x.clone(), 0).detach() + t1).div_scalar(2.0);
        let loss = mse(student.forward(x, 0), target);
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = opt.step(UNFREEZE_LR, student, grads);
    }
    weights(&student)
}

const ROUTING_STEPS: usize = 4;
const ROUTING_LR: f64 = 1e-2;

/// The head rank `rank` of `ranks` routes its samples through in step `step`; `None`: through no parameter of the
/// model (the last of three or more ranks, in odd steps).
pub fn route(step: usize, rank: usize, ranks: usize) -> Option<usize> {
    let elsewhere = ranks >= 3 && rank == ranks - 1 && step % 2 == 1;
    (!elsewhere).then_some((step + rank) % 2)
}

/// Whether rank `rank` routes its samples past every block in step `step`.
pub fn skips_blocks(step: usize, rank: usize) -> bool {
    (step + rank) % 3 == 1
}

/// Data-dependent routing (DDP's `find_unused_parameters` case): each rank's samples go through one of two heads,
/// chosen by step and rank, on some ranks past no block, and on the last of three or more ranks in odd steps
/// through no parameter of the model at all.
pub fn routing(
    acc: &Accelerator,
    (start, _): &(Stack, Stack),
    blockwise: bool,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let device = acc.device().clone();
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let mut model = acc.prepare_model(start.clone())?;
    let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), ROUTING_LR);
    for step in 0..ROUTING_STEPS {
        let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
        let skip = skips_blocks(step, rank);
        backward(
            acc,
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
    Ok(vec![weights(&acc.unshard(&model)?)])
}

/// [`routing`] by hand on one process: the loss is the mean of the ranks' losses.
pub fn routing_reference((start, _): &(Stack, Stack), ranks: usize) -> Vec<Vec<f32>> {
    let device = Device::default().autodiff();
    let mut model = start.clone();
    let mut opt = AdamConfig::new().init();
    for step in 0..ROUTING_STEPS {
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
        model = opt.step(ROUTING_LR, model, grads);
    }
    weights(&model)
}

/// The rank whose own code fails in [`rank_error`], and the step it fails at.
pub const FAILING_RANK: usize = 1;
const FAILING_STEP: usize = 2;

/// The text of the failing rank's own error.
pub fn own_error() -> String {
    format!("the user's own failure on rank {FAILING_RANK}")
}

/// Training in which rank [`FAILING_RANK`] returns an error of its own at the third step, before its backward
/// pass; the others go on into the step's collectives, and return the error those end with.
pub fn rank_error(
    acc: &Accelerator,
    (start, _): &(Stack, Stack),
    blockwise: bool,
) -> Result<Vec<Vec<f32>>> {
    let device = acc.device().clone();
    let (rank, ranks) = (acc.process_index(), acc.num_processes());
    let mut model = acc.prepare_model(start.clone())?;
    let mut opt = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    for step in 0..4 {
        if rank == FAILING_RANK && step == FAILING_STEP {
            return Err(burn_accelerate::Error::InvalidArgument(own_error()));
        }
        let [x, t1, _] = batch(step, 0, rows(rank, ranks), &device);
        backward(acc, &model, blockwise, &x, Some(0), None, &t1, false)?;
        model = opt.try_step(model)?;
    }
    Ok(weights(&acc.unshard(&model)?))
}
