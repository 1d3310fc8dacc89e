//! Hostile or mistaken settings: each gives a clear error or works, never a panic, a hang or lost data.

use crate::mlp;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Tensor;
use burn_accelerate::StateToSave;
use burn_accelerate::config::MAX_COLLECTIVE_TIMEOUT;
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{Accelerator, AcceleratorConfig, ProjectConfiguration, ReduceOp};

#[test]
fn an_unbounded_collective_timeout_is_capped_not_an_overflow() {
    // Duration::MAX used to overflow the collective's deadline (a panic on every rank).
    let sums = Accelerator::builder()
        .collective_timeout(Duration::MAX)
        .launch(2, |acc| {
            assert_eq!(acc.config().collective_timeout(), MAX_COLLECTIVE_TIMEOUT);
            let x = Tensor::<1>::from_floats([1.0], acc.device());
            Ok(acc.reduce(x, ReduceOp::Sum)?.into_scalar::<f32>())
        })
        .unwrap();
    assert_eq!(sums, vec![2.0, 2.0]);
    // ACCELERATE_COLLECTIVE_TIMEOUT=1e20 (seconds) resolves to the same cap.
    let mut config = AcceleratorConfig::default();
    config.distributed.collective_timeout_secs = 1e20;
    config.validate().unwrap();
    assert_eq!(config.collective_timeout(), MAX_COLLECTIVE_TIMEOUT);
    config.distributed.collective_timeout_secs = 2.5;
    assert_eq!(config.collective_timeout(), Duration::from_millis(2500));
}

#[test]
fn total_limit_zero_is_refused_before_anything_is_written_or_deleted() {
    let dir = std::env::temp_dir().join(format!("faults-total-limit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let err = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&dir).total_limit(0))
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("total_limit(0) would delete every checkpoint"),
        "{err}"
    );
    assert!(err.contains("keep at least 1"), "{err}");
    assert!(!dir.exists());
    // In-process ranks are refused the same way.
    let err = Accelerator::builder()
        .project_configuration(ProjectConfiguration::new(&dir).total_limit(0))
        .launch(2, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("total_limit(0)"), "{err}");
}

#[test]
fn an_index_naming_files_outside_its_folder_is_refused() {
    use burn::nn::{Linear, LinearConfig};
    use burn_accelerate::LoadOptions;

    let dir = std::env::temp_dir().join(format!("faults-index-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let acc = Accelerator::new().unwrap();
    let model: Linear = LinearConfig::new(64, 64).init(acc.device());
    acc.save_model(&model, &dir, "4KB", true).unwrap();
    let index_path = dir.join("model.safetensors.index.json");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let tensor = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    for hostile in [
        serde_json::json!("../model.safetensors"),
        serde_json::json!("/etc/hostname"),
        serde_json::json!("sub/model.safetensors"),
        serde_json::json!(7),
    ] {
        let mut bad = index.clone();
        bad["weight_map"][&tensor] = hostile.clone();
        std::fs::write(&index_path, serde_json::to_vec(&bad).unwrap()).unwrap();
        let fresh: Linear = LinearConfig::new(64, 64).init(acc.device());
        let err = acc
            .load_checkpoint_in_model(fresh, &dir, &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("gives tensor {tensor:?} the file {hostile}"))
                && err.contains("no `..`, not absolute"),
            "{hostile}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[cfg(unix)]
#[test]
fn symbolic_links_planted_at_temporary_names_are_never_written_through() {
    use burn::nn::{Linear, LinearConfig};
    use burn_accelerate::LoadOptions;

    let dir = std::env::temp_dir().join(format!("faults-symlink-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, b"keep me").unwrap();
    let out = dir.join("model");
    std::fs::create_dir_all(&out).unwrap();
    // The old fixed temporary names, and the first unique ones this process would pick.
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        let mut planted = vec![format!("{name}.partial")];
        planted.extend((0..64).map(|n| format!("{name}.partial.{}.{n}", std::process::id())));
        for link in planted {
            std::os::unix::fs::symlink(&victim, out.join(link)).unwrap();
        }
    }
    let acc = Accelerator::new().unwrap();
    let model: Linear = LinearConfig::new(8, 8).init(acc.device());
    acc.save_model(&model, &out, "10GB", true).unwrap();
    acc.save_model(&model, &out, "200B", true).unwrap(); // sharded: also writes the index
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    let fresh: Linear = LinearConfig::new(8, 8).init(acc.device());
    acc.load_checkpoint_in_model(fresh, &out, &LoadOptions::default())
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

fn state_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("faults-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A prepared loader of `items` items in batches of `batch`, shuffled with `seed`.
fn prepared_loader(
    acc: &Accelerator,
    items: usize,
    batch: usize,
    seed: u64,
) -> burn_accelerate::Result<burn_accelerate::data::PreparedDataLoader<mlp::Sample, mlp::Batch>> {
    acc.prepare_dataloader(
        DataLoaderBuilder::new(mlp::SampleBatcher)
            .batch_size(batch)
            .shuffle(seed)
            .build(mlp::dataset(items, 2)),
    )
}

/// A loop's objects: a model, an Adam optimizer after `steps` steps, and a prepared loader of `items` items in
/// batches of `batch`, shuffled with `seed`, left mid-epoch; saved into `dir` when `save`.
fn run_and_save(dir: &Path, items: usize, batch: usize, seed: u64) -> burn_accelerate::Result<()> {
    // A fresh accelerator each time: it remembers every dataloader prepared on it.
    let acc = &Accelerator::new()?;
    let mut model = acc.prepare_model(mlp::Mlp::new(acc.device()))?;
    // A typed optimizer (`build`, not `init`): the checkpoint records its kind.
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().build(), 1e-2);
    let loader = prepared_loader(acc, items, batch, seed)?;
    for batch in loader.iter().take(3) {
        let loss = model.loss(batch?);
        acc.backward(loss, &model)?;
        model = optimizer.step(model);
    }
    let parts = StateToSave::new().model(&model)?.optimizer(&optimizer)?;
    acc.save_state(Some(dir), &parts)?;
    Ok(())
}

/// Loads `dir` into a fresh loop with the given loader settings and `optimizer`; returns the first error.
fn load_into(
    dir: &Path,
    items: usize,
    batch: usize,
    seed: u64,
    optimizer: burn::optim::ModuleOptimizer,
) -> burn_accelerate::Result<()> {
    load_and_read(dir, items, batch, seed, optimizer).map(|_| ())
}

/// What a load restored: the model's weights and parameter ids, and the weights one more step makes of them
/// (which the optimizer state decides).
#[derive(Debug, PartialEq)]
struct Restored {
    weights: Vec<Vec<f32>>,
    ids: Vec<String>,
    stepped: Vec<Vec<f32>>,
}

/// How many values differ (bit for bit) between two weight sets of the same shape.
fn changed(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// [`load_into`], returning what the load restored (before the extra step).
fn load_and_read(
    dir: &Path,
    items: usize,
    batch: usize,
    seed: u64,
    optimizer: burn::optim::ModuleOptimizer,
) -> burn_accelerate::Result<Restored> {
    let acc = &Accelerator::new()?;
    let model = acc.prepare_model(mlp::Mlp::new(acc.device()))?;
    let mut optimizer = acc.prepare_optimizer(optimizer, 1e-2);
    let loader = prepared_loader(acc, items, batch, seed)?;
    let mut state = acc.load_state(Some(dir))?;
    let mut model = state.model(model)?;
    state.optimizer(&mut optimizer)?;
    state.finish()?;
    struct Ids(Vec<String>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0.push(param.id.to_string());
        }
    }
    let mut ids = Ids(Vec::new());
    burn::module::Module::visit(&model, &mut ids);
    let weights = mlp::weights(&model);
    // One more step: a restored state must also work, not only load.
    let batch = loader.iter().next().expect("a batch")?;
    let loss = model.loss(batch);
    acc.backward(loss, &model)?;
    model = optimizer.step(model);
    Ok(Restored {
        weights,
        ids: ids.0,
        stepped: mlp::weights(&model),
    })
}

#[test]
fn a_resume_with_another_dataset_batch_size_or_seed_is_refused_with_what_differs() {
    let dir = state_dir("mismatch");
    run_and_save(&dir, 100, 8, 5).unwrap();
    let adam = || AdamConfig::new().init();
    load_into(&dir, 100, 8, 5, adam()).unwrap();
    for (items, batch, seed, expected) in [
        (90, 8, 5, "dataset length 100 when saved, 90 now"),
        (100, 16, 5, "batch size 8 when saved, 16 now"),
        (100, 8, 6, "shuffle seed Some(5) when saved, Some(6) now"),
    ] {
        let err = load_into(&dir, items, batch, seed, adam())
            .unwrap_err()
            .to_string();
        assert!(err.contains("prepared dataloader #0 differs"), "{err}");
        assert!(err.contains(expected), "{err}");
    }
}

#[test]
fn another_optimizer_kind_is_refused_not_silently_reset() {
    let dir = state_dir("optimizer-kind");
    let acc = Accelerator::new().unwrap();
    run_and_save(&dir, 100, 8, 5).unwrap();
    // A typed optimizer: the recorded kinds differ.
    let model = acc.prepare_model(mlp::Mlp::new(acc.device())).unwrap();
    let mut sgd = acc.prepare_optimizer(SgdConfig::new().build(), 1e-2);
    let _loader = prepared_loader(&acc, 100, 8, 5).unwrap();
    let mut state = acc.load_state(Some(&dir)).unwrap();
    state.model(model).unwrap();
    let err = state.optimizer(&mut sgd).unwrap_err().to_string();
    assert!(
        err.contains(
            "holds the state of a `Adam` optimizer, but the prepared optimizer is a `Sgd`"
        ),
        "{err}"
    );
    // A type-erased optimizer (kind unknown): Burn would drop Adam's moments without a word; the count of
    // restored state tensors gives it away.
    let momentum = SgdConfig::new()
        .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
        .init();
    let err = load_into(&dir, 100, 8, 5, momentum)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("of which this optimizer could restore 0"),
        "{err}"
    );
}

/// Rewrites the JSON file `path` with `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, serde_json::to_vec(&value).unwrap()).unwrap();
}

#[test]
fn absurd_values_in_state_files_are_refused() {
    let adam = || AdamConfig::new().init();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: [(&str, &str, Edit, &str); 4] = [
        (
            "batch",
            "rank_0.json",
            Box::new(|v| v["dataloaders"][0]["batch"] = 1_000_000_000_000u64.into()),
            "after batch 1000000000000, but an epoch has 13 batches here",
        ),
        (
            "epoch",
            "rank_0.json",
            Box::new(|v| v["dataloaders"][0]["epoch"] = u64::MAX.into()),
            "the file was edited or is corrupt",
        ),
        (
            "iteration",
            "checkpoint.json",
            Box::new(|v| v["iteration"] = u64::MAX.into()),
            "cannot be continued",
        ),
        (
            "models",
            "checkpoint.json",
            Box::new(|v| v["models"] = u64::MAX.into()),
            "restore them all, in order",
        ),
    ];
    for (name, file, edit, expected) in cases {
        let dir = state_dir(&format!("absurd-{name}"));
        run_and_save(&dir, 100, 8, 5).unwrap();
        edit_json(&dir.join(file), edit);
        let err = load_into(&dir, 100, 8, 5, adam()).unwrap_err().to_string();
        assert!(err.contains(expected), "{name}: {err}");
    }
}

#[test]
fn corrupt_records_give_errors_never_panics() {
    let dir = state_dir("corrupt-records");
    run_and_save(&dir, 100, 8, 5).unwrap();
    let adam = || AdamConfig::new().init();
    let reference = load_and_read(&dir, 100, 8, 5, adam()).unwrap();
    let mut cases = 0;
    for file in ["optimizer.bpk", "model.bpk"] {
        let path = dir.join(file);
        let good = std::fs::read(&path).unwrap();
        // Truncations at many points, and every byte of the record's metadata (names, shapes, dtypes, offsets,
        // parameter ids: the first 2 KiB at most) flipped in turn.
        let len = good.len();
        let mut variants: Vec<(Option<usize>, Vec<u8>)> = (1..24)
            .map(|k| (None, good[..len * k / 24].to_vec()))
            .collect();
        for k in 0..len.min(2048) {
            let mut bad = good.clone();
            bad[k] ^= 0xa5;
            variants.push((Some(k), bad));
        }
        for (flipped, bad) in variants {
            std::fs::write(&path, &bad).unwrap();
            let result = std::panic::catch_unwind(|| load_and_read(&dir, 100, 8, 5, adam()));
            // Every corruption, in the metadata or in a tensor's values (the manifest's CRC-32C of the file
            // catches those), is an error naming the file; nothing loads wrong data, nothing panics.
            match result {
                Err(_) => panic!("{file}: loading a corrupt record panicked"),
                Ok(Err(e)) => assert!(e.to_string().contains(file), "{e}"),
                Ok(Ok(restored)) => panic!(
                    "{file}: the record {} loaded: {} weights and {} stepped values differ, ids kept: {}",
                    match flipped {
                        Some(k) => format!("with byte {k} flipped"),
                        None => format!("truncated to {} bytes", bad.len()),
                    },
                    changed(&restored.weights, &reference.weights),
                    changed(&restored.stepped, &reference.stepped),
                    restored.ids == reference.ids
                ),
            }
            cases += 1;
        }
        std::fs::write(&path, &good).unwrap();
    }
    load_into(&dir, 100, 8, 5, adam()).unwrap();
    assert!(cases > 2000, "{cases}");
}
