//! Checkpointing: exact resume on 1 and 2 ranks (mid-epoch, shuffled), Hugging Face sharded safetensors,
//! crash safety under SIGKILL, and clear errors for bad checkpoints.

use crate::examples;
use crate::fixtures;
use crate::mlp;
use crate::python;

use examples::example;
use fixtures::initial;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamConfig;
use burn::tensor::{DType, Device, Tensor};
use burn_accelerate::data::{DataLoaderBuilder, PreparedDataLoader};
use burn_accelerate::optim::{AcceleratedOptimizer, AcceleratedScheduler};
use burn_accelerate::{Accelerator, LoadOptions, Result, StateToSave};
use mlp::{Batch, Mlp, Sample, SampleBatcher, weights};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Run {
    model: Mlp,
    optimizer: AcceleratedOptimizer,
    scheduler: AcceleratedScheduler,
    loader: PreparedDataLoader<Sample, Batch>,
}

fn setup(acc: &Accelerator, start: &Mlp) -> Result<Run> {
    setup_with_workers(acc, start, 0)
}

/// [`setup`] with a loader of `workers` worker threads.
fn setup_with_workers(acc: &Accelerator, start: &Mlp, workers: usize) -> Result<Run> {
    setup_with(acc, start, workers, 8)
}

/// [`setup`] with a loader of `workers` worker threads and `batch` samples a batch on each rank.
fn setup_with(acc: &Accelerator, start: &Mlp, workers: usize, batch: usize) -> Result<Run> {
    let model = acc.prepare_model(start.clone())?;
    let optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let schedule = LinearLrSchedulerConfig::new(1e-2, 1e-3, 100)
        .init()
        .unwrap();
    let scheduler = acc.prepare_scheduler(schedule, &optimizer);
    let builder = DataLoaderBuilder::new(SampleBatcher)
        .batch_size(batch)
        .shuffle(5);
    let builder = if workers > 0 {
        builder.num_workers(workers)
    } else {
        builder
    };
    let loader = acc.prepare_dataloader(builder.build(mlp::dataset(100, 2)))?;
    Ok(Run {
        model,
        optimizer,
        scheduler,
        loader,
    })
}

/// `steps` optimizer steps, leaving the loader in the middle of an epoch when `steps` says so.
fn train(acc: &Accelerator, run: &mut Run, steps: usize) -> Result<()> {
    let mut done = 0;
    while done < steps {
        for batch in run.loader.iter() {
            // The whole model for the forward pass (a sharded strategy's slices gathered; otherwise a clone).
            let whole = acc.unshard(&run.model)?;
            let loss = whole.loss(batch?);
            acc.backward(loss, &whole)?;
            run.model = run.optimizer.step(run.model.clone());
            run.scheduler.step();
            done += 1;
            if done == steps {
                break;
            }
        }
    }
    Ok(())
}

/// Weights after a few more identical steps: equal only if the optimizer states (Adam's moments and step
/// counts) are equal too. (The optimizer record's bytes are not compared: Burn serialises its entries in hash
/// order.)
fn optimizer_fingerprint(acc: &Accelerator, run: &Run) -> Result<Vec<Vec<f32>>> {
    let mut model = run.model.clone();
    let mut optimizer = acc.prepare_optimizer(run.optimizer.inner().clone(), 1e-2);
    for seed in 0..3 {
        let loss = model.loss(SampleBatcher.batch(mlp::samples(8, 100 + seed), acc.device()));
        acc.backward(loss, &model)?;
        model = optimizer.step(model);
    }
    Ok(weights(&model))
}

/// A run's weights, optimizer state (as [`optimizer_fingerprint`]) and learning rate.
type Outcome = (Vec<Vec<f32>>, Vec<Vec<f32>>, burn::optim::LearningRate);

fn outcome(acc: &Accelerator, run: &Run) -> Result<Outcome> {
    Ok((
        weights(&run.model),
        optimizer_fingerprint(acc, run)?,
        run.scheduler.lr(),
    ))
}

/// Saves `run`'s model, optimizer and scheduler into `dir`.
fn save(acc: &Accelerator, run: &Run, dir: &Path) -> Result<()> {
    let parts = StateToSave::new()
        .model(&run.model)?
        .optimizer(&run.optimizer)?
        .scheduler(&run.scheduler)?;
    acc.save_state(Some(dir), &parts)?;
    Ok(())
}

/// Restores `run` from the state in `dir`; returns how many ranks saved it.
fn restore(acc: &Accelerator, run: &mut Run, dir: &Path) -> Result<usize> {
    let mut state = acc.load_state(Some(dir))?;
    let saved_by = state.saved_num_processes();
    run.model = state.model(run.model.clone())?;
    state.optimizer(&mut run.optimizer)?;
    state.scheduler(&mut run.scheduler)?;
    state.finish()?;
    Ok(saved_by)
}

/// A run stopped mid-epoch, saved and resumed (its loaders with `workers` threads) against one straight run
/// without workers.
fn exact_resume(ranks: usize) {
    exact_resume_with_workers(ranks, 0);
}

fn exact_resume_with_workers(ranks: usize, workers: usize) {
    let start = initial();
    let dir = temp_dir(&format!("resume{ranks}-{workers}"));
    // 7 batches of 8 per epoch on one rank (100 samples): 10 steps stop mid-epoch.
    let (n, total) = (10, 20);
    let straight = Accelerator::builder()
        .launch(ranks, |acc| {
            let mut run = setup(&acc, &start)?;
            train(&acc, &mut run, total)?;
            outcome(&acc, &run)
        })
        .unwrap();
    Accelerator::builder()
        .launch(ranks, |acc| {
            let mut run = setup_with_workers(&acc, &start, workers)?;
            train(&acc, &mut run, n)?;
            save(&acc, &run, &dir)
        })
        .unwrap();
    let resumed = Accelerator::builder()
        .launch(ranks, |acc| {
            // Fresh objects, different initial weights: everything must come from the checkpoint.
            let mut run = setup_with_workers(&acc, &initial(), workers)?;
            restore(&acc, &mut run, &dir)?;
            train(&acc, &mut run, total - n)?;
            outcome(&acc, &run)
        })
        .unwrap();
    for rank in 0..ranks {
        assert_eq!(
            straight[rank].0, resumed[rank].0,
            "rank {rank}: weights bit for bit"
        );
        assert_eq!(
            straight[rank].1, resumed[rank].1,
            "rank {rank}: optimizer state bit for bit"
        );
        assert_eq!(
            straight[rank].2, resumed[rank].2,
            "rank {rank}: learning rate"
        );
    }
}

/// A restored run reads its optimizer state from the checkpoint lazily (restoring costs no copy of the state),
/// yet owes nothing to the checkpoint's files: removed right after `load_state`, before the state is first used,
/// the run continues bit for bit as it does with them kept, whether the state was read as saved (one rank) or
/// re-cut (`SHARD_GRAD_OP` on 2 ranks resumed on 1); and no scratch file outlives it.
/// A copy of the folder `from` (and its sub-folders) at `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn a_restored_run_continues_after_its_checkpoint_is_removed() {
    use burn_accelerate::ShardingStrategy;
    let start = initial();
    let (n, total) = (10, 20);
    for (saved_on, sharding) in [
        (1, ShardingStrategy::NoShard),
        (2, ShardingStrategy::ShardGradOp),
    ] {
        let parent = temp_dir(&format!("removed-{saved_on}"));
        let dir = parent.join("state");
        Accelerator::builder()
            .sharding(sharding)
            .launch(saved_on, |acc| {
                let mut run = setup_with(&acc, &start, 0, 8 / saved_on)?;
                train(&acc, &mut run, n)?;
                save(&acc, &run, &dir)
            })
            .unwrap();
        let resume = |remove: bool| {
            Accelerator::builder()
                .launch(1, |acc| {
                    let mut run = setup(&acc, &initial())?;
                    restore(&acc, &mut run, &dir)?;
                    if remove {
                        std::fs::remove_dir_all(&dir).unwrap();
                    }
                    train(&acc, &mut run, total - n)?;
                    outcome(&acc, &run)
                })
                .unwrap()
        };
        // The wrapped Burn optimizer given back by `into_inner` once the checkpoint is gone: its state is read in
        // before the files it was read from go with the wrapper, and equals the restored one's.
        let fingerprint = |give_back: bool| {
            let copy = parent.join(format!("copy-{give_back}"));
            copy_dir(&dir, &copy);
            Accelerator::builder()
                .launch(1, |acc| {
                    let mut run = setup(&acc, &initial())?;
                    restore(&acc, &mut run, &copy)?;
                    if give_back {
                        std::fs::remove_dir_all(&copy).unwrap();
                        let placeholder = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                        let inner = std::mem::replace(&mut run.optimizer, placeholder).into_inner();
                        run.optimizer = acc.prepare_optimizer(inner, 1e-2);
                    }
                    optimizer_fingerprint(&acc, &run)
                })
                .unwrap()
        };
        assert_eq!(
            fingerprint(true)[0],
            fingerprint(false)[0],
            "saved on {saved_on}: the optimizer given back by into_inner"
        );
        std::fs::remove_dir_all(parent.join("copy-false")).ok();
        let kept = resume(false);
        let removed = resume(true);
        assert_eq!(kept[0].0, removed[0].0, "saved on {saved_on}: weights");
        assert_eq!(
            kept[0].1, removed[0].1,
            "saved on {saved_on}: optimizer state"
        );
        let left: Vec<_> = std::fs::read_dir(&parent)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains("scratch"))
            .collect();
        assert!(left.is_empty(), "saved on {saved_on}: left behind {left:?}");
        std::fs::remove_dir_all(&parent).ok();
    }
}

#[test]
fn resume_mid_epoch_is_exact_on_one_rank() {
    exact_resume(1);
}

#[test]
fn resume_mid_epoch_is_exact_on_two_ranks() {
    exact_resume(2);
}

#[test]
fn resume_mid_epoch_with_loader_workers_matches_a_run_without_them() {
    exact_resume_with_workers(1, 3);
    exact_resume_with_workers(3, 2);
}

/// Saves the state of 2 ranks of 8 samples a batch (`saved_workers` loader workers each) after 5 steps into `dir`,
/// resumes it on 4 ranks of 4 (`resumed_workers` each, the same 16 samples a step) for 4 more, and checks each
/// rank's weights, optimizer state and learning rate against the 2-rank run straight through without workers (the
/// same sums in another order: within 1e-6).
fn resumes_on_four_ranks(dir: &Path, saved_workers: usize, resumed_workers: usize) {
    let start = initial();
    let (n, total) = (5, 9);
    let straight = Accelerator::builder()
        .launch(2, |acc| {
            let mut run = setup(&acc, &start)?;
            train(&acc, &mut run, total)?;
            outcome(&acc, &run)
        })
        .unwrap();
    Accelerator::builder()
        .launch(2, |acc| {
            let mut run = setup_with(&acc, &start, saved_workers, 8)?;
            train(&acc, &mut run, n)?;
            save(&acc, &run, dir)
        })
        .unwrap();
    let resumed = Accelerator::builder()
        .launch(4, |acc| {
            let mut run = setup_with(&acc, &initial(), resumed_workers, 4)?;
            assert_eq!(restore(&acc, &mut run, dir)?, 2, "ranks that saved it");
            train(&acc, &mut run, total - n)?;
            outcome(&acc, &run)
        })
        .unwrap();
    let diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert_eq!(resumed.len(), 4);
    let what = format!("{saved_workers} -> {resumed_workers} workers");
    for (rank, (weights, optimizer, lr)) in resumed.iter().enumerate() {
        assert!(
            diff(weights, &straight[0].0) <= 1e-6,
            "{what}, rank {rank}: weights"
        );
        assert!(
            diff(optimizer, &straight[0].1) <= 1e-6,
            "{what}, rank {rank}: optimizer state"
        );
        assert_eq!(*lr, straight[0].2, "{what}, rank {rank}: learning rate");
    }
}

/// A state saved by 2 ranks of 8 samples a batch continues on 4 ranks of 4 (the same 16 samples a step), with
/// the weights, optimizer state and learning rate of the 2-rank run straight through (the same sums, in another
/// order: within 1e-6); on 3 ranks of 8 (24 a step) it is refused, naming both global batches and the fix.
#[test]
fn a_state_continues_on_another_number_of_ranks_with_the_same_global_batch_only() {
    let dir = temp_dir("any-ranks");
    resumes_on_four_ranks(&dir, 0, 0);
    let start = initial();
    let refused = Accelerator::builder()
        .launch(3, |acc| {
            let _run = setup(&acc, &start)?;
            acc.load_state(Some(&dir)).map(|_| ())
        })
        .unwrap_err()
        .to_string();
    for part in [
        "items per step over all ranks 16 when saved on 2 rank(s), 24 now on 3",
        "16 items do not divide among 3 ranks",
    ] {
        assert!(refused.contains(part), "{refused}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Loader workers change neither the samples nor a resize: a state saved by 2 ranks whose loaders have 3 worker
/// threads continues on 4 ranks with 2 workers each, as without workers.
#[test]
fn a_state_saved_with_loader_workers_continues_on_other_ranks_and_workers() {
    let dir = temp_dir("any-ranks-workers");
    resumes_on_four_ranks(&dir, 3, 2);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn automatic_naming_total_limit_and_iteration() {
    let dir = temp_dir("auto");
    let project = burn_accelerate::ProjectConfiguration::new(&dir).total_limit(2);
    let acc = Accelerator::builder()
        .project_configuration(project)
        .build()
        .unwrap();
    let model = acc.prepare_model(initial()).unwrap();
    let parts = StateToSave::new().model(&model).unwrap();
    for i in 0..4 {
        let saved = acc.save_state(None, &parts).unwrap();
        assert_eq!(
            saved,
            dir.join("checkpoints").join(format!("checkpoint_{i}"))
        );
    }
    let names: Vec<usize> = acc
        .project_configuration()
        .checkpoints()
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    assert_eq!(names, vec![2, 3], "the oldest are removed");
    // A fresh accelerator resumes the numbering after the checkpoint it loads.
    let project = burn_accelerate::ProjectConfiguration::new(&dir).total_limit(2);
    let fresh = Accelerator::builder()
        .project_configuration(project)
        .build()
        .unwrap();
    let mut state = fresh.load_state(None).unwrap();
    assert_eq!(state.iteration(), 3);
    let _ = state.model(initial()).unwrap();
    state.finish().unwrap();
    assert_eq!(fresh.project_configuration().iteration, 4);
    assert_eq!(
        fresh.save_state(None, &parts).unwrap(),
        dir.join("checkpoints").join("checkpoint_4"),
        "no collision with an existing checkpoint"
    );
}

#[test]
fn registered_objects_round_trip_and_must_match() {
    #[derive(serde::Serialize, serde::Deserialize, Default, Debug, PartialEq, Clone)]
    struct Stats {
        best: f64,
        history: Vec<u32>,
    }
    let dir = temp_dir("objects");
    let acc = Accelerator::new().unwrap();
    let stats = Arc::new(Mutex::new(Stats {
        best: 0.25,
        history: vec![1, 2, 3],
    }));
    let extra = Arc::new(Mutex::new(7u64));
    acc.register_for_checkpointing("stats", stats.clone())
        .unwrap();
    acc.register_for_checkpointing("extra", extra).unwrap();
    assert!(
        acc.register_for_checkpointing("stats", stats.clone())
            .is_err()
    );
    acc.save_state(Some(&dir), &StateToSave::new()).unwrap();

    let fresh = Accelerator::new().unwrap();
    let restored = Arc::new(Mutex::new(Stats::default()));
    fresh
        .register_for_checkpointing("stats", restored.clone())
        .unwrap();
    let err = fresh.load_state(Some(&dir)).err().unwrap().to_string();
    assert!(
        err.contains("extra") && err.contains("not registered"),
        "{err}"
    );

    let fresh = Accelerator::new().unwrap();
    let restored = Arc::new(Mutex::new(Stats::default()));
    let extra = Arc::new(Mutex::new(0u64));
    fresh
        .register_for_checkpointing("stats", restored.clone())
        .unwrap();
    fresh
        .register_for_checkpointing("extra", extra.clone())
        .unwrap();
    fresh.load_state(Some(&dir)).unwrap().finish().unwrap();
    assert_eq!(*restored.lock().unwrap(), *stats.lock().unwrap());
    assert_eq!(*extra.lock().unwrap(), 7);
}

#[test]
fn sharded_safetensors_follow_hugging_face_conventions() {
    let dir = temp_dir("shards");
    let acc = Accelerator::new().unwrap();
    let model = acc.prepare_model(initial()).unwrap();
    // The MLP has 16x64 + 64 + 64x1 + 1 floats; 2 KB shards give several files.
    let files = acc.save_model(&model, &dir, "2KB", true).unwrap();
    let shards: Vec<&PathBuf> = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    assert!(shards.len() >= 2, "{files:?}");
    let n = shards.len();
    for (i, f) in shards.iter().enumerate() {
        assert_eq!(
            f.file_name().unwrap().to_string_lossy(),
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        );
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let total: u64 = (16 * 64 + 64 + 64 + 1) * 4;
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    let mut names: Vec<&String> = map.keys().collect();
    names.sort();
    assert_eq!(
        names,
        vec!["input.bias", "input.weight", "output.bias", "output.weight"]
    );

    if let Some(python) = python::python_with(&["numpy", "safetensors.numpy"]) {
        // Python's own safetensors reader: every name, shape and value, which must be Burn's weights in
        // PyTorch's layout (Linear weights transposed to [out, in]).
        let script = format!(
            r#"
import json, os, numpy, safetensors.numpy as st
d = {dir:?}
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
total = 0
out = {{}}
for name, file in index["weight_map"].items():
    t = st.load_file(os.path.join(d, file))[name]
    assert t.dtype == numpy.float32, t.dtype
    total += t.nbytes
    out[name] = {{"shape": list(t.shape), "values": t.flatten().tolist()}}
assert total == index["metadata"]["total_size"], (total, index["metadata"])
print(json.dumps(out))
"#
        );
        let out = Command::new(python).args(["-c", &script]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let burn = weights(&model);
        let transpose = |v: &[f32], rows: usize, cols: usize| -> Vec<f32> {
            assert_eq!(v.len(), rows * cols);
            (0..cols)
                .flat_map(|c| (0..rows).map(move |r| v[r * cols + c]))
                .collect()
        };
        let expected: [(&str, Vec<u64>, Vec<f32>); 4] = [
            ("input.weight", vec![64, 16], transpose(&burn[0], 16, 64)),
            ("input.bias", vec![64], burn[1].clone()),
            ("output.weight", vec![1, 64], transpose(&burn[2], 64, 1)),
            ("output.bias", vec![1], burn[3].clone()),
        ];
        assert_eq!(seen.as_object().unwrap().len(), expected.len(), "{seen}");
        for (name, shape, values) in expected {
            let entry = &seen[name];
            let got_shape: Vec<u64> = serde_json::from_value(entry["shape"].clone()).unwrap();
            assert_eq!(got_shape, shape, "{name}");
            let got: Vec<f32> = serde_json::from_value(entry["values"].clone()).unwrap();
            assert_eq!(got.len(), values.len(), "{name}");
            // Bit for bit: f32 values survive JSON as doubles.
            assert!(
                got.iter()
                    .zip(&values)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: Python reads other values"
            );
        }
    }

    // Round trip: identical outputs.
    let (loaded, report) = acc
        .load_checkpoint_in_model(
            acc.prepare_model(Mlp::new(&Device::default())).unwrap(),
            &dir,
            &LoadOptions {
                strict: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(report, Default::default());
    let x = SampleBatcher.batch(mlp::samples(8, 1), acc.device());
    assert_eq!(
        model
            .forward(x.x.clone())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap(),
        loaded.forward(x.x).into_data().try_to_vec::<f32>().unwrap()
    );
    // Loaded weights still train: they are the model's parameters, with gradients.
    let loss = loaded.loss(SampleBatcher.batch(mlp::samples(8, 2), acc.device()));
    acc.backward(loss, &loaded).unwrap();

    // A second save with large shards removes the stale shards and index.
    acc.save_model(&model, &dir, "10GB", true).unwrap();
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    left.sort();
    assert_eq!(left, vec!["model.safetensors"]);

    // Burn's own format keeps parameter ids.
    let files = acc
        .save_model(&model, dir.join("burnpack"), "10GB", false)
        .unwrap();
    assert_eq!(files, vec![dir.join("burnpack").join("model.bpk")]);
    let record = burn::store::ModuleRecord::load(&files[0]).unwrap();
    let reloaded = Mlp::new(&Device::default())
        .try_load_record(record)
        .unwrap();
    assert_eq!(weights(&reloaded), weights(&model));

    // dtype cast on load.
    let (half, _) = acc
        .load_checkpoint_in_model(
            Mlp::new(&Device::default()),
            dir.join("model.safetensors"),
            &LoadOptions {
                dtype: Some(DType::BF16),
                ..Default::default()
            },
        )
        .unwrap();
    struct Dtypes(Vec<DType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().dtype());
        }
    }
    let mut d = Dtypes(Vec::new());
    half.visit(&mut d);
    assert!(d.0.iter().all(|t| *t == DType::BF16));
}

#[test]
fn bad_checkpoints_give_clear_errors() {
    let dir = temp_dir("bad");
    let acc = Accelerator::new().unwrap();
    let model = acc.prepare_model(initial()).unwrap();
    let options = LoadOptions::default();
    let load = |path: &Path| {
        acc.load_checkpoint_in_model(Mlp::new(&Device::default()), path, &options)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };

    // Truncated file.
    acc.save_model(&model, dir.join("single"), "10GB", true)
        .unwrap();
    let file = dir.join("single").join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(&file);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated or corrupt"),
        "{err}"
    );

    // Flipped bytes in the header.
    let mut flipped = bytes.clone();
    for b in &mut flipped[8..40] {
        *b ^= 0xff;
    }
    std::fs::write(&file, &flipped).unwrap();
    assert!(
        load(&file).contains("truncated or corrupt"),
        "{}",
        load(&file)
    );

    // Missing shard.
    acc.save_model(&model, dir.join("sharded"), "2KB", true)
        .unwrap();
    std::fs::remove_file(dir.join("sharded").join("model-00001-of-00003.safetensors"))
        .or_else(|_| {
            std::fs::remove_file(dir.join("sharded").join("model-00001-of-00002.safetensors"))
        })
        .unwrap();
    let err = load(&dir.join("sharded"));
    assert!(
        err.contains("model-00001-of") && err.contains("reading"),
        "{err}"
    );

    // Wrong shapes: a wider model.
    std::fs::write(&file, &bytes).unwrap();
    #[derive(Module, Debug)]
    struct Other {
        input: burn::nn::Linear,
    }
    let other = Other {
        input: burn::nn::LinearConfig::new(mlp::FEATURES, 8).init(&Device::default()),
    };
    let err = acc
        .load_checkpoint_in_model(other, &file, &options)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("input.weight") && err.contains("shape") && err.contains("model.safetensors"),
        "{err}"
    );

    // Unknown and missing keys: reported, or an error when strict.
    #[derive(Module, Debug)]
    struct Part {
        output: burn::nn::Linear,
        extra: burn::nn::Linear,
    }
    let part = Part {
        output: burn::nn::LinearConfig::new(mlp::HIDDEN, 1).init(&Device::default()),
        extra: burn::nn::LinearConfig::new(2, 2).init(&Device::default()),
    };
    let (_, report) = acc
        .load_checkpoint_in_model(part.clone(), &file, &options)
        .unwrap();
    assert_eq!(report.missing, vec!["extra.weight", "extra.bias"]);
    assert_eq!(report.unexpected, vec!["input.bias", "input.weight"]);
    let strict = LoadOptions {
        strict: true,
        ..Default::default()
    };
    let err = acc
        .load_checkpoint_in_model(part, &file, &strict)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("strict") && err.contains("extra.weight"),
        "{err}"
    );

    // A folder that is not a checkpoint, and a state saved with a model the loader does not restore.
    assert!(
        acc.load_state(Some(&dir.join("single")))
            .err()
            .unwrap()
            .to_string()
            .contains("checkpoint.json")
    );
    let state_dir = dir.join("state");
    acc.save_state(Some(&state_dir), &StateToSave::new().model(&model).unwrap())
        .unwrap();
    let err = acc
        .load_state(Some(&state_dir))
        .unwrap()
        .finish()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("1 model(s) but 0 were restored"), "{err}");
    // A corrupt model record.
    std::fs::write(state_dir.join("model.bpk"), b"not a record").unwrap();
    let model_error = || {
        acc.load_state(Some(&state_dir))
            .unwrap()
            .model(initial())
            .err()
            .unwrap()
            .to_string()
    };
    let err = model_error();
    assert!(
        err.contains("model.bpk") && err.contains("CRC-32C") && err.contains("restore the file"),
        "{err}"
    );
    // The same file in a checkpoint without checksums (written before they were recorded): the record
    // itself is refused.
    let manifest = state_dir.join("checkpoint.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("checksums");
    std::fs::write(&manifest, serde_json::to_vec(&json).unwrap()).unwrap();
    let err = model_error();
    assert!(
        err.contains("model.bpk") && err.contains("not a model record"),
        "{err}"
    );
}

/// A small deterministic generator for kill delays.
fn delays(n: usize, seed: u64, max_ms: u64) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % max_ms
        })
        .collect()
}

/// Starts `command`, waits until its first checkpoint under `run` is complete, lets it go on for `ms` more,
/// then SIGKILLs it. Returns whether it was still running when killed (rather than already finished), and
/// everything it printed.
///
/// Waiting for the first checkpoint instead of a fixed delay from the start keeps every kill meaningful on a
/// machine of any speed.
fn kill_after_first_checkpoint(command: &mut Command, run: &Path, ms: u64) -> (bool, String) {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let printed = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let project = burn_accelerate::ProjectConfiguration::new(run);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while project.checkpoints().is_empty() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before its first checkpoint");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint after 120 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(ms));
    let running = child.try_wait().unwrap().is_none();
    let _ = child.kill(); // SIGKILL on Unix
    let _ = child.wait();
    (running, printed.join().unwrap())
}

#[test]
fn sigkill_during_saves_always_leaves_a_loadable_checkpoint() {
    let program = example("checkpointing");
    let dir = temp_dir("crash");
    let mut killed_while_saving = 0;
    for (i, ms) in delays(25, 0x9e3779b97f4a7c15, 400).into_iter().enumerate() {
        let run = dir.join(format!("run{i}"));
        // Saving after every step, the run spends nearly all its time in save_state.
        let mut command = Command::new(&program);
        command
            .args(["--project-dir"])
            .arg(&run)
            .args(["--save-every", "1", "--steps", "5000"]);
        let (running, printed) = kill_after_first_checkpoint(&mut command, &run, ms);
        if running {
            killed_while_saving += 1;
        }
        // The example prints `step=<n> saved=<dir>` once a save is complete (each line flushed).
        let last_reported: u64 = printed
            .lines()
            .filter_map(|l| l.strip_prefix("step=")?.split(' ').next()?.parse().ok())
            .max()
            .unwrap_or_else(|| panic!("run {i}: no save was reported:\n{printed}"));
        // The latest complete checkpoint loads entirely, into the example's objects: its loader (1000 items
        // in batches of 32, seed 11) is recorded in the checkpoint and checked by load_state.
        let acc = Accelerator::builder()
            .project_configuration(burn_accelerate::ProjectConfiguration::new(&run))
            .build()
            .unwrap();
        let model = acc.prepare_model(initial()).unwrap();
        let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 3e-3);
        let schedule = LinearLrSchedulerConfig::new(3e-3, 3e-4, 100)
            .init()
            .unwrap();
        let mut scheduler = acc.prepare_scheduler(schedule, &optimizer);
        let _loader = acc
            .prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(32)
                    .shuffle(11)
                    .build(mlp::dataset(1000, 3)),
            )
            .unwrap();
        let progress = Arc::new(Mutex::new(serde_json::Value::Null));
        acc.register_for_checkpointing("progress", progress.clone())
            .unwrap();
        let mut state = acc
            .load_state(None)
            .unwrap_or_else(|e| panic!("run {i} after {ms} ms: {e}"));
        state.model(model).unwrap();
        state.optimizer(&mut optimizer).unwrap();
        state.scheduler(&mut scheduler).unwrap();
        state.finish().unwrap();
        // Not just some checkpoint: the latest complete one, the last save reported or the next when the kill
        // fell between its completion and its line.
        let step = progress.lock().unwrap()["step"].as_u64().unwrap();
        assert!(
            step == last_reported || step == last_reported + 1,
            "run {i} after {ms} ms: loaded step {step}, the last reported complete save is step {last_reported}"
        );
    }
    assert!(
        killed_while_saving >= 20,
        "only {killed_while_saving} of 25 runs were still saving when killed"
    );
}

fn final_loss(out: std::process::Output) -> String {
    examples::result_lines(out, &["final_loss="])
        .pop()
        .expect("a final_loss line")
}

#[test]
fn killed_and_resumed_run_prints_the_uninterrupted_final_loss() {
    let program = example("checkpointing");
    let dir = temp_dir("kill-resume");
    let args = ["--save-every", "7", "--steps", "1000"];
    let start = std::time::Instant::now();
    let reference = final_loss(
        Command::new(&program)
            .arg("--project-dir")
            .arg(dir.join("reference"))
            .args(args)
            .output()
            .unwrap(),
    );
    // Kill points spread over most of an uninterrupted run's length. On a loaded machine the reference run can
    // take longer than the later ones, so a kill can come after a run ended: the span is halved after each such
    // run, and trials go on (up to 20) until 6 were made, 3 of them killed mid-run.
    let mut span_ms = (start.elapsed().as_millis() as u64 * 4 / 5).max(1);
    let (mut killed_mid_run, mut trials) = (0, 0);
    for (i, fraction) in delays(20, 42, 1000).into_iter().enumerate() {
        if trials >= 6 && killed_mid_run >= 3 {
            break;
        }
        let ms = span_ms * fraction / 1000;
        let run = dir.join(format!("run{i}"));
        let mut command = Command::new(&program);
        command.arg("--project-dir").arg(&run).args(args);
        trials += 1;
        if kill_after_first_checkpoint(&mut command, &run, ms).0 {
            killed_mid_run += 1;
        } else {
            span_ms = (span_ms / 2).max(1);
        }
        let resumed = final_loss(
            Command::new(&program)
                .arg("--project-dir")
                .arg(&run)
                .args(args)
                .arg("--resume")
                .output()
                .unwrap(),
        );
        assert_eq!(
            resumed, reference,
            "run {i} killed {ms} ms after its first checkpoint"
        );
    }
    assert!(
        killed_mid_run >= 3,
        "only {killed_mid_run} of {trials} runs were still training when killed"
    );
}

#[test]
fn the_loss_scaler_is_saved_and_restored() {
    let dir = temp_dir("scaler");
    let scaler = burn_accelerate::LossScaler {
        scale: 512.0,
        growth_tracker: 17,
        ..Default::default()
    };
    let acc = Accelerator::builder()
        .mixed_precision(burn_accelerate::MixedPrecision::Fp16)
        .build()
        .unwrap();
    acc.set_loss_scaler(scaler.clone()).unwrap();
    acc.save_state(Some(&dir), &StateToSave::new()).unwrap();
    let fresh = Accelerator::builder()
        .mixed_precision(burn_accelerate::MixedPrecision::Fp16)
        .build()
        .unwrap();
    assert_eq!(fresh.loss_scale(), Some(65536.0));
    fresh.load_state(Some(&dir)).unwrap().finish().unwrap();
    assert_eq!(fresh.loss_scaler(), Some(scaler));
}

#[test]
fn loading_the_latest_checkpoint_without_one_says_where_it_looked() {
    let dir = std::env::temp_dir().join(format!("ba-no-latest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let acc = Accelerator::builder()
        .project_configuration(burn_accelerate::ProjectConfiguration::new(&dir))
        .build()
        .unwrap();
    let message = acc
        .load_state(None)
        .expect_err("nothing to load")
        .to_string();
    let checkpoints = dir.join("checkpoints");
    assert!(
        message.contains(&format!(
            "no complete checkpoint in {}",
            checkpoints.display()
        )),
        "{message}"
    );
    assert!(!message.contains("Some("), "{message}");
    let without_project = Accelerator::new().unwrap();
    let message = without_project
        .load_state(None)
        .expect_err("nothing to load")
        .to_string();
    assert!(message.contains("no project folder is set"), "{message}");
    let _ = std::fs::remove_dir_all(&dir);
}
