//! Tensor parallelism against one process, in-process ranks (the same under `mpirun` is
//! `tests/mpi/tensor_parallel_mpi.rs`): the transformer example (`transformer_lm --tp-size`: every layer split the
//! Megatron way, the token embedding by vocabulary, the head by columns) and a pre-norm MLP stack of this file's
//! own, over 2 and 4 tensor-parallel ranks and over 2 × 2 (tensor × data), end with one process's weights: within
//! 1e-6 after 20 SGD steps, within the parity suite's bounds after 20 Adam steps (1e-5; fp16 with global-norm
//! clipping 3.5e-2); with dropout on (and activation checkpointing), the same masks as one process; with sequence
//! and loss parallelism, frozen lower layers, and a sequence the ranks do not divide, the same bounds. Each rank's
//! part of the activations between the regions is one process's rows there, and the vocabulary-parallel loss and its
//! gradient are Burn's on the whole logits. The plan's mistakes are errors before the first step that name the
//! module, its sizes and the fix.

use crate::deep::deterministic;
use crate::examples;
use crate::fixtures::max_abs_diff;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::module::Module;
use burn::nn::{
    DropoutConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig,
    transformer::TransformerEncoderConfig,
};
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Tensor;
use burn_accelerate::tensor_parallel::{
    ParallelLinear, ParallelTransformerLayer, Split, TensorParallelPlan, dropout, region, residual,
    sequence_part,
};
use burn_accelerate::{Accelerator, AcceleratorBuilder, MixedPrecision};

pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-tp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The final weights `transformer_lm` wrote with `args` (every float parameter, whole, little-endian f32), after
/// checking that it trained its 20 steps.
pub(crate) fn lm_weights(dir: &Path, name: &str, args: &[&str]) -> Vec<Vec<f32>> {
    lm_weights_after(dir, name, 20, args)
}

/// [`lm_weights`] after `steps` steps (0: the weights it started from).
pub(crate) fn lm_weights_after(
    dir: &Path,
    name: &str,
    steps: usize,
    args: &[&str],
) -> Vec<Vec<f32>> {
    let path = dir.join(format!("{name}.bin"));
    let out = Command::new(examples::example("transformer_lm"))
        .args(["--steps", &steps.to_string(), "--weights"])
        .arg(&path)
        .args(args)
        .env_remove("ACCELERATE_MIXED_PRECISION")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let trained = steps == 0 || stdout.contains(&format!("step {steps:>3} loss"));
    assert!(
        out.status.success() && stdout.contains("final_loss=") && trained,
        "{args:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&path).unwrap();
    vec![
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    ]
}

/// FSDP2 + TP on 4 in-process ranks: `tp` 2 × `FULL_SHARD` 2.
const TP2_FSDP2: [&str; 6] = [
    "--processes",
    "4",
    "--tp-size",
    "2",
    "--sharding",
    "FULL_SHARD",
];

/// One comparison: its name, the split run's arguments, one process's weights, the bound.
type Case<'a> = (&'a str, Vec<&'a str>, &'a Vec<Vec<f32>>, f32);

#[test]
fn the_transformer_example_split_over_2_and_4_ranks_trains_to_one_process_weights() {
    let dir = scratch("lm");
    let sgd = ["--sgd", "--lr", "0.1"];
    let fp16 = ["--mixed-precision", "fp16", "--clip-norm", "0.5"];
    let dropout = ["--sgd", "--lr", "0.1", "--dropout", "0.1"];
    let one_sgd = lm_weights(&dir, "sgd-1", &sgd);
    let one_adam = lm_weights(&dir, "adam-1", &[]);
    let one_fp16 = lm_weights(&dir, "fp16-1", &fp16);
    let one_dropout = lm_weights(&dir, "dropout-1", &dropout);
    // Frozen lower layers (the usual fine-tuning): the first trained layer's norm is where a gradient enters the
    // first region's cut.
    let frozen = ["--sgd", "--lr", "0.1", "--freeze-bottom", "2"];
    let one_frozen = lm_weights(&dir, "frozen-1", &frozen);
    // Loss parallelism computes the cross-entropy in f32: under fp16 its one-process run is the reference.
    let fp16_lp = [&fp16[..], &["--loss-parallel"]].concat();
    let one_fp16_lp = lm_weights(&dir, "fp16-lp-1", &fp16_lp);
    let sp = ["--sequence-parallel"];
    let sp_lp = ["--sequence-parallel", "--loss-parallel"];
    // Dropout changes the training (so its comparison can fail), and so does fp16.
    assert!(max_abs_diff(&one_sgd, &one_dropout) > 1e-4);
    assert!(max_abs_diff(&one_adam, &one_fp16) > 1e-4);
    for tp in ["2", "4"] {
        let split = ["--processes", tp, "--tp-size", tp];
        let with = |extra: &[&'static str]| -> Vec<&str> { [&split[..], extra].concat() };
        let cases: [Case<'_>; 14] = [
            ("sgd", with(&sgd), &one_sgd, 1e-6),
            ("adam", with(&[]), &one_adam, 1e-5),
            // Loss parallelism: the logits stay split, the cross-entropy combined over the ranks.
            (
                "sgd-loss-parallel",
                with(&[&sgd[..], &["--loss-parallel"]].concat()),
                &one_sgd,
                1e-6,
            ),
            (
                "adam-loss-parallel",
                with(&["--loss-parallel"]),
                &one_adam,
                1e-5,
            ),
            // Sequence parallelism, alone and with loss parallelism.
            ("sgd-sp", with(&[&sgd[..], &sp].concat()), &one_sgd, 1e-6),
            (
                "sgd-sp-lp",
                with(&[&sgd[..], &sp_lp].concat()),
                &one_sgd,
                1e-6,
            ),
            ("adam-sp-lp", with(&sp_lp), &one_adam, 1e-5),
            (
                "fp16-clipped-sp-lp",
                with(&[&fp16_lp[..], &sp].concat()),
                &one_fp16_lp,
                3.5e-2,
            ),
            (
                "dropout-checkpointed-sp",
                with(&[&dropout[..], &["--checkpointing"], &sp].concat()),
                &one_dropout,
                1e-6,
            ),
            ("frozen", with(&frozen), &one_frozen, 1e-6),
            (
                "frozen-sp-lp",
                with(&[&frozen[..], &sp_lp].concat()),
                &one_frozen,
                1e-6,
            ),
            ("fp16-clipped", with(&fp16), &one_fp16, 3.5e-2),
            ("dropout", with(&dropout), &one_dropout, 1e-6),
            (
                "dropout-checkpointed",
                with(&[&dropout[..], &["--checkpointing"]].concat()),
                &one_dropout,
                1e-6,
            ),
        ];
        for (case, args, one, bound) in cases {
            let split = lm_weights(&dir, &format!("{case}-{tp}"), &args);
            let diff = max_abs_diff(one, &split);
            println!("transformer_lm tp {tp} {case}: max |Δ| = {diff:e}");
            assert!(
                diff <= bound,
                "tp {tp} {case}: max |Δ| = {diff:e} > {bound:e}"
            );
        }
    }
    // Tensor × data parallelism: two groups of two, each reading half of every batch.
    // A sequence the ranks do not divide (30 positions over 4: 8, 8, 7, 7).
    let uneven = ["--sgd", "--lr", "0.1", "--seq", "30"];
    let one_uneven = lm_weights(&dir, "uneven-1", &uneven);
    let split = lm_weights(
        &dir,
        "uneven-4-sp",
        &[&uneven[..], &["--processes", "4", "--tp-size", "4"], &sp_lp].concat(),
    );
    let diff = max_abs_diff(&one_uneven, &split);
    println!("transformer_lm tp 4 sgd-sp-lp, 30 positions: max |Δ| = {diff:e}");
    assert!(diff <= 1e-6, "tp 4 on 30 positions: max |Δ| = {diff:e}");
    // FSDP2 + TP: the data dimension shards what the tensor dimension split (SHARD_GRAD_OP: the gradients and
    // the optimizer state only).
    for (case, extra) in [
        ("", &[][..]),
        (" sp lp", &sp_lp[..]),
        (
            " FULL_SHARD sp lp",
            &[
                "--sharding",
                "FULL_SHARD",
                "--sequence-parallel",
                "--loss-parallel",
            ][..],
        ),
        (" SHARD_GRAD_OP", &["--sharding", "SHARD_GRAD_OP"][..]),
    ] {
        let args = [&["--processes", "4", "--tp-size", "2"][..], extra].concat();
        let both = lm_weights(&dir, &format!("adam-2x2{}", case.replace(' ', "-")), &args);
        let diff = max_abs_diff(&one_adam, &both);
        println!("transformer_lm tp 2 × dp 2 adam{case}: max |Δ| = {diff:e}");
        assert!(diff <= 1e-5, "tp 2 × dp 2{case}: max |Δ| = {diff:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A pipeline of tensor-parallel stages on in-process ranks: `pp` 2 × `tp` 2 (4 ranks) with sequence and loss
/// parallelism, and with activation checkpointing, trains to one process's weights (SGD, 1e-6); the model is saved
/// whole from the stages' slices (`--save-model`) and read back on one process.
#[test]
fn a_pipeline_of_tensor_parallel_stages_trains_to_one_process_weights() {
    let dir = scratch("pp-tp");
    let sgd = ["--sgd", "--lr", "0.1"];
    let one = lm_weights(&dir, "sgd-1", &sgd);
    for (case, extra) in [
        ("sp lp", &["--sequence-parallel", "--loss-parallel"][..]),
        (
            "checkpointed, 1f1b",
            &["--checkpointing", "--pp-microbatches", "4"][..],
        ),
    ] {
        let saved = dir.join(format!("model-{}", case.len()));
        let saved_arg = saved.to_str().unwrap();
        let args = [
            &sgd[..],
            &["--processes", "4", "--pp-size", "2", "--tp-size", "2"],
            &["--save-model", saved_arg],
            extra,
        ]
        .concat();
        let out = Command::new(examples::example("transformer_lm"))
            .args(["--steps", "20"])
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("step  20 loss"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let split = lm_weights_after(
            &dir,
            &format!("loaded-{}", case.len()),
            0,
            &["--load-pretrained", saved_arg],
        );
        let diff = max_abs_diff(&one, &split);
        println!("transformer_lm pp 2 × tp 2 {case}: max |Δ| = {diff:e}");
        assert!(diff <= 1e-6, "pp 2 × tp 2 {case}: max |Δ| = {diff:e}");
    }
    // Dropout: a block recomputed by activation checkpointing (its masks drawn again where its forward pass drew
    // them, micro-batches interleaved by 1F1B) trains to the weights of the blocks keeping their activations.
    let dropout = |name: &str, extra: &[&str]| {
        let saved = dir.join(name);
        let saved_arg = saved.to_str().unwrap();
        let args = [
            &sgd[..],
            &[
                "--dropout",
                "0.1",
                "--processes",
                "4",
                "--pp-size",
                "2",
                "--tp-size",
                "2",
            ],
            &["--save-model", saved_arg, "--steps", "10"],
            extra,
        ]
        .concat();
        let out = Command::new(examples::example("transformer_lm"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        lm_weights_after(
            &dir,
            &format!("{name}-loaded"),
            0,
            &["--load-pretrained", saved_arg],
        )
    };
    let kept = dropout("dropout-kept", &[]);
    let recomputed = dropout("dropout-recomputed", &["--checkpointing"]);
    assert!(
        max_abs_diff(&kept, &one) > 1e-4,
        "dropout changes the training"
    );
    assert_eq!(
        max_abs_diff(&kept, &recomputed),
        0.0,
        "pp 2 × tp 2 with dropout: the recomputed blocks drew other masks"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The vocabulary-parallel cross-entropy of each rank's columns of the logits is Burn's `CrossEntropyLoss` of the
/// whole logits, and each rank's gradient its columns of the whole gradient; whole logits on a split group take
/// the plain path.
#[test]
fn the_vocabulary_parallel_cross_entropy_is_the_whole_logits_loss_and_gradient() {
    const ROWS: usize = 6;
    const VOCAB: usize = 8;
    let logits = |device: &burn::tensor::Device| {
        let values: Vec<f32> = (0..ROWS * VOCAB)
            .map(|i| (i as f32 * 0.7).sin() * 3.0)
            .collect();
        Tensor::<1>::from_floats(values.as_slice(), device).reshape([ROWS, VOCAB])
    };
    // Targets on every rank's range, at the rows' maxima and elsewhere.
    let targets = |device: &burn::tensor::Device| {
        Tensor::<1, burn::tensor::Int>::from_ints([0, 7, 3, 4, 1, 6], device)
    };
    let v = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let device = burn::tensor::Device::default().autodiff();
    let whole = logits(&device).require_grad();
    let burn_loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&device)
        .forward(whole.clone(), targets(&device));
    let grads = burn_loss.backward();
    let whole_grad = v(whole.grad(&grads).unwrap());
    let burn_loss = burn_loss.into_scalar::<f32>();
    for tp in [2, 4] {
        let got = Accelerator::builder()
            .tp_size(tp)
            .launch(tp, move |acc| {
                let (rank, ranks) = burn_accelerate::tensor_parallel::tp_rank_and_size();
                let width = VOCAB / ranks;
                let mine = logits(acc.device())
                    .slice([0..ROWS, rank * width..(rank + 1) * width])
                    .require_grad();
                let loss = burn_accelerate::tensor_parallel::cross_entropy(
                    mine.clone(),
                    targets(acc.device()),
                    VOCAB,
                );
                let grads = loss.backward();
                let whole_on_split = burn_accelerate::tensor_parallel::cross_entropy(
                    logits(acc.device()),
                    targets(acc.device()),
                    VOCAB,
                );
                Ok((
                    loss.into_scalar::<f32>(),
                    v(mine.grad(&grads).unwrap()),
                    whole_on_split.into_scalar::<f32>(),
                ))
            })
            .unwrap();
        for (rank, (loss, grad, plain)) in got.into_iter().enumerate() {
            assert!(
                (loss - burn_loss).abs() < 1e-6,
                "tp {tp} rank {rank}: {loss} against {burn_loss}"
            );
            assert!(
                (plain - burn_loss).abs() < 1e-6,
                "tp {tp} rank {rank}: whole logits {plain}"
            );
            let width = VOCAB / tp;
            let expected: Vec<f32> = whole_grad
                .chunks(VOCAB)
                .flat_map(|row| row[rank * width..(rank + 1) * width].to_vec())
                .collect();
            let diff = max_abs_diff(&[expected], &[grad]);
            assert!(diff < 1e-6, "tp {tp} rank {rank}: gradient off by {diff:e}");
        }
    }
}

/// A pre-norm MLP stack: an input layer, blocks `x + down(gelu(up(norm(x))))`, a head.
#[derive(Module, Debug)]
struct Stack {
    input: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

#[derive(Module, Debug)]
struct Block {
    norm: LayerNorm,
    up: ParallelLinear,
    down: ParallelLinear,
}

const WIDTH: usize = 8;
const HIDDEN: usize = 32;
const ROWS: usize = 16;
const STEPS: usize = 20;

impl Stack {
    fn new(device: &burn::tensor::Device) -> Self {
        deterministic(Self {
            input: LinearConfig::new(6, WIDTH).init(device),
            blocks: (0..3)
                .map(|_| Block {
                    norm: LayerNormConfig::new(WIDTH).init(device),
                    up: LinearConfig::new(WIDTH, HIDDEN).init(device).into(),
                    down: LinearConfig::new(HIDDEN, WIDTH).init(device).into(),
                })
                .collect(),
            head: LinearConfig::new(WIDTH, 1).init(device),
        })
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.hidden(x);
        // A region of whole layers: under sequence parallelism its input gathered, its output whole with this
        // rank's rows' gradient.
        region(h, |h| self.head.forward(h))
    }

    /// The last block's output.
    fn hidden(&self, x: Tensor<2>) -> Tensor<2> {
        // Under sequence parallelism each rank holds its part of the rows between the regions.
        let mut h = sequence_part(self.input.forward(x));
        for b in &self.blocks {
            // The norm whole on every rank, then the region: `up` by columns, `down` by rows.
            h = residual(
                h,
                |h| b.norm.forward(h),
                |h| {
                    b.down
                        .forward(burn::tensor::activation::gelu(b.up.forward(h)))
                },
            );
        }
        h
    }

    fn plan() -> TensorParallelPlan {
        TensorParallelPlan::new()
            .split("blocks.*.up", Split::Columns)
            .split("blocks.*.down", Split::Rows)
    }
}

#[derive(Clone, Copy, Debug)]
enum Optimizer {
    Sgd,
    Adam,
}

/// The stack's whole weights after training on `ranks` ranks of which groups of `tp` split it, with `builder`'s
/// settings (mixed precision) and, with `clip`, global-norm clipping.
fn train_stack(
    builder: AcceleratorBuilder,
    ranks: usize,
    tp: usize,
    optimizer: Optimizer,
    clip: Option<f64>,
) -> Vec<Vec<f32>> {
    let weights = builder
        .tp_size(tp)
        .launch(ranks, move |acc| {
            let model = acc.prepare_tensor_parallel(Stack::new(acc.device()), &Stack::plan())?;
            let mut model = model;
            let mut opt = match optimizer {
                Optimizer::Sgd => acc.prepare_optimizer(SgdConfig::new().init(), 0.05),
                Optimizer::Adam => acc.prepare_optimizer(AdamConfig::new().init(), 1e-2),
            };
            let layout = acc.pipeline_layout();
            let rows = ROWS / layout.replicas;
            for step in 0..STEPS {
                let (x, y) =
                    crate::deep::batch(step * ROWS + layout.replica * rows, rows, acc.device());
                let loss = acc.autocast(&model, x, |m, x| m.forward(x));
                let loss = (loss - y).powi_scalar(2).mean();
                acc.backward(loss, &model)?;
                if let Some(max_norm) = clip {
                    acc.clip_grad_norm(&model, max_norm)?;
                }
                model = opt.try_step(model)?;
            }
            Ok(crate::deep::params(&acc.unshard(&model)?))
        })
        .unwrap();
    // Every rank ends with the same whole model.
    for w in &weights[1..] {
        assert_eq!(max_abs_diff(&weights[0], w), 0.0);
    }
    weights.into_iter().next().unwrap()
}

#[test]
fn a_pre_norm_mlp_stack_of_ones_own_split_by_a_plan_trains_to_one_process_weights() {
    let b = Accelerator::builder;
    let fp16 = || b().mixed_precision(MixedPrecision::Fp16);
    for (optimizer, bound) in [(Optimizer::Sgd, 1e-6), (Optimizer::Adam, 1e-5)] {
        let one = train_stack(b(), 1, 1, optimizer, None);
        let untrained = crate::deep::params(&Stack::new(&Default::default()));
        assert!(max_abs_diff(&one, &untrained) > 1e-3, "the stack trains");
        for (ranks, tp) in [(2, 2), (4, 4), (4, 2)] {
            for sequence in [false, true] {
                let split =
                    train_stack(b().sequence_parallel(sequence), ranks, tp, optimizer, None);
                let diff = max_abs_diff(&one, &split);
                println!(
                    "stack {optimizer:?} on {ranks} ranks, tp {tp}, sequence parallel {sequence}: max |Δ| = \
                     {diff:e}"
                );
                assert!(
                    diff <= bound,
                    "{optimizer:?} {ranks} ranks tp {tp} sequence parallel {sequence}: max |Δ| = {diff:e}"
                );
            }
        }
    }
    // fp16 with the loss scaled and the global norm clipped: the norm sums each rank's slices once and the whole
    // parameters once.
    let one = train_stack(fp16(), 1, 1, Optimizer::Adam, Some(0.05));
    for tp in [2, 4] {
        let split = train_stack(
            fp16().sequence_parallel(true),
            tp,
            tp,
            Optimizer::Adam,
            Some(0.05),
        );
        let diff = max_abs_diff(&one, &split);
        println!("stack fp16 clipped, tp {tp}, sequence parallel: max |Δ| = {diff:e}");
        assert!(
            diff <= 3.5e-2,
            "fp16 tp {tp} sequence parallel: max |Δ| = {diff:e}"
        );
        let split = train_stack(fp16(), tp, tp, Optimizer::Adam, Some(0.05));
        let diff = max_abs_diff(&one, &split);
        println!("stack fp16 clipped, tp {tp}: max |Δ| = {diff:e}");
        assert!(diff <= 3.5e-2, "fp16 tp {tp}: max |Δ| = {diff:e}");
    }
    let unclipped = train_stack(fp16(), 1, 1, Optimizer::Adam, None);
    assert!(max_abs_diff(&one, &unclipped) > 1e-4, "clipping bites");
}

/// Under sequence parallelism each rank holds its part of the rows between the regions (10 rows over 4 ranks: 3,
/// 3, 2, 2), the parts of one process's activations; the head's output is whole on every rank.
#[test]
fn under_sequence_parallelism_each_rank_holds_its_part_of_the_activations_between_regions() {
    let rows = 10;
    let run = |tp: usize| {
        Accelerator::builder()
            .tp_size(tp)
            .sequence_parallel(true)
            .launch(tp, move |acc| {
                let model =
                    acc.prepare_tensor_parallel(Stack::new(acc.device()), &Stack::plan())?;
                let (x, _) = crate::deep::batch(0, rows, acc.device());
                let v = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
                let hidden = model.hidden(x.clone());
                Ok((hidden.dims()[0], v(hidden), v(model.forward(x))))
            })
            .unwrap()
    };
    let one = run(1).remove(0);
    assert_eq!(one.0, rows);
    let parts = run(4);
    let held: Vec<usize> = parts.iter().map(|p| p.0).collect();
    assert_eq!(held, [3, 3, 2, 2], "each rank's rows between the regions");
    let joined: Vec<f32> = parts.iter().flat_map(|p| p.1.clone()).collect();
    let diff = max_abs_diff(&[one.1], &[joined]);
    assert!(
        diff < 1e-5,
        "the parts are one process's rows: max |Δ| = {diff:e}"
    );
    for p in &parts {
        let diff = max_abs_diff(std::slice::from_ref(&one.2), std::slice::from_ref(&p.2));
        assert!(
            diff < 1e-5,
            "the head's output is whole: max |Δ| = {diff:e}"
        );
    }
}

/// The dropout masks of a tensor-parallel group: where the model is whole every rank draws one process's mask;
/// where it is split (a head range, a block of columns) each rank draws its own slice of one process's mask.
#[test]
fn dropout_draws_one_process_masks_whole_and_each_ranks_slice_where_split() {
    fn masks(acc: &Accelerator) -> (Vec<f32>, Vec<f32>) {
        acc.set_seed(7, false);
        let drop = DropoutConfig::new(0.5).init();
        let (rank, ranks) = burn_accelerate::tensor_parallel::tp_rank_and_size();
        let whole = dropout(&drop, Tensor::<2>::ones([4, 16], acc.device()), None);
        let cols = 16 / ranks;
        let split = dropout(
            &drop,
            Tensor::<2>::ones([4, cols], acc.device()),
            Some((1, rank * cols, 16)),
        );
        let v = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        (v(whole), v(split))
    }
    let one = Accelerator::builder()
        .launch(1, |acc| Ok(masks(&acc)))
        .unwrap()
        .remove(0);
    assert!(one.0.contains(&0.0) && one.0.contains(&2.0), "{:?}", one.0);
    let split = Accelerator::builder()
        .tp_size(2)
        .launch(2, |acc| Ok(masks(&acc)))
        .unwrap();
    for (rank, (whole, part)) in split.iter().enumerate() {
        assert_eq!(whole, &one.0, "rank {rank}'s mask where the model is whole");
        let expected: Vec<f32> = one
            .1
            .chunks(16)
            .flat_map(|row| row[rank * 8..rank * 8 + 8].to_vec())
            .collect();
        assert_eq!(part, &expected, "rank {rank}'s columns of the split mask");
    }
    assert_ne!(split[0].1, split[1].1, "each rank draws its own slice");
}

#[test]
fn a_plan_that_does_not_fit_the_model_says_so_before_the_first_step() {
    let errors = Accelerator::builder()
        .tp_size(2)
        .launch(2, |acc| {
            let device = acc.device().clone();
            let layer = || {
                ParallelTransformerLayer::new(&TransformerEncoderConfig::new(12, 24, 3, 1), &device)
            };
            let err = |r: burn_accelerate::Result<_>| r.map(|_: ()| ()).unwrap_err().to_string();
            let stack = || Stack::new(&device);
            Ok(vec![
                err(acc
                    .prepare_tensor_parallel(
                        stack(),
                        &Stack::plan().split("blocks.*.upp", Split::Columns),
                    )
                    .map(|_| ())),
                err(acc
                    .prepare_tensor_parallel(stack(), &Stack::plan().split("input", Split::Columns))
                    .map(|_| ())),
                err(acc
                    .prepare_tensor_parallel(stack(), &Stack::plan().split("blocks.0", Split::Rows))
                    .map(|_| ())),
                err(acc
                    .prepare_tensor_parallel(
                        ParallelTransformerLayer::new(
                            &TransformerEncoderConfig::new(8, 16, 2, 1),
                            &device,
                        ),
                        &TensorParallelPlan::megatron()
                            .split("pwff.linear_outer", Split::Replicated),
                    )
                    .map(|_| ())),
                // 3 heads over 2 ranks.
                err(acc
                    .prepare_tensor_parallel(layer(), &TensorParallelPlan::megatron())
                    .map(|_| ())),
                err(acc.prepare_model(stack()).map(|_| ())),
            ])
        })
        .unwrap();
    let expected: [&[&str]; 6] = [
        &["`blocks.*.upp`", "names no module", "blocks.0.up"],
        &[
            "`input` is a Linear",
            "ParallelLinear::from(linear)",
            "the same record",
        ],
        &["`blocks.0` is a Block", "splits a ParallelLinear only"],
        &[
            "ParallelFeedForward `pwff`",
            "split on some of its layers only",
            "linear_inner: columns, linear_outer: replicated",
        ],
        &["3 heads", "tp_size 2", "does not divide"],
        &["prepare_tensor_parallel(model, &plan)"],
    ];
    for errors in &errors {
        for (err, words) in errors.iter().zip(expected) {
            for w in words {
                assert!(err.contains(w), "`{w}` in: {err}");
            }
        }
    }
    // A size the ranks do not divide, named with the parameter's shape.
    let err = Accelerator::builder()
        .tp_size(3)
        .launch(3, |acc| {
            acc.prepare_tensor_parallel(Stack::new(acc.device()), &Stack::plan())
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`blocks.0.up.weight` [8, 32]")
            && err.contains("does not divide its 32 output features"),
        "{err}"
    );
    // Under a pipeline each stage keeps its blocks: a model of blocks is prepared for it.
    let err = Accelerator::builder()
        .tp_size(2)
        .pp_size(2)
        .launch(4, |acc| {
            acc.prepare_tensor_parallel(Stack::new(acc.device()), &Stack::plan())
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("prepare_tensor_parallel_blocks"), "{err}");
}

#[test]
fn a_split_layer_outside_a_region_fails_the_backward_pass_naming_it() {
    let errors = Accelerator::builder()
        .tp_size(2)
        .launch(2, |acc| {
            let model = acc.prepare_tensor_parallel(Stack::new(acc.device()), &Stack::plan())?;
            let (x, _) = crate::deep::batch(0, 4, acc.device());
            // `up` without `residual` around it: its input's gradient would miss the other rank's part.
            let h = model.input.forward(x);
            let y = model.blocks[0].down.forward(model.blocks[0].up.forward(h));
            Ok(acc.backward(y.sum(), &model).unwrap_err().to_string())
        })
        .unwrap();
    for err in errors {
        assert!(
            err.contains(
                "ParallelLinear [8 x 32] split by Columns ran outside a tensor-parallel region"
            ) && err.contains("tensor_parallel::residual"),
            "{err}"
        );
    }
}

/// A prepared dataloader under tensor × data parallelism: the two ranks of a tensor-parallel group read the same
/// batches, in the same shuffled order; the two groups read different ones, between them every sample once.
#[test]
fn a_prepared_dataloader_shards_by_the_data_parallel_index() {
    use burn::data::dataset::Dataset;
    use burn_accelerate::data::DataLoaderBuilder;
    let seen = Accelerator::builder()
        .tp_size(2)
        .launch(4, |acc| {
            let loader = acc.prepare_dataloader(
                DataLoaderBuilder::new(crate::mlp::SampleBatcher)
                    .batch_size(4)
                    .shuffle(11)
                    .build(crate::mlp::dataset(32, 3)),
            )?;
            let mut rows = Vec::new();
            for batch in loader.iter() {
                rows.extend(
                    batch?
                        .y
                        .into_data()
                        .convert::<f32>()
                        .try_to_vec::<f32>()
                        .unwrap(),
                );
            }
            Ok(rows)
        })
        .unwrap();
    assert_eq!(
        seen[0], seen[1],
        "one tensor-parallel group reads the same batches"
    );
    assert_eq!(seen[2], seen[3]);
    assert_ne!(
        seen[0], seen[2],
        "the data-parallel ranks read different ones"
    );
    let mut all: Vec<u32> = seen[0]
        .iter()
        .chain(&seen[2])
        .map(|v| v.to_bits())
        .collect();
    let mut one: Vec<u32> = crate::mlp::dataset(32, 3)
        .iter()
        .map(|s| s.unwrap().y.to_bits())
        .collect();
    all.sort_unstable();
    one.sort_unstable();
    assert_eq!(all, one, "every sample once");
}

/// `save_model` under tensor parallelism (with sequence parallelism) writes one file of the whole model in
/// PyTorch's layout, each split parameter gathered from the group as it is written; the file loads on one process
/// (whole) and on 4 tensor-parallel ranks (each its slices) to the trained weights, bit for bit. So does one saved
/// under `tp` 2 × `FULL_SHARD` 2, loaded on one process and on `tp` 2 × `FULL_SHARD` 2.
#[test]
fn a_model_saved_under_tensor_parallelism_loads_on_one_process_and_on_another_tp_size() {
    let dir = scratch("save");
    let saved = dir.join("model");
    let run = |name: &str, steps: usize, args: &[&str]| {
        lm_weights_after(
            &dir,
            name,
            steps,
            &[&["--sgd", "--lr", "0.1"], args].concat(),
        )
    };
    let saved_arg = saved.to_str().unwrap();
    let trained = run(
        "tp2",
        10,
        &[
            "--processes",
            "2",
            "--tp-size",
            "2",
            "--sequence-parallel",
            "--save-model",
            saved_arg,
        ],
    );
    assert!(saved.join("model.safetensors").exists());
    let whole = run("one", 0, &["--load-pretrained", saved_arg]);
    assert_eq!(
        max_abs_diff(&trained, &whole),
        0.0,
        "loaded whole on one process"
    );
    let split = run(
        "tp4",
        0,
        &[
            "--processes",
            "4",
            "--tp-size",
            "4",
            "--load-pretrained",
            saved_arg,
        ],
    );
    assert_eq!(
        max_abs_diff(&trained, &split),
        0.0,
        "loaded in slices on tp 4"
    );
    // FSDP2 + TP: saved with each tensor-parallel part joined from its data-parallel slices, loaded with each rank
    // reading its rows of its part (of rows, or of columns).
    let fsdp = dir.join("fsdp-model");
    let fsdp_arg = fsdp.to_str().unwrap();
    let tp_fsdp = TP2_FSDP2;
    let trained = run(
        "tp2-fsdp2",
        10,
        &[&tp_fsdp[..], &["--save-model", fsdp_arg]].concat(),
    );
    for (case, args) in [
        ("one process", &[][..]),
        ("tp 2 × FULL_SHARD 2", &tp_fsdp[..]),
    ] {
        let loaded = run(
            &format!("tp2-fsdp2-on-{}", args.len()),
            0,
            &[args, &["--load-pretrained", fsdp_arg]].concat(),
        );
        assert_eq!(
            max_abs_diff(&trained, &loaded),
            0.0,
            "saved by tp 2 × FULL_SHARD 2, loaded on {case}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A training state saved on `tp` 2 × `dp` 2 (each rank its slices and their Adam moments; the manifest lists each
/// split and its dimension) resumes on one process, on `tp` 4 and on `tp` 2 with sequence parallelism, and one
/// saved on one process resumes on `tp` 2; one saved on `tp` 2 × `FULL_SHARD` 2 (each part sliced again: 2-D splits)
/// resumes on one process and on `FULL_SHARD` 4, and one process's on `tp` 2 × `FULL_SHARD` 2: every rank re-cuts
/// its slices from the saved files, and the 20 steps end
/// within the parity bound of a straight run (Adam, 1e-5).
#[test]
fn a_state_saved_under_tensor_parallelism_resumes_on_another_tp_size_and_number_of_ranks() {
    let dir = scratch("state");
    let straight = lm_weights(&dir, "straight", &[]);
    let save = |name: &str, args: &[&str]| {
        let state = dir.join(name);
        let state_arg = state.to_str().unwrap();
        lm_weights_after(
            &dir,
            &format!("{name}-first"),
            10,
            &[&["--state", state_arg, "--save-at", "10"], args].concat(),
        );
        state
    };
    let tp2x2 = save("tp2x2", &["--processes", "4", "--tp-size", "2"]);
    let one = save("one", &[]);
    // FSDP2 + TP: each rank's file holds its rows of its tensor-parallel part (a 2-D split in the manifest).
    let tp_fsdp = TP2_FSDP2;
    let tp2_fsdp2 = save("tp2-fsdp2", &tp_fsdp);
    let cases: [(&str, &Path, &[&str]); 7] = [
        ("tp2 × FULL_SHARD 2 on one process", &tp2_fsdp2, &[]),
        (
            "tp2 × FULL_SHARD 2 on FULL_SHARD 4",
            &tp2_fsdp2,
            &["--processes", "4", "--sharding", "FULL_SHARD"],
        ),
        ("one process on tp 2 × FULL_SHARD 2", &one, &tp_fsdp),
        ("tp2x2 on one process", &tp2x2, &[]),
        (
            "tp2x2 on tp 4",
            &tp2x2,
            &["--processes", "4", "--tp-size", "4"],
        ),
        (
            "tp2x2 on tp 2 with sequence parallelism",
            &tp2x2,
            &["--processes", "2", "--tp-size", "2", "--sequence-parallel"],
        ),
        (
            "one process on tp 2",
            &one,
            &["--processes", "2", "--tp-size", "2"],
        ),
    ];
    for (i, (case, state, args)) in cases.into_iter().enumerate() {
        let state_arg = state.to_str().unwrap();
        let resumed = lm_weights(
            &dir,
            &format!("resumed-{i}"),
            &[&["--state", state_arg, "--resume"], args].concat(),
        );
        let diff = max_abs_diff(&straight, &resumed);
        println!("transformer_lm resumed, {case}: max |Δ| = {diff:e}");
        assert!(diff <= 1e-5, "{case}: max |Δ| = {diff:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
