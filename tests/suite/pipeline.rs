//! Pipeline parallelism (`Accelerator::backward_batch` with `pp_size` > 1): 2 and 4 in-process stages, 1, 2, 4
//! and 8 micro-batches, GPipe and 1F1B, train 20 Adam steps to the same bits as one process accumulating the
//! same micro-batches in the same order; with accumulation across batches too, and with global-norm clipping
//! within float rounding; 2 stages × 2 data-parallel replicas match one process on the whole batch; each stage
//! holds only its own blocks; a save and resume equals a run straight through. The same under `mpirun` is in
//! `tests/mpi/parity_mpi.rs`.

use crate::deep;

use burn::nn::LinearConfig;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use deep::{Deep, WIDTH, batch, params};

use burn_accelerate::{
    AcceleratedOptimizer, Accelerator, AcceleratorBuilder, MixedPrecision, PipelineSchedule,
    Result, ShardingStrategy, Split, StateToSave,
};

/// Rows of a global batch.
const BATCH: usize = 16;
const LAYERS: usize = 8;

fn model(device: &Device) -> Deep {
    deep::model(LAYERS, device)
}

/// The loss of a micro-batch: the summed squared error over the rows of a whole micro-batch.
fn loss(out: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    let rows = y.dims()[0] as f32;
    (out - y).powi_scalar(2).sum().div_scalar(rows)
}

#[derive(Clone, Copy, Debug)]
struct Run {
    stages: usize,
    replicas: usize,
    micro_batches: usize,
    schedule: PipelineSchedule,
    accumulation: usize,
    clip: bool,
    sharding: ShardingStrategy,
    steps: usize,
    /// fp16 loss scaling.
    fp16: bool,
    /// The head also uses the input layer's weight (a tied embedding and head: on the first and the last stage).
    tied: bool,
    /// Ranks per shard group of a hybrid strategy inside each stage.
    shard_size: Option<usize>,
    /// Activation checkpointing.
    checkpoint: bool,
}

impl Run {
    fn new(stages: usize, micro_batches: usize, schedule: PipelineSchedule) -> Self {
        Self {
            stages,
            replicas: 1,
            micro_batches,
            schedule,
            accumulation: 1,
            clip: false,
            sharding: ShardingStrategy::NoShard,
            steps: 20,
            fp16: false,
            tied: false,
            shard_size: None,
            checkpoint: false,
        }
    }

    fn builder(&self) -> AcceleratorBuilder {
        let builder = Accelerator::builder()
            .pp_size(self.stages)
            .pp_microbatches(self.micro_batches)
            .pp_schedule(self.schedule)
            .gradient_accumulation_steps(self.accumulation)
            .activation_checkpointing(self.checkpoint)
            .sharding(self.sharding);
        let builder = match self.shard_size {
            Some(size) => builder.dp_shard_size(size),
            None => builder,
        };
        self.precision(builder)
    }

    fn precision(&self, builder: AcceleratorBuilder) -> AcceleratorBuilder {
        match self.fp16 {
            true => builder.mixed_precision(MixedPrecision::Fp16),
            false => builder,
        }
    }

    /// The head and the loss.
    fn after(&self, m: &Deep, h: Tensor<2>, y: &Tensor<2>) -> Tensor<1> {
        let h = match self.tied {
            true => {
                let w = m.input.weight.val();
                h.matmul(w.clone().transpose()).tanh().matmul(w)
            }
            false => h,
        };
        loss(m.head.forward(h), y.clone())
    }
}

/// Trains `run.steps` batches through the pipeline from batch `from`.
fn train(
    acc: &Accelerator,
    run: &Run,
    mut model: Deep,
    optimizer: &mut AcceleratedOptimizer,
    from: usize,
) -> Result<(Deep, Vec<f32>)> {
    let layout = acc.pipeline_layout();
    let rows = BATCH / layout.replicas;
    let device = acc.device().clone();
    let mut losses = Vec::new();
    for step in from..from + run.steps {
        let data = batch(step * BATCH + layout.replica * rows, rows, &device);
        acc.accumulate();
        let value = acc.backward_batch(
            &model,
            data,
            |m, (x, _)| m.input.forward(x.clone()).tanh(),
            |layer, h| layer.forward(h).tanh(),
            |m, h, (_, y)| run.after(m, h, y),
        )?;
        losses.push(value.into_scalar::<f32>());
        if acc.sync_gradients() && run.clip {
            acc.clip_grad_norm(&model, 0.05)?;
        }
        model = optimizer.try_step(model)?;
    }
    Ok((model, losses))
}

/// Every rank's parameters after the run, and the losses rank 0 saw.
fn pipelined(run: Run) -> (Vec<Vec<Vec<f32>>>, Vec<f32>) {
    let out = run
        .builder()
        .launch(run.stages * run.replicas, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let (model, losses) = train(&acc, &run, model, &mut optimizer, 0)?;
            // Under FULL_SHARD a stage's ranks hold slices: gathered within the stage.
            Ok((params(&acc.unshard(&model)?), losses))
        })
        .unwrap_or_else(|e| panic!("{run:?}: {e}"));
    let losses = out[0].1.clone();
    (out.into_iter().map(|(p, _)| p).collect(), losses)
}

/// The whole model's parameters from the ranks of replica 0 of a pipelined run: each block from the stage that
/// runs it, the input layer from the first stage, the head from the last.
fn merged(ranks: &[Vec<Vec<f32>>], stages: usize, replicas: usize) -> Vec<Vec<f32>> {
    let stage = |s: usize| &ranks[s * replicas];
    let count = ranks[0].len();
    (0..count)
        .map(|j| {
            if j < 2 {
                stage(0)[j].clone()
            } else if j >= count - 2 {
                stage(stages - 1)[j].clone()
            } else {
                let owners: Vec<&Vec<f32>> = (0..stages)
                    .map(|s| &stage(s)[j])
                    .filter(|v| !v.is_empty())
                    .collect();
                assert_eq!(owners.len(), 1, "parameter {j} is held by one stage");
                owners[0].clone()
            }
        })
        .collect()
}

/// Every replica of every stage holds the weights of its stage's replica 0, bit for bit: each parameter the stage
/// trains (its blocks; the input layer on the first stage, the head on the last), all of them compared.
fn replicas_agree(ranks: &[Vec<Vec<f32>>], stages: usize, replicas: usize, what: &str) {
    let count = ranks[0].len();
    for stage in 0..stages {
        let first = &ranks[stage * replicas];
        let trained: Vec<usize> = (0..count)
            .filter(|&j| match j {
                0 | 1 => stage == 0,
                _ if j + 2 >= count => stage + 1 == stages,
                _ => !first[j].is_empty(),
            })
            .collect();
        assert!(!trained.is_empty(), "{what}: stage {stage} trains nothing");
        for replica in 1..replicas {
            let other = &ranks[stage * replicas + replica];
            for &j in &trained {
                assert_eq!(
                    first[j], other[j],
                    "{what}: stage {stage}, replica {replica}, parameter {j}"
                );
            }
        }
    }
}

/// The replica check sees a replica that differs in any stage's parameters, the last stage's included, and
/// passes replicas that agree: every stage's parameters are compared, not only the first stage's.
#[test]
fn the_replica_check_fails_on_a_replica_of_any_stage_that_differs() {
    // Two stages of two replicas; parameters 0 and 1 are the first stage's `before`, 2 its block, 3 the second
    // stage's block, 4 and 5 its head. A stage holds nothing of the other's blocks (empty).
    let stage = |s: usize| -> Vec<Vec<f32>> {
        (0..6)
            .map(|j| match (j, s) {
                (0..=2, 0) | (3..=5, 1) => vec![j as f32, 0.5],
                _ => Vec::new(),
            })
            .collect()
    };
    let agreeing = vec![stage(0), stage(0), stage(1), stage(1)];
    replicas_agree(&agreeing, 2, 2, "agreeing replicas");
    for (rank, j) in [(1, 0), (1, 2), (3, 3), (3, 5)] {
        let mut broken = agreeing.clone();
        broken[rank][j][1] += 1e-3;
        let caught = std::panic::catch_unwind(|| replicas_agree(&broken, 2, 2, "broken"));
        assert!(
            caught.is_err(),
            "rank {rank}'s parameter {j} differs from its stage's first replica, and the check passed"
        );
    }
}

/// One process accumulating the same micro-batches in the same order, `accumulation` batches per step.
fn reference(run: Run) -> (Vec<Vec<f32>>, Vec<f32>) {
    let rows = BATCH;
    run.precision(Accelerator::builder())
        .gradient_accumulation_steps(run.micro_batches * run.accumulation)
        .launch(1, |acc| {
            let device = acc.device().clone();
            let mut model = acc.prepare_model(model(&device))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let mut losses = Vec::new();
            for step in 0..run.steps {
                let parts = batch(step * BATCH, rows, &device).micro_batches(run.micro_batches)?;
                let mut sum = 0.0;
                for (x, y) in parts {
                    acc.accumulate();
                    let value = acc.backward_blocks(
                        &model,
                        |m| m.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h| run.after(m, h, &y),
                    )?;
                    sum += value.into_scalar::<f32>();
                    if acc.sync_gradients() && run.clip {
                        acc.clip_grad_norm(&model, 0.05)?;
                    }
                    model = optimizer.try_step(model)?;
                }
                losses.push(sum / run.micro_batches as f32);
            }
            Ok((params(&model), losses))
        })
        .unwrap()
        .remove(0)
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
fn stages_train_the_bits_of_one_process_accumulating_the_same_micro_batches() {
    for stages in [2, 4] {
        for micro_batches in [1, 2, 4, 8] {
            let expected = reference(Run::new(stages, micro_batches, PipelineSchedule::GPipe));
            for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
                let run = Run::new(stages, micro_batches, schedule);
                let (ranks, losses) = pipelined(run);
                let got = merged(&ranks, stages, 1);
                assert_eq!(
                    max_diff(&got, &expected.0),
                    0.0,
                    "{run:?}: the stages' weights differ from one process's"
                );
                assert_eq!(got, expected.0, "{run:?}");
                let loss_diff = losses
                    .iter()
                    .zip(&expected.1)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(
                    loss_diff < 1e-5,
                    "{run:?}: losses {losses:?} vs {:?}",
                    expected.1
                );
                assert!(losses[19] < losses[0], "{run:?}: {losses:?}");
            }
        }
    }
}

#[test]
fn accumulation_across_batches_keeps_the_bits_and_clipping_spans_the_stages() {
    let mut run = Run::new(2, 4, PipelineSchedule::OneFOneB);
    run.accumulation = 2;
    run.steps = 12;
    let (ranks, _) = pipelined(run);
    let expected = reference(run);
    assert_eq!(merged(&ranks, 2, 1), expected.0, "{run:?}");

    let mut run = Run::new(4, 4, PipelineSchedule::OneFOneB);
    run.clip = true;
    let (ranks, _) = pipelined(run);
    let expected = reference(run);
    let diff = max_diff(&merged(&ranks, 4, 1), &expected.0);
    assert!(diff < 1e-5, "{run:?}: clipped weights differ by {diff}");
    let mut unclipped = run;
    unclipped.clip = false;
    let (free, _) = pipelined(unclipped);
    assert!(
        max_diff(&merged(&free, 4, 1), &expected.0) > 1e-3,
        "clipping at 0.05 changes the weights"
    );
}

#[test]
fn fp16_loss_scaling_keeps_the_bits_and_a_tied_embedding_and_head_stay_in_sync() {
    let mut run = Run::new(2, 4, PipelineSchedule::OneFOneB);
    run.fp16 = true;
    let (ranks, _) = pipelined(run);
    assert_eq!(merged(&ranks, 2, 1), reference(run).0, "{run:?}");

    for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
        let mut run = Run::new(4, 2, schedule);
        run.tied = true;
        let (ranks, _) = pipelined(run);
        assert_eq!(
            ranks[0][0], ranks[3][0],
            "{run:?}: the first and the last stage hold the same tied weight"
        );
        let diff = max_diff(&merged(&ranks, 4, 1), &reference(run).0);
        assert!(diff < 1e-5, "{run:?}: {diff}");
    }
    // Clipped: the tied weight's gradient counts once in the norm that spans the stages.
    let mut run = Run::new(4, 2, PipelineSchedule::OneFOneB);
    run.tied = true;
    run.clip = true;
    let (ranks, _) = pipelined(run);
    assert_eq!(ranks[0][0], ranks[3][0], "{run:?}");
    let diff = max_diff(&merged(&ranks, 4, 1), &reference(run).0);
    assert!(diff < 1e-5, "{run:?}: {diff}");
}

#[test]
fn evaluation_runs_forward_through_the_stages_and_every_rank_gets_the_outputs() {
    let device = Device::default();
    let data = batch(0, BATCH, &device);
    let plain = {
        let m = model(&device);
        let mut h = m.input.forward(data.0.clone()).tanh();
        for layer in &m.layers {
            h = layer.forward(h).tanh();
        }
        m.head.forward(h).reshape([BATCH])
    }
    .into_data()
    .try_to_vec::<f32>()
    .unwrap();
    for (stages, replicas) in [(2, 1), (4, 1), (2, 2)] {
        let run = Run::new(stages, 4, PipelineSchedule::OneFOneB);
        let outputs = run
            .builder()
            .launch(stages * replicas, |acc| {
                let model = acc.prepare_blocks(model(acc.device()))?;
                let layout = acc.pipeline_layout();
                let rows = BATCH / layout.replicas;
                let data = batch(layout.replica * rows, rows, acc.device());
                let out = acc.forward_batch(
                    &model,
                    data,
                    |m, (x, _)| m.input.forward(x.clone()).tanh(),
                    |layer, h| layer.forward(h).tanh(),
                    |m, h, _| {
                        let rows = h.dims()[0];
                        m.head.forward(h).reshape([rows])
                    },
                )?;
                let all = acc.gather_for_metrics(out)?;
                Ok(all.into_data().try_to_vec::<f32>().unwrap())
            })
            .unwrap();
        for (rank, values) in outputs.iter().enumerate() {
            assert_eq!(values.len(), BATCH, "pp {stages} × {replicas}, rank {rank}");
            let diff = values
                .iter()
                .zip(&plain)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-6, "pp {stages} × {replicas}, rank {rank}: {diff}");
        }
    }
}

#[test]
fn save_blocks_writes_one_file_of_the_whole_model_from_every_stage() {
    for (stages, tied) in [(2, false), (4, true)] {
        let mut run = Run::new(stages, 2, PipelineSchedule::OneFOneB);
        run.steps = 5;
        run.tied = tied;
        let dir = std::env::temp_dir().join(format!("pipeline-save-{stages}"));
        let trained = run
            .builder()
            .launch(stages, |acc| {
                let model = acc.prepare_blocks(model(acc.device()))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                let (model, _) = train(&acc, &run, model, &mut optimizer, 0)?;
                let err = acc.save_model(&model, &dir, "10GB", true).unwrap_err();
                assert!(err.to_string().contains("save_blocks"), "{err}");
                acc.save_blocks(&model, &dir, "10GB")?;
                Ok(params(&model))
            })
            .unwrap();
        let expected = merged(&trained, stages, 1);
        let loaded = Accelerator::builder()
            .launch(1, |acc| {
                let fresh = acc.prepare_model(model_fresh(acc.device()))?;
                let (model, _) = acc.load_checkpoint_in_model(
                    fresh,
                    &dir,
                    &burn_accelerate::checkpoint::LoadOptions {
                        strict: true,
                        ..Default::default()
                    },
                )?;
                Ok(params(&model))
            })
            .unwrap()
            .remove(0);
        assert_eq!(loaded, expected, "pp {stages}, tied {tied}");
    }
}

#[test]
fn a_stage_that_fails_ends_the_run_with_its_own_error_not_a_hang() {
    let run = Run::new(2, 4, PipelineSchedule::OneFOneB);
    let started = std::time::Instant::now();
    let err = run
        .builder()
        .collective_timeout(std::time::Duration::from_secs(20))
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let (model, _) = train(&acc, &Run { steps: 2, ..run }, model, &mut optimizer, 0)?;
            if acc.pipeline_layout().stage == 1 {
                return Err(burn_accelerate::Error::InvalidArgument(
                    "stage 1 stops here".into(),
                ));
            }
            // Stage 0 goes on into a step whose activations nobody receives.
            train(&acc, &run, model, &mut optimizer, 2)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("stage 1 stops here"), "{err}");
    // Alone, the stage left waiting says which stage it is and what it waited for.
    let err = run
        .builder()
        .collective_timeout(std::time::Duration::from_secs(2))
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            if acc.pipeline_layout().stage == 1 {
                // Stage 1 never takes part, and never fails: stage 0 waits for it until the timeout.
                std::thread::sleep(std::time::Duration::from_secs(4));
                return Ok(String::new());
            }
            match train(&acc, &run, model, &mut optimizer, 0) {
                Ok(_) => Ok("trained".into()),
                Err(e) => Ok(e.to_string()),
            }
        })
        .unwrap()
        .remove(0);
    assert!(
        err.contains("pipeline send/recv of stage 0 of 2 (replica 0, rank 0)"),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "the other stage was released at once, not by its timeout: {:?}",
        started.elapsed()
    );
}

#[test]
fn a_stage_receives_only_its_own_blocks_and_what_is_outside_them() {
    let run = Run::new(4, 2, PipelineSchedule::OneFOneB);
    // Through host memory, where `host_values` counts what arrives (in-process stages sharing a device hand it
    // over without copies: 0 there).
    let received = run
        .builder()
        .gradient_transport(burn_accelerate::GradientTransport::Host)
        .launch(4, |acc| {
            let before = acc.host_values();
            let model = acc.prepare_blocks(model(acc.device()))?;
            Ok((acc.host_values() - before, params(&model)))
        })
        .unwrap();
    let whole: usize = params(&model(&Device::default()))
        .iter()
        .map(Vec::len)
        .sum();
    let layers = params(&model(&Device::default()));
    let rest: usize = layers[..2]
        .iter()
        .chain(&layers[layers.len() - 2..])
        .map(Vec::len)
        .sum();
    let count = layers.len();
    let block = layers[2].len() + layers[3].len();
    for (rank, (values, held)) in received.iter().enumerate() {
        let total: usize = held.iter().map(Vec::len).sum();
        // Its 2 blocks, and on the first and the last stage the input layer and the head, once each: not the
        // other stages' 6 blocks; the stages between hold nothing outside their blocks. The main process (the
        // first stage) draws every parameter, receives none, and sends each stage its part, once.
        let sent: usize = received[1..]
            .iter()
            .map(|(_, held)| held.iter().map(Vec::len).sum::<usize>())
            .sum();
        let expected = if rank == 0 { sent } else { total };
        assert_eq!(*values as usize, expected, "rank {rank}");
        assert!(total < whole / 2, "rank {rank}: {total} of {whole}");
        let outside = held[0].len() + held[1].len() + held[count - 2].len() + held[count - 1].len();
        let own: Vec<usize> = (0..LAYERS)
            .filter(|l| !held[2 + 2 * l].is_empty())
            .collect();
        assert_eq!(own, vec![2 * rank, 2 * rank + 1], "rank {rank}'s blocks");
        match rank {
            0 | 3 => assert_eq!(
                outside, rest,
                "rank {rank}: the first and the last stage hold the input layer and the head"
            ),
            _ => assert_eq!(
                outside, 0,
                "rank {rank} (a middle stage) holds none of them"
            ),
        }
        assert_eq!(
            total,
            2 * block + outside,
            "rank {rank}: its blocks and what is outside"
        );
    }
}

#[test]
fn stages_cut_where_the_user_says_train_the_same_bits() {
    let run = Run::new(2, 4, PipelineSchedule::OneFOneB);
    let counts = |blocks: Vec<usize>| {
        run.builder().pp_stage_blocks(blocks).launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let (model, _) = train(&acc, &run, model, &mut optimizer, 0)?;
            Ok(params(&model))
        })
    };
    let ranks = counts(vec![2, 6]).unwrap();
    let held = |rank: usize| {
        (0..LAYERS)
            .filter(|l| !ranks[rank][2 + 2 * l].is_empty())
            .collect::<Vec<_>>()
    };
    assert_eq!(held(0), vec![0, 1]);
    assert_eq!(held(1), (2..LAYERS).collect::<Vec<_>>());
    assert_eq!(merged(&ranks, 2, 1), reference(run).0);
    let err = counts(vec![3, 3]).unwrap_err().to_string();
    assert!(
        err.contains("pp_stage_blocks [3, 3] runs 6 block(s), and the model has 8"),
        "{err}"
    );
    let err = counts(vec![8]).unwrap_err().to_string();
    assert!(err.contains("one count of blocks per stage"), "{err}");
}

#[test]
fn each_stage_holds_only_its_own_blocks() {
    let (ranks, _) = pipelined(Run {
        steps: 1,
        ..Run::new(4, 2, PipelineSchedule::OneFOneB)
    });
    for (stage, params) in ranks.iter().enumerate() {
        let held: Vec<usize> = (0..LAYERS)
            .filter(|l| !params[2 + 2 * l].is_empty())
            .collect();
        assert_eq!(
            held,
            vec![2 * stage, 2 * stage + 1],
            "stage {stage}'s blocks"
        );
    }
}

#[test]
fn stages_of_two_replicas_train_as_one_process_on_the_whole_batch() {
    for sharding in [
        ShardingStrategy::NoShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::FullShard,
    ] {
        let run = Run {
            replicas: 2,
            sharding,
            steps: 10,
            ..Run::new(2, 2, PipelineSchedule::OneFOneB)
        };
        let (ranks, _) = pipelined(run);
        let mut alone = run;
        alone.replicas = 1;
        let expected = reference(alone);
        let got = merged(&ranks, 2, 2);
        let diff = max_diff(&got, &expected.0);
        assert!(diff < 2e-5, "{run:?}: {diff}");
        // Replicas of a stage hold the same weights: every parameter of every stage.
        replicas_agree(&ranks, 2, 2, &sharding.to_string());
    }
}

/// A hybrid strategy inside each stage: 2 stages × 4 replicas, each stage's 4 ranks two shard groups of 2
/// (`HYBRID_SHARD`: sharded in a group, replicated across them; `_HYBRID_SHARD_ZERO2` likewise for gradients and
/// optimizer state), train as one process on the whole batch.
#[test]
fn hybrid_stages_train_as_one_process_on_the_whole_batch() {
    for sharding in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        let run = Run {
            replicas: 4,
            sharding,
            shard_size: Some(2),
            steps: 10,
            ..Run::new(2, 2, PipelineSchedule::OneFOneB)
        };
        let (ranks, _) = pipelined(run);
        let alone = Run {
            replicas: 1,
            sharding: ShardingStrategy::NoShard,
            shard_size: None,
            ..run
        };
        let diff = max_diff(&merged(&ranks, 2, 4), &reference(alone).0);
        assert!(diff < 2e-5, "{run:?}: {diff}");
        replicas_agree(&ranks, 2, 4, &sharding.to_string());
    }
}

/// `run` trained for `run.steps` steps and saved into `dir` (every rank calls it): the model at the save.
fn trained_and_saved(acc: &Accelerator, run: &Run, dir: &std::path::Path) -> Result<Deep> {
    let model = acc.prepare_blocks(model(acc.device()))?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let (model, _) = train(acc, run, model, &mut optimizer, 0)?;
    acc.save_state(
        Some(dir),
        &StateToSave::new().model(&model)?.optimizer(&optimizer)?,
    )?;
    Ok(model)
}

/// A fresh model and optimizer restored from `dir` (every rank calls it).
fn restored(acc: &Accelerator, dir: &std::path::Path) -> Result<(Deep, AcceleratedOptimizer)> {
    let model = acc.prepare_blocks(model_fresh(acc.device()))?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let mut state = acc.load_state(Some(dir))?;
    let model = state.model(model)?;
    state.optimizer(&mut optimizer)?;
    state.finish()?;
    Ok((model, optimizer))
}

/// The whole model after `run` trained twice its steps straight through.
fn straight_through(run: Run) -> Vec<Vec<f32>> {
    let twice = Run {
        steps: 2 * run.steps,
        ..run
    };
    merged(&pipelined(twice).0, run.stages, 1)
}

#[test]
fn a_state_saved_by_one_replica_resumes_on_two_and_stages_drop_what_they_do_not_train() {
    let run = Run {
        steps: 6,
        ..Run::new(2, 2, PipelineSchedule::OneFOneB)
    };
    let dir = std::env::temp_dir().join("pipeline-resume-replicas");
    let saved = run
        .builder()
        .launch(2, |acc| Ok(params(&trained_and_saved(&acc, &run, &dir)?)))
        .unwrap();
    // After a step, the first stage holds no head and the last no input layer: only the stage that trains them.
    let count = saved[0].len();
    assert!(saved[0][count - 1].is_empty() && saved[0][count - 2].is_empty());
    assert!(saved[1][0].is_empty() && saved[1][1].is_empty());
    assert!(!saved[0][0].is_empty() && !saved[1][count - 1].is_empty());
    let twice = Run { replicas: 2, ..run };
    let resumed = twice
        .builder()
        .launch(4, |acc| {
            let (model, mut optimizer) = restored(&acc, &dir)?;
            let loaded = params(&model);
            let (model, _) = train(&acc, &twice, model, &mut optimizer, 6)?;
            Ok((loaded, params(&model)))
        })
        .unwrap();
    for replica in 0..2 {
        let ranks = [resumed[replica].0.clone(), resumed[2 + replica].0.clone()];
        assert_eq!(
            merged(&ranks, 2, 1),
            merged(&saved, 2, 1),
            "replica {replica}: the saved weights"
        );
    }
    let trained: Vec<_> = resumed.into_iter().map(|r| r.1).collect();
    let diff = max_diff(&merged(&trained, 2, 2), &straight_through(run));
    assert!(
        diff < 2e-5,
        "2 replicas from step 6 vs 1 throughout: {diff}"
    );
}

#[test]
fn a_run_saved_and_resumed_continues_as_one_trained_straight_through() {
    let run = Run {
        steps: 6,
        ..Run::new(2, 2, PipelineSchedule::OneFOneB)
    };
    let dir = std::env::temp_dir().join("pipeline-resume");
    let resumed = run
        .builder()
        .launch(2, |acc| {
            trained_and_saved(&acc, &run, &dir)?;
            let (model, mut optimizer) = restored(&acc, &dir)?;
            let (model, _) = train(&acc, &run, model, &mut optimizer, 6)?;
            Ok(params(&model))
        })
        .unwrap();
    assert_eq!(merged(&resumed, 2, 1), straight_through(run));
}

/// A model with other weights than [`model`]'s, for a restore to overwrite.
fn model_fresh(device: &Device) -> Deep {
    let mut m = model(device);
    m.head = LinearConfig::new(WIDTH, 1).init(device);
    m
}

#[test]
fn a_hybrid_stage_of_uneven_shard_groups_or_an_uneven_mesh_is_refused_with_a_message_saying_what_to_set()
 {
    let err = Accelerator::builder()
        .pp_size(2)
        .sharding(ShardingStrategy::HybridShard)
        .dp_shard_size(3)
        .launch(4, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dp_shard_size") && err.contains("divides the 2 data-parallel ranks"),
        "{err}"
    );
    let err = Accelerator::builder()
        .pp_size(3)
        .launch(4, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("pp_size 3 does not divide the 4 rank(s)"),
        "{err}"
    );
}

/// The trace of a step shows the schedule the stages ran: under 1F1B with 2 stages and 4 micro-batches, stage 0
/// runs F0 F1 B0 F2 B1 F3 B2 B3 and stage 1 F0 B0 F1 B1 F2 B2 F3 B3 (GPipe: every forward, then every backward),
/// each pass after the last on its rank and within the step; a stage's idle share is what its passes leave of the
/// step; the Chrome trace and the picture hold a slice / a box per pass.
#[test]
fn the_trace_shows_each_stage_running_its_schedule() {
    use burn_accelerate::pipeline_parallel::{SpanKind, chrome_trace, svg_trace};
    for (schedule, expected) in [
        (
            PipelineSchedule::OneFOneB,
            ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
        ),
        (
            PipelineSchedule::GPipe,
            ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
        ),
    ] {
        let run = Run {
            steps: 2,
            ..Run::new(2, 4, schedule)
        };
        let traces = run
            .builder()
            .launch(2, |acc| {
                let model = acc.prepare_blocks(model(acc.device()))?;
                let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                train(&acc, &run, model, &mut optimizer, 0)?;
                Ok(acc.pipeline_trace().expect("a pipelined step's trace"))
            })
            .unwrap();
        for (stage, trace) in traces.iter().enumerate() {
            assert_eq!(
                (trace.stage, trace.stages, trace.micro_batches),
                (stage, 2, 4)
            );
            let passes: Vec<String> = trace
                .spans
                .iter()
                .filter_map(|s| match s.kind {
                    SpanKind::Forward => Some(format!("F{}", s.micro_batch)),
                    SpanKind::Backward => Some(format!("B{}", s.micro_batch)),
                    SpanKind::Transfer => None,
                })
                .collect();
            assert_eq!(
                passes.join(" "),
                expected[stage],
                "{schedule:?} stage {stage}"
            );
            let mut end = 0.0;
            for span in &trace.spans {
                assert!(
                    span.start_us >= end - 1.0,
                    "{schedule:?}: spans overlap: {trace:?}"
                );
                end = span.start_us + span.duration_us;
            }
            assert!(end <= trace.step_us + 1.0, "{trace:?}");
            let busy: f64 = trace
                .spans
                .iter()
                .filter(|s| s.kind != SpanKind::Transfer)
                .map(|s| s.duration_us)
                .sum();
            let idle = trace.idle_fraction();
            assert!((idle - (1.0 - busy / trace.step_us)).abs() < 1e-9 && idle > 0.0 && idle < 1.0);
            assert!((trace.ideal_idle_fraction() - 0.2).abs() < 1e-12);
        }
        let chrome = chrome_trace(&traces);
        let slices = chrome["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] != "transfer")
            .count();
        assert_eq!(slices, 2 * 2 * 4, "a slice per pass: {chrome}");
        let svg = svg_trace(&traces);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(">stage 0<") && svg.contains(">stage 1<"));
        assert_eq!(svg.matches("<title>F").count(), 8, "{svg}");
        assert_eq!(svg.matches("<title>B").count(), 8, "{svg}");
        assert_eq!(svg.matches("(schedule 0.20)").count(), 2);
    }
}

/// Where a test's pass runs out of memory.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Failing {
    /// `before`, on the first stage.
    First,
    /// `after`, on the last stage.
    Last,
    /// Nowhere.
    Nowhere,
}

/// `find_executable_batch_size` over a pipelined loop from `start` rows: each attempt prepares the model, then
/// trains 2 batches of 2 micro-batches; a micro-batch of more than 3 rows panics as LibTorch's out-of-memory does,
/// in `before` or `after` as `failing` says. Every rank's sizes tried, parameters and losses.
#[allow(clippy::type_complexity)]
fn search(
    stages: usize,
    schedule: PipelineSchedule,
    failing: Failing,
    start: usize,
) -> Vec<(Vec<usize>, Vec<Vec<f32>>, Vec<f32>)> {
    let run = Run::new(stages, 2, schedule);
    let oom = |rows: usize, here: Failing| {
        if failing == here && rows > 3 {
            panic!("CUDA out of memory. Tried to allocate 2.00 GiB ({rows} rows)");
        }
    };
    run.builder()
        .collective_timeout(std::time::Duration::from_secs(30))
        .launch(stages, |acc| {
            let device = acc.device().clone();
            let mut tried = Vec::new();
            let (params, losses) = acc
                .find_executable_batch_size(start, |batch_size| {
                    tried.push(batch_size);
                    let mut model = acc.prepare_blocks(model(&device))?;
                    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                    let mut losses = Vec::new();
                    for step in 0..2 {
                        let loss = acc.backward_batch(
                            &model,
                            batch(step * batch_size, batch_size, &device),
                            |m, (x, _)| {
                                oom(x.dims()[0], Failing::First);
                                m.input.forward(x.clone()).tanh()
                            },
                            |layer, h| layer.forward(h).tanh(),
                            |m, h, (_, y)| {
                                oom(y.dims()[0], Failing::Last);
                                run.after(m, h, y)
                            },
                        )?;
                        losses.push(loss.into_scalar::<f32>());
                        model = optimizer.try_step(model)?;
                    }
                    Ok::<_, burn_accelerate::Error>((params(&model), losses))
                })
                .map_err(|e| burn_accelerate::Error::other(e.to_string()))?;
            Ok((tried, params, losses))
        })
        .unwrap_or_else(|e| panic!("{stages} stages, {schedule:?}, {failing:?}: {e}"))
}

/// A pass that runs out of memory on one stage fails the step on every stage at once (the stage sends on what
/// its neighbours wait for, and every rank learns the verdict), so `find_executable_batch_size` shrinks the batch
/// for all of them: 16, 14, 12, 10, 9, 8, 7 rows fail (a micro-batch of 4 or more), 6 fits; the failed attempts
/// leave nothing behind: the run then trains the bits of a search that started at 6. No transfer waits for its
/// timeout.
#[test]
fn find_executable_batch_size_shrinks_the_batch_of_every_stage_when_one_runs_out_of_memory() {
    for (stages, schedule, failing) in [
        (2, PipelineSchedule::OneFOneB, Failing::Last),
        (2, PipelineSchedule::GPipe, Failing::First),
        (4, PipelineSchedule::OneFOneB, Failing::First),
        (4, PipelineSchedule::GPipe, Failing::Last),
    ] {
        let started = std::time::Instant::now();
        let searched = search(stages, schedule, failing, 16);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "no stage waited for the 30 s timeout: {:?}",
            started.elapsed()
        );
        let straight = search(stages, schedule, Failing::Nowhere, 6);
        for (rank, ((tried, params, losses), (fitted, want, want_losses))) in
            searched.iter().zip(&straight).enumerate()
        {
            let case = format!("{stages} stages, {schedule:?}, {failing:?}, rank {rank}");
            assert_eq!(tried, &[16, 14, 12, 10, 9, 8, 7, 6], "{case}");
            assert_eq!(fitted, &[6], "{case}");
            assert_eq!(params, want, "{case}: the weights of a run at 6 rows");
            assert_eq!(losses, want_losses, "{case}");
        }
    }
}

/// A stage whose pass fails with an error that is not about memory (here a loss computed from nothing the model
/// holds) ends the step on every stage at once: that stage returns its own error, the others an error naming its
/// rank, long before the collective timeout.
#[test]
fn a_stage_whose_pass_fails_ends_the_step_on_every_stage_at_once() {
    let started = std::time::Instant::now();
    let errors = Run::new(2, 4, PipelineSchedule::OneFOneB)
        .builder()
        .collective_timeout(std::time::Duration::from_secs(30))
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let device = acc.device().clone();
            let result = acc.backward_batch(
                &model,
                batch(0, BATCH, &device),
                |m, (x, _)| m.input.forward(x.clone()).tanh(),
                |layer, h| layer.forward(h).tanh(),
                |_, _, (_, y)| y.clone().sum(),
            );
            Ok(result.map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    assert!(
        errors[1].contains("the loss is not connected"),
        "{}",
        errors[1]
    );
    assert!(
        errors[0].contains("rank 1 failed") && errors[0].contains("pipeline stage 1 failed"),
        "{}",
        errors[0]
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// Debug mode compares what every stage of a pipeline runs a step with: with the same batch on every stage the
/// step trains as without it; a stage given a batch of another size (a dataloader sharded by rank instead of by
/// replica) is an error on every stage, at once, naming each stage, its rank and its batch.
#[test]
fn debug_mode_names_the_stage_and_rank_whose_batch_differs() {
    let run = Run::new(2, 2, PipelineSchedule::OneFOneB);
    let outcomes = run
        .builder()
        .debug(true)
        .collective_timeout(std::time::Duration::from_secs(30))
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let device = acc.device().clone();
            let step = |rows: usize| {
                acc.backward_batch(
                    &model,
                    batch(0, rows, &device),
                    |m, (x, _)| m.input.forward(x.clone()).tanh(),
                    |layer, h| layer.forward(h).tanh(),
                    |m, h, (_, y)| run.after(m, h, y),
                )
            };
            let same = step(BATCH).map(|l| l.into_scalar::<f32>());
            let stage = acc.pipeline_layout().stage;
            let differing = step(if stage == 1 { BATCH - 4 } else { BATCH });
            Ok((same, differing.map(|_| ()).unwrap_err().to_string()))
        })
        .unwrap();
    let plain = run
        .builder()
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let device = acc.device().clone();
            acc.backward_batch(
                &model,
                batch(0, BATCH, &device),
                |m, (x, _)| m.input.forward(x.clone()).tanh(),
                |layer, h| layer.forward(h).tanh(),
                |m, h, (_, y)| run.after(m, h, y),
            )
            .map(|l| l.into_scalar::<f32>())
        })
        .unwrap();
    for ((same, error), plain) in outcomes.iter().zip(&plain) {
        assert_eq!(same.as_ref().unwrap(), plain);
        for needle in [
            "debug mode",
            "batches of different sizes",
            "stage 0 (rank 0)",
            "a batch of 16 samples",
            "stage 1 (rank 1)",
            "a batch of 12 samples",
        ] {
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }
}

/// Sharded stages resume on another number of data-parallel replicas: a state saved by 2 stages × 2 `FULL_SHARD`
/// replicas (each rank its slices of its stage; the manifest lists every stage's splits) loads on 2 stages × 1 and
/// 2 stages × 4 replicas (slices re-cut, some of them empty), with the saved weights, and trains on within
/// float rounding of a run straight through; on another `pp_size` it is refused with a message.
#[test]
fn sharded_stages_resume_on_another_number_of_replicas() {
    let run = Run {
        steps: 6,
        replicas: 2,
        sharding: ShardingStrategy::FullShard,
        ..Run::new(2, 2, PipelineSchedule::OneFOneB)
    };
    let dir = std::env::temp_dir().join(format!("pipeline-resume-sharded-{}", std::process::id()));
    let saved = run
        .builder()
        .launch(4, |acc| {
            let model = trained_and_saved(&acc, &run, &dir)?;
            Ok(params(&acc.unshard(&model)?))
        })
        .unwrap();
    let straight = straight_through(Run {
        replicas: 1,
        sharding: ShardingStrategy::NoShard,
        ..run
    });
    for replicas in [1, 4] {
        let now = Run { replicas, ..run };
        let resumed = now
            .builder()
            .launch(2 * replicas, |acc| {
                let (model, mut optimizer) = restored(&acc, &dir)?;
                let loaded = params(&acc.unshard(&model)?);
                let (model, _) = train(&acc, &now, model, &mut optimizer, 6)?;
                Ok((loaded, params(&acc.unshard(&model)?)))
            })
            .unwrap_or_else(|e| panic!("{replicas} replica(s): {e}"));
        for replica in 0..replicas {
            let ranks = [
                resumed[replica].0.clone(),
                resumed[replicas + replica].0.clone(),
            ];
            assert_eq!(
                merged(&ranks, 2, 1),
                merged(&saved, 2, 2),
                "{replicas} replica(s), replica {replica}: the saved weights"
            );
        }
        let trained: Vec<_> = resumed.into_iter().map(|r| r.1).collect();
        let diff = max_diff(&merged(&trained, 2, replicas), &straight);
        assert!(
            diff < 2e-5,
            "{replicas} replica(s) from step 6 vs 1 throughout: {diff}"
        );
    }
    let err = Run {
        replicas: 1,
        ..Run::new(4, 2, PipelineSchedule::OneFOneB)
    }
    .builder()
    .sharding(ShardingStrategy::FullShard)
    .launch(4, |acc| restored(&acc, &dir).map(|_| ()))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("2 pipeline stages") && err.contains("set pp_size as the saving run did"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A block that runs its layer `times` times: blocks of equal parameters and unequal compute.
#[derive(burn::module::Module, Debug)]
struct Repeated {
    linear: burn::nn::Linear,
    times: usize,
}

/// Stages cut by measured compute: four blocks of the same parameters, the last running its layer 12 times,
/// measure about 12 times costlier, so two stages balanced by their cost run 3 and 1 blocks (by parameters, 2
/// and 2).
#[test]
fn stages_cut_by_measured_compute_give_the_costly_block_a_stage_of_its_own() {
    use burn_accelerate::pipeline_parallel::{measure_block_costs, stage_blocks_for};
    let device = Device::default().autodiff();
    let blocks: Vec<Repeated> = [1, 1, 1, 12]
        .into_iter()
        .map(|times| Repeated {
            linear: LinearConfig::new(256, 256).init(&device),
            times,
        })
        .collect();
    // Each block's least cost over three measurements: the tests beside this one share the cores, and a
    // measurement they interrupt is not what the block costs.
    let measure = || {
        measure_block_costs(
            &blocks,
            Tensor::<2>::ones([256, 256], &device),
            |b, mut x| {
                for _ in 0..b.times {
                    x = b.linear.forward(x).tanh();
                }
                x
            },
            5,
        )
        .unwrap()
    };
    let costs = (0..2).fold(measure(), |least, _| {
        least.iter().zip(measure()).map(|(a, b)| a.min(b)).collect()
    });
    assert!(
        costs[3] > 4.0 * costs[..3].iter().cloned().fold(0.0, f64::max),
        "{costs:?}"
    );
    assert_eq!(
        stage_blocks_for(&costs, 2).unwrap(),
        vec![3, 1],
        "{costs:?}"
    );
    assert_eq!(stage_blocks_for(&[1.0; 4], 2).unwrap(), vec![2, 2]);
}

/// Activation checkpointing under a pipeline: each stage runs its blocks without a graph, keeping only their
/// inputs, and recomputes each block in the backward pass; the weights are the bits of the same pipeline keeping
/// every activation (2 and 4 stages, both schedules, accumulation across batches, fp16, a tied embedding and head,
/// and 2 × 2 `FULL_SHARD`).
#[test]
fn activation_checkpointing_under_a_pipeline_trains_the_same_bits() {
    let cases = [
        Run::new(2, 4, PipelineSchedule::OneFOneB),
        Run::new(4, 8, PipelineSchedule::GPipe),
        Run {
            accumulation: 2,
            fp16: true,
            ..Run::new(2, 2, PipelineSchedule::GPipe)
        },
        Run {
            tied: true,
            ..Run::new(4, 4, PipelineSchedule::OneFOneB)
        },
        Run {
            replicas: 2,
            sharding: ShardingStrategy::FullShard,
            ..Run::new(2, 2, PipelineSchedule::OneFOneB)
        },
    ];
    for run in cases {
        let run = Run { steps: 8, ..run };
        let (kept, kept_losses) = pipelined(run);
        let (recomputed, losses) = pipelined(Run {
            checkpoint: true,
            ..run
        });
        assert_eq!(recomputed, kept, "{run:?}");
        assert_eq!(losses, kept_losses, "{run:?}");
    }
}

/// Evaluation through the stages fails together too: `after` running out of memory on the last stage for
/// micro-batches of more than 3 rows fails `forward_batch` on every stage at once, and
/// `find_executable_batch_size` shrinks the evaluation batch for all of them (2 micro-batches: 6 rows fit), with
/// the outputs of a plain forward pass.
#[test]
fn evaluation_out_of_memory_on_one_stage_shrinks_the_batch_of_every_stage() {
    let started = std::time::Instant::now();
    let outcomes = Run::new(2, 2, PipelineSchedule::OneFOneB)
        .builder()
        .collective_timeout(std::time::Duration::from_secs(30))
        .launch(2, |acc| {
            let model = acc.prepare_blocks(model(acc.device()))?;
            let mut tried = Vec::new();
            let values = acc
                .find_executable_batch_size(16, |rows| {
                    tried.push(rows);
                    acc.forward_batch(
                        &model,
                        batch(0, rows, acc.device()),
                        |m, (x, _)| m.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h, _| {
                            let rows = h.dims()[0];
                            if rows > 3 {
                                panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
                            }
                            m.head.forward(h).reshape([rows])
                        },
                    )
                })
                .map_err(|e| burn_accelerate::Error::other(e.to_string()))?;
            Ok((tried, values.into_data().try_to_vec::<f32>().unwrap()))
        })
        .unwrap();
    let device = Device::default();
    let plain = {
        let m = model(&device);
        let mut h = m.input.forward(batch(0, 6, &device).0).tanh();
        for layer in &m.layers {
            h = layer.forward(h).tanh();
        }
        m.head.forward(h).reshape([6])
    }
    .into_data()
    .try_to_vec::<f32>()
    .unwrap();
    for (rank, (tried, values)) in outcomes.iter().enumerate() {
        assert_eq!(tried, &[16, 14, 12, 10, 9, 8, 7, 6], "rank {rank}");
        let diff = values
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(values.len() == 6 && diff < 1e-6, "rank {rank}: {values:?}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

/// A short last batch (`even_batches = false`): a replica whose batch holds fewer samples than `pp_microbatches`
/// runs one micro-batch a sample, to the weights of data parallelism on the same rows (2 stages × 2 replicas, 4
/// and 3 rows); a replica whose batch holds none fails the step on every rank of the run at once, each with an
/// error, and every rank goes on to its next collective (before, that replica's ranks returned from the step
/// while the other's waited in its verdict).
#[test]
fn a_short_last_batch_runs_fewer_micro_batches_and_an_empty_one_fails_every_rank() {
    use burn::optim::SgdConfig;
    let train = |stages: usize, rows_of: [usize; 2]| {
        Accelerator::builder()
            .pp_size(stages)
            .pp_microbatches(4)
            .collective_timeout(std::time::Duration::from_secs(20))
            .launch(2 * stages, |acc| {
                let mut model = acc.prepare_blocks(model(acc.device()))?;
                let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 0.05);
                let layout = acc.pipeline_layout();
                let rows = rows_of[layout.replica];
                let mut outcomes = Vec::new();
                for step in 0..3 {
                    let data = batch(step * 16 + layout.replica * 8, rows, acc.device());
                    let outcome = acc.backward_batch(
                        &model,
                        data,
                        |m, (x, _)| m.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h, (_, y)| loss(m.head.forward(h), y.clone()),
                    );
                    outcomes.push(outcome.map(|_| ()).map_err(|e| e.to_string()));
                    model = optimizer.try_step(model)?;
                    // The next collective: every rank reaches it whether its step failed or not.
                    acc.wait_for_everyone()?;
                }
                Ok((params(&acc.unshard(&model)?), outcomes))
            })
            .unwrap_or_else(|e| panic!("{stages} stages, rows {rows_of:?}: {e}"))
    };
    let data_parallel = train(1, [4, 3]);
    let pipelined = train(2, [4, 3]);
    for (_, outcomes) in data_parallel.iter().chain(&pipelined) {
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
    let expected = &data_parallel[0].0;
    for (r, (ranks, _)) in pipelined.iter().enumerate() {
        for (j, (p, q)) in ranks.iter().zip(expected).enumerate() {
            if !p.is_empty() {
                let diff = max_diff(std::slice::from_ref(p), std::slice::from_ref(q));
                assert!(diff <= 1e-6, "rank {r}, parameter {j}: {diff:e}");
            }
        }
    }
    for (r, (_, outcomes)) in train(2, [4, 0]).iter().enumerate() {
        for outcome in outcomes {
            let err = outcome
                .as_ref()
                .expect_err("a replica without samples fails the step");
            assert!(
                err.contains("cannot be cut into 4 micro-batch")
                    || err.contains("rank 1 failed")
                    || err.contains("rank 3 failed"),
                "rank {r}: {err}"
            );
        }
    }
}

/// A part outside the blocks that only some micro-batches reach (a side head `after` uses where a target is
/// positive): the replicas of a stage whose data reach it and whose data do not reduce the same list, the union of
/// what their passes reached, and train as data parallelism on the same rows (before, each replica listed what its
/// own passes reached, and the two passed different bucket layouts into one reduction).
#[test]
fn replicas_whose_data_reach_different_parameters_reduce_the_same_list() {
    use burn::optim::SgdConfig;
    #[derive(burn::module::Module, Debug)]
    struct Sided {
        deep: Deep,
        side: burn::nn::Linear,
    }
    impl burn_accelerate::Blocks for Sided {
        type Block = burn::nn::Linear;
        fn blocks(&self) -> &[burn::nn::Linear] {
            &self.deep.layers
        }
    }
    let train = |stages: usize| {
        Accelerator::builder()
            .pp_size(stages)
            .pp_microbatches(2)
            .collective_timeout(std::time::Duration::from_secs(20))
            .launch(2 * stages, |acc| {
                let device = acc.device().clone();
                let sided = Sided {
                    deep: model(&device),
                    side: deep::deterministic(LinearConfig::new(WIDTH, 1).init(&device)),
                };
                let mut model = acc.prepare_blocks(sided)?;
                let mut optimizer = acc.prepare_optimizer(SgdConfig::new().init(), 0.05);
                let layout = acc.pipeline_layout();
                for step in 0..3 {
                    // Replica 0's targets are positive (it reaches the side head), replica 1's negative.
                    let (x, y) = batch(step * 8 + layout.replica * 4, 4, &device);
                    let sign = if layout.replica == 0 { 1.0 } else { -1.0 };
                    let y = y.abs().mul_scalar(sign).add_scalar(0.01 * sign);
                    acc.backward_batch(
                        &model,
                        (x, y),
                        |m, (x, _)| m.deep.input.forward(x.clone()).tanh(),
                        |layer, h| layer.forward(h).tanh(),
                        |m, h, (_, y)| {
                            let out = m.deep.head.forward(h.clone());
                            let out = match y.clone().sum().into_scalar::<f32>() > 0.0 {
                                true => out + m.side.forward(h),
                                false => out,
                            };
                            loss(out, y.clone())
                        },
                    )?;
                    model = optimizer.try_step(model)?;
                }
                Ok((layout.stage, params(&acc.unshard(&model)?)))
            })
            .unwrap_or_else(|e| panic!("{stages} stage(s): {e}"))
    };
    let data_parallel = train(1);
    let expected = &data_parallel[0].1;
    let count = expected.len();
    for (rank, (stage, got)) in train(2).iter().enumerate() {
        for (j, (p, q)) in got.iter().zip(expected).enumerate() {
            // The input layer is the first stage's; the head and the side head the last's; blocks where held.
            let trains_here = match j {
                0 | 1 => *stage == 0,
                _ if j + 4 >= count => *stage == 1,
                _ => !p.is_empty(),
            };
            if trains_here {
                let diff = max_diff(std::slice::from_ref(p), std::slice::from_ref(q));
                assert!(diff <= 1e-6, "rank {rank}, parameter {j}: {diff:e}");
            }
        }
    }
}
