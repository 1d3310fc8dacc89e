//! Bad input, fuzzed: every parser of outside data this crate reads — Accelerate's YAML and JSON config files, the
//! settings and launcher variables of the environment, safetensors weight files (their headers: lengths, dtypes,
//! shapes, offsets) and Hugging Face's sharded index, and a checkpoint folder (its manifest, rank and object
//! files, and its Burn records) — fed mutations of
//! valid seed files under an allocator that refuses any single allocation above max(64 MiB, 16 × the input).
//! Each input must be accepted or refused with an error that names the file; none may panic, allocate by an
//! untrusted length, or load a corrupted checkpoint as if it were whole.
//!
//! `BURN_ACCELERATE_FUZZ_ITERATIONS` sets the number of mutated inputs per target (default 3,000, a few seconds
//! each; CI's bounded run). The long run: `BURN_ACCELERATE_FUZZ_ITERATIONS=1000000 cargo test --release -p
//! burn-accelerate --test fuzz`.

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use burn_accelerate::checkpoint::safetensors::{load_weights, write_safetensors};
use burn_accelerate::checkpoint::{KeyRemap, LoadOptions, WeightLayout};
use burn_accelerate::distributed::cluster::LauncherVars;
use burn_accelerate::{Accelerator, AcceleratorConfig, StateToSave};
use burn_accelerate_fuzz::{LimitedAlloc, Scratch, Verdict, alias_bomb, iterations, run};

#[global_allocator]
static ALLOC: LimitedAlloc = LimitedAlloc;

/// Mutated inputs per target when `BURN_ACCELERATE_FUZZ_ITERATIONS` is not set.
const DEFAULT_ITERATIONS: u64 = 3_000;

/// A folder of this test's target, removed when dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("ba-fuzz-{name}"))
}

/// The verdict on an error: a refusal when its message names `path`, else a wrong answer.
fn names_file(error: impl std::fmt::Display, path: &Path) -> Verdict {
    let message = error.to_string();
    let file = path.display().to_string();
    let folder = path.parent().map(|p| p.display().to_string());
    if message.contains(&file) || folder.is_some_and(|f| message.contains(&f)) {
        Verdict::Refused
    } else {
        Verdict::Wrong(format!("the error does not name {file}: {message}"))
    }
}

#[test]
fn config_files() {
    let samples =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../burn-accelerate-cli/tests/configs");
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&samples)
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    seeds.push(
        br#"{"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "bf16",
"num_processes": 4, "gradient_accumulation_steps": 2, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}"#
            .to_vec(),
    );
    seeds.push(alias_bomb(6, 6));
    assert!(seeds.len() > 5, "the sample configs of the command's tests");
    let dir = scratch("config");
    let mut n = 0u64;
    let report = run(
        "config_files",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            n += 1;
            let file = dir.join(if n.is_multiple_of(2) {
                "config.json"
            } else {
                "config.yaml"
            });
            std::fs::write(&file, input).unwrap();
            let mut config = AcceleratorConfig::default();
            match config.apply_file(&file) {
                Err(e) => names_file(e, &file),
                // What the file says is checked as every setting is (its errors name the setting, not the file).
                Ok(()) => match config.validate() {
                    Ok(()) => Verdict::Accepted,
                    Err(e) if !e.to_string().is_empty() => Verdict::Refused,
                    Err(e) => Verdict::Wrong(format!("an empty error: {e:?}")),
                },
            }
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}

/// `NAME=value` lines as a lookup (unknown names are left out, as the process's other variables are).
fn variables(input: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(input)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.trim().to_string(), value.to_string()))
        .collect()
}

/// The variables as a lookup: the last value of `name`, trimmed, unset when empty (as the process's environment
/// is read).
fn lookup_in(vars: &[(String, String)], name: &str) -> Option<String> {
    vars.iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// The verdict on what a reader of `vars` returned: an error must name one of the variables.
fn names_a_variable<T>(result: burn_accelerate::Result<T>, vars: &[(String, String)]) -> Verdict {
    match result {
        Ok(_) => Verdict::Accepted,
        Err(e) => {
            let message = e.to_string();
            if vars.iter().any(|(name, _)| message.contains(name.as_str())) {
                Verdict::Refused
            } else {
                Verdict::Wrong(format!("the error names no variable: {message}"))
            }
        }
    }
}

#[test]
fn environment_settings() {
    let mut launched = AcceleratorConfig::default();
    launched.precision.mixed_precision = burn_accelerate::MixedPrecision::Bf16;
    launched.accumulation.gradient_accumulation_steps = 4;
    launched.distributed.sharding = burn_accelerate::ShardingStrategy::HybridShard;
    launched.distributed.dp_shard_size = Some(2);
    launched.memory.activation_checkpointing = true;
    let mut lines: Vec<String> = launched
        .launch_env()
        .into_iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    lines.extend(
        [
            "ACCELERATE_RESTART_COUNT=2",
            "TORCHELASTIC_RESTART_COUNT=1",
            "ACCELERATE_USE_FSDP=true",
            "FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP",
            "ACCELERATE_COLLECTIVE_TIMEOUT=30",
            "ACCELERATE_GRADIENT_TRANSPORT=host",
            "ACCELERATE_RESUME_FROM_LATEST=yes",
        ]
        .map(String::from),
    );
    let seeds = vec![
        lines.join("\n").into_bytes(),
        lines[..3].join("\n").into_bytes(),
    ];
    let report = run(
        "environment_settings",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            let vars = variables(input);
            let mut config = AcceleratorConfig::default();
            let read = config
                .apply_env_from(|name| lookup_in(&vars, name))
                .and_then(|()| config.validate());
            names_a_variable(read, &vars)
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}

#[test]
fn launcher_variables() {
    let seeds: Vec<Vec<u8>> = [
        "OMPI_COMM_WORLD_RANK=1\nOMPI_COMM_WORLD_SIZE=4\nOMPI_COMM_WORLD_LOCAL_RANK=1\nOMPI_COMM_WORLD_LOCAL_SIZE=2",
        "SLURM_PROCID=3\nSLURM_NTASKS=8\nSLURM_LOCALID=1\nSLURM_NTASKS_PER_NODE=4\nPMIX_RANK=3",
        "RANK=0\nWORLD_SIZE=2\nLOCAL_RANK=0\nLOCAL_WORLD_SIZE=2\nTORCHELASTIC_RUN_ID=x",
        "PMI_RANK=2\nPMI_SIZE=3\nMPI_LOCALRANKID=0",
    ]
    .map(|s| s.as_bytes().to_vec())
    .to_vec();
    let report = run(
        "launcher_variables",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            let vars = variables(input);
            let read = LauncherVars::from_lookup(|name| lookup_in(&vars, name));
            names_a_variable(read.map(|found| found.describe()), &vars)
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}

/// A small model whose weights the safetensors seeds hold.
#[derive(Module, Debug)]
struct Small {
    first: Linear,
    second: Linear,
}

fn small(device: &Device) -> Small {
    Small {
        first: LinearConfig::new(3, 4).init(device),
        second: LinearConfig::new(4, 2).init(device),
    }
}

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

#[test]
fn safetensors_weight_files_and_their_index() {
    let device = Device::default();
    let model = small(&device);
    let seeds_dir = scratch("safetensors-seeds");
    let mut seeds = Vec::new();
    for (i, layout) in [WeightLayout::Burn, WeightLayout::PyTorch]
        .into_iter()
        .enumerate()
    {
        let out = seeds_dir.join(format!("single-{i}"));
        let files = write_safetensors(&model, &out, u64::MAX, layout, &KeyRemap::new()).unwrap();
        seeds.push(std::fs::read(&files[0]).unwrap());
    }
    // A sharded save: its index, fuzzed with its shards left whole.
    let sharded = seeds_dir.join("sharded");
    let shards = write_safetensors(
        &model,
        &sharded,
        64,
        WeightLayout::PyTorch,
        &KeyRemap::new(),
    )
    .unwrap();
    assert!(shards.len() > 2, "{shards:?}");
    let index_name = "model.safetensors.index.json";
    let index = std::fs::read(sharded.join(index_name)).unwrap();

    let dir = scratch("safetensors");
    let single = dir.join("model.safetensors");
    let report = run(
        "safetensors",
        &seeds,
        iterations(DEFAULT_ITERATIONS),
        |input| {
            std::fs::write(&single, input).unwrap();
            match load_weights(small(&device), &single, &LoadOptions::default()) {
                Ok(_) => Verdict::Accepted,
                Err(e) => names_file(e, &single),
            }
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");

    let in_folder = dir.join("sharded");
    std::fs::create_dir_all(&in_folder).unwrap();
    for shard in &shards {
        if shard.file_name().is_some_and(|n| n != index_name) {
            std::fs::copy(shard, in_folder.join(shard.file_name().unwrap())).unwrap();
        }
    }
    let report = run(
        "safetensors_index",
        &[index],
        iterations(DEFAULT_ITERATIONS),
        |input| {
            std::fs::write(in_folder.join(index_name), input).unwrap();
            match load_weights(small(&device), &in_folder, &LoadOptions::default()) {
                Ok(_) => Verdict::Accepted,
                Err(e) => names_file(e, &in_folder.join(index_name)),
            }
        },
    );
    assert_eq!(report.failures, 0, "{report:?}");
}

/// Copies the files of `from` into a fresh `to`.
fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Each file of a checkpoint in turn replaced by a mutation of itself: the load fails naming the checkpoint, or
/// it restores exactly the weights that were saved (a mutation that changed nothing they depend on, such as the
/// spacing of a JSON file). A corrupted checkpoint never loads as if it were whole.
#[test]
fn a_checkpoint_folder() {
    let acc = Accelerator::new().unwrap();
    let device = acc.device().clone();
    let mut model = acc.prepare_model(small(&device)).unwrap();
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let x = Tensor::<2>::ones([2, 3], &device);
    let loss = model.second.forward(model.first.forward(x)).sum();
    acc.backward(loss, &model).unwrap();
    model = optimizer.try_step(model).unwrap();
    let saved = weights(&model);
    let good = scratch("checkpoint-good");
    let parts = StateToSave::new()
        .model(&model)
        .unwrap()
        .optimizer(&optimizer)
        .unwrap();
    acc.save_state(Some(&good), &parts).unwrap();
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&good)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    assert!(
        files.iter().any(|(n, _)| n == "checkpoint.json") && files.len() >= 4,
        "{:?}",
        files.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );

    let dir = scratch("checkpoint");
    for (name, bytes) in &files {
        let target = dir.join("state");
        let report = run(
            "checkpoint_file",
            std::slice::from_ref(bytes),
            iterations(DEFAULT_ITERATIONS) / files.len() as u64,
            |input| {
                copy_dir(&good, &target);
                std::fs::write(target.join(name), input).unwrap();
                let restored = acc.load_state(Some(&target)).and_then(|mut state| {
                    let model = state.model(small(&device))?;
                    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                    state.optimizer(&mut optimizer)?;
                    state.finish()?;
                    Ok(model)
                });
                match restored {
                    Err(e) => names_file(e, &target.join(name)),
                    Ok(model) if weights(&model) == saved => Verdict::Accepted,
                    Ok(_) => Verdict::Wrong(format!(
                        "{name}: a corrupted checkpoint loaded other weights"
                    )),
                }
            },
        );
        assert_eq!(report.failures, 0, "{name}: {report:?}");
    }
}
