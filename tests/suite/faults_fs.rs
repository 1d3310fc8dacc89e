//! Filesystem faults for `save_state`, `save_model` and the loads: a full disk (`RLIMIT_FSIZE`), a folder the
//! process may not write, a bare relative path, leftovers of interrupted saves, two writers at once, a failure on
//! the main process with several ranks, and SIGKILL while `save_model` replaces a folder in place. Each gives a
//! clear error or succeeds, and the previous checkpoint always stays loadable.
//!
//! Cases that need another process (a resource limit, another user, another working folder, a kill) run this
//! test binary again as a child with `FAULTS_CHILD=<scenario>`: see [`child_process_entry`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::Device;
use burn_accelerate::{Accelerator, LoadOptions, StateToSave};

#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
    c: Linear,
}

/// A net whose every weight and bias equals `value` (so that a load shows which save it came from).
fn net(value: f64, device: &Device) -> Net {
    let layer = || {
        LinearConfig::new(64, 64)
            .with_initializer(Initializer::Constant { value })
            .init(device)
    };
    Net {
        a: layer(),
        b: layer(),
        c: layer(),
    }
}

/// Every parameter value of `net`, in order.
fn values(net: &Net) -> Vec<f32> {
    let mut all = Vec::new();
    for layer in [&net.a, &net.b, &net.c] {
        all.extend(layer.weight.val().into_data().try_to_vec::<f32>().unwrap());
        let bias = layer.bias.as_ref().expect("a bias");
        all.extend(bias.val().into_data().try_to_vec::<f32>().unwrap());
    }
    all
}

/// The single value every parameter of a model loaded from `dir` has; fails on a mix (or NaN).
fn loaded_model_value(acc: &Accelerator, dir: &Path) -> f32 {
    let options = LoadOptions {
        strict: true,
        ..LoadOptions::default()
    };
    let (model, _) = acc
        .load_checkpoint_in_model(net(0.0, acc.device()), dir, &options)
        .unwrap_or_else(|e| panic!("{} does not load: {e}", dir.display()));
    let v = values(&model);
    assert_eq!(v.len(), 3 * (64 * 64 + 64));
    assert!(
        v.iter().all(|x| *x == v[0]),
        "{}: the weights of several saves are mixed: {} distinct values",
        dir.display(),
        v.iter()
            .map(|x| x.to_bits())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
    v[0]
}

/// The single value of the model in the state checkpoint `dir`.
fn loaded_state_value(acc: &Accelerator, dir: &Path) -> f32 {
    let mut state = acc
        .load_state(Some(dir))
        .unwrap_or_else(|e| panic!("{} does not load: {e}", dir.display()));
    let model = state.model(net(0.0, acc.device())).unwrap();
    state.finish().unwrap();
    let v = values(&model);
    assert!(v.iter().all(|x| *x == v[0]), "mixed state weights");
    v[0]
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-faults-fs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Saves a state holding `net(value)` into `dir/state` and the same weights with `save_model` into `dir/model`.
fn save_both(
    acc: &Accelerator,
    dir: &Path,
    value: f64,
    shard: &str,
) -> burn_accelerate::Result<()> {
    let model = net(value, acc.device());
    acc.save_state(Some(&dir.join("state")), &StateToSave::new().model(&model)?)?;
    acc.save_model(&model, dir.join("model"), shard, true)?;
    Ok(())
}

/// The most a child run may take (its saves take milliseconds; a hang would take forever).
const CHILD_LIMIT: Duration = Duration::from_secs(60);

/// What a child run printed: its `child:` lines.
struct Child {
    lines: Vec<String>,
    status: std::process::ExitStatus,
}

/// The command that runs `scenario` in a child (this test binary again), through `wrapper` (e.g. a shell that
/// sets a limit) when it is not empty.
fn child_command(scenario: &str, dir: &Path, wrapper: &[&str]) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut command = if wrapper.is_empty() {
        Command::new(&exe)
    } else {
        let mut c = Command::new(wrapper[0]);
        c.args(&wrapper[1..]).arg(&exe);
        c
    };
    command
        .args([
            "--exact",
            "faults_fs::child_process_entry",
            "--ignored",
            "--nocapture",
        ])
        .args(["--test-threads", "1"])
        .env("FAULTS_CHILD", scenario)
        .env("FAULTS_DIR", dir)
        .env("HOME", std::env::temp_dir());
    command
}

/// Runs `scenario` in a child through `wrapper`, in the working folder `cwd` when given; returns its `child:`
/// lines, having checked that it took less than [`CHILD_LIMIT`].
fn child_in(scenario: &str, dir: &Path, wrapper: &[&str], cwd: Option<&Path>) -> Child {
    let mut command = child_command(scenario, dir, wrapper);
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    let start = Instant::now();
    let out = command.stderr(Stdio::inherit()).output().unwrap();
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("child: ").map(str::to_string))
        .collect();
    // Failing saves fail at once: no waiting on a lock, a collective or a retry.
    assert!(
        start.elapsed() < CHILD_LIMIT,
        "{scenario}: {:?}",
        start.elapsed()
    );
    Child {
        lines,
        status: out.status,
    }
}

/// [`child_in`] in this process's working folder.
fn child(scenario: &str, dir: &Path, wrapper: &[&str]) -> Child {
    child_in(scenario, dir, wrapper, None)
}

/// The child side: runs the scenario `FAULTS_CHILD` names and prints `child: ok` or `child: error: <message>`
/// for each operation. Not a test of its own: ignored in a normal run, started by the tests above with
/// `--ignored` and the scenario set.
#[test]
#[ignore = "the child side of the scenarios that need another process; they run it"]
fn child_process_entry() {
    let scenario = std::env::var_os("FAULTS_CHILD").expect(
        "FAULTS_CHILD names the scenario: the tests of this file start this entry themselves",
    );
    let dir = PathBuf::from(std::env::var_os("FAULTS_DIR").unwrap());
    // The test harness has printed `test child_process_entry ... ` without a line end.
    println!();
    let acc = Accelerator::new().unwrap();
    let report = |what: &str, result: burn_accelerate::Result<()>| match result {
        Ok(()) => println!("child: {what} ok"),
        Err(e) => println!("child: {what} error: {e}"),
    };
    match scenario.to_str().unwrap() {
        // Tries to replace the checkpoints of value 1 under `dir` with value 2.
        "replace" => {
            let model = net(2.0, acc.device());
            let parts = StateToSave::new().model(&model).unwrap();
            report(
                "save_state",
                acc.save_state(Some(&dir.join("state")), &parts).map(|_| ()),
            );
            report(
                "save_model",
                acc.save_model(&model, dir.join("model"), "10GB", true)
                    .map(|_| ()),
            );
            report(
                "save_model sharded",
                acc.save_model(&model, dir.join("model"), "20KB", true)
                    .map(|_| ()),
            );
        }
        // Saves and loads through bare relative paths (the working folder is `dir`).
        "relative" => {
            for value in [1.0, 2.0] {
                let model = net(value, acc.device());
                let parts = StateToSave::new().model(&model).unwrap();
                report(
                    "save_state",
                    acc.save_state(Some(Path::new("ckpt")), &parts).map(|_| ()),
                );
                report(
                    "save_model",
                    acc.save_model(&model, "model", "20KB", true).map(|_| ()),
                );
            }
            println!(
                "child: state {}",
                loaded_state_value(&acc, Path::new("ckpt"))
            );
            println!(
                "child: model {}",
                loaded_model_value(&acc, Path::new("model"))
            );
        }
        // Replaces `dir/model` in place forever, each sharding twice in a row (one file, 7 shards, 3 shards), so
        // that kills land in every kind of replacement: one file by one file, one file by shards, shards by
        // shards of the same names, shards by other shards, shards by one file.
        "save_model_loop" => {
            let shards = ["10GB", "8KB", "20KB"];
            for generation in 1u32.. {
                let model = net(generation as f64, acc.device());
                let shard = shards[(generation as usize / 2) % 3];
                acc.save_model(&model, dir.join("model"), shard, true)
                    .unwrap();
                println!("child: saved {generation}");
            }
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn error_of<'a>(child: &'a Child, what: &str) -> &'a str {
    let prefix = format!("{what} error: ");
    child
        .lines
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("`{what}` did not fail: {:?}", child.lines))
}

#[test]
fn a_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint() {
    let dir = temp_dir("full");
    let acc = Accelerator::new().unwrap();
    save_both(&acc, &dir, 1.0, "10GB").unwrap();
    // A 16 KiB file-size limit: a 50 KB model cannot be written. SIGXFSZ is ignored, as a disk-full error
    // (EFBIG/ENOSPC) then reaches the writer instead of killing it.
    let child = child(
        "replace",
        &dir,
        &[
            "bash",
            "-c",
            "trap '' XFSZ; ulimit -f 16; exec \"$0\" \"$@\"",
        ],
    );
    assert!(child.status.success(), "{:?}", child.lines);
    for what in ["save_state", "save_model", "save_model sharded"] {
        let err = error_of(&child, what);
        assert!(err.contains("File too large"), "{what}: {err}");
        assert!(
            err.contains(&dir.display().to_string()),
            "{what} names no path: {err}"
        );
    }
    assert_eq!(loaded_state_value(&acc, &dir.join("state")), 1.0);
    assert_eq!(loaded_model_value(&acc, &dir.join("model")), 1.0);
    // No temporary of the failed model saves is left in the model's folder.
    let names: Vec<String> = std::fs::read_dir(dir.join("model"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["model.safetensors".to_string()]);
    // And the next save, with room again, works and cleans up after the failed one.
    save_both(&acc, &dir, 3.0, "20KB").unwrap();
    assert_eq!(loaded_state_value(&acc, &dir.join("state")), 3.0);
    assert_eq!(loaded_model_value(&acc, &dir.join("model")), 3.0);
    assert!(!dir.join("state.partial").exists());
}

/// Makes `dir` unwritable for the child: another user when this runs as root (root writes anywhere), else
/// file permissions.
fn unwritable_wrapper(dir: &Path) -> Vec<&'static str> {
    use std::os::unix::fs::PermissionsExt;
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if root {
        vec![
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]
    } else {
        for d in [dir.to_path_buf(), dir.join("state"), dir.join("model")] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
        vec![]
    }
}

#[test]
fn an_unwritable_folder_gives_a_clear_error_and_keeps_the_previous_checkpoint() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("readonly");
    let acc = Accelerator::new().unwrap();
    save_both(&acc, &dir, 1.0, "20KB").unwrap();
    // Root-owned and 0755 (or 0555 for the same user): the child may read but not write.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let wrapper = unwritable_wrapper(&dir);
    let child = child("replace", &dir, &wrapper);
    for d in [dir.clone(), dir.join("state"), dir.join("model")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    assert!(child.status.success(), "{:?}", child.lines);
    for what in ["save_state", "save_model", "save_model sharded"] {
        let err = error_of(&child, what);
        assert!(err.contains("Permission denied"), "{what}: {err}");
        assert!(
            err.contains(&dir.display().to_string()),
            "{what} names no path: {err}"
        );
    }
    assert_eq!(loaded_state_value(&acc, &dir.join("state")), 1.0);
    assert_eq!(loaded_model_value(&acc, &dir.join("model")), 1.0);
}

#[test]
fn bare_relative_paths_save_and_load() {
    let dir = temp_dir("relative");
    let child = child_in("relative", &dir, &[], Some(&dir));
    assert!(child.status.success(), "{:?}", child.lines);
    assert_eq!(
        child.lines,
        vec![
            "save_state ok",
            "save_model ok",
            "save_state ok",
            "save_model ok",
            "state 2",
            "model 2"
        ]
    );
    assert!(dir.join("ckpt").join("checkpoint.json").exists());
    assert!(!dir.join("ckpt.old").exists() && !dir.join("ckpt.partial").exists());
}

#[test]
fn leftovers_of_interrupted_saves_are_cleared_and_never_loaded() {
    let dir = temp_dir("leftovers");
    let acc = Accelerator::new().unwrap();
    save_both(&acc, &dir, 1.0, "20KB").unwrap();
    // What saves killed at various points leave: an unfinished state folder, a previous state moved aside,
    // model temporaries and second names of replaced shards, with junk in them.
    std::fs::create_dir_all(dir.join("state.partial")).unwrap();
    std::fs::write(dir.join("state.partial/model.bpk"), b"junk").unwrap();
    std::fs::create_dir_all(dir.join("state.old")).unwrap();
    std::fs::write(dir.join("state.old/checkpoint.json"), b"junk").unwrap();
    for junk in [
        "model.safetensors.partial.999999.0",
        "model-00001-of-00003.safetensors.replaced",
        "model-00009-of-00009.safetensors",
    ] {
        std::fs::write(dir.join("model").join(junk), b"junk").unwrap();
    }
    // A link planted at the name the next state save writes to: removed, never followed.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::remove_dir_all(dir.join("state.partial")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.join("state.partial")).unwrap();
    // A user's own file in the model folder stays.
    std::fs::write(dir.join("model/config.json"), b"{}").unwrap();
    // The junk is never what loads.
    assert_eq!(loaded_state_value(&acc, &dir.join("state")), 1.0);
    assert_eq!(loaded_model_value(&acc, &dir.join("model")), 1.0);
    save_both(&acc, &dir, 2.0, "10GB").unwrap();
    assert_eq!(loaded_state_value(&acc, &dir.join("state")), 2.0);
    assert_eq!(loaded_model_value(&acc, &dir.join("model")), 2.0);
    assert!(!dir.join("state.partial").exists() && !dir.join("state.old").exists());
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "written through a link"
    );
    let mut names: Vec<String> = std::fs::read_dir(dir.join("model"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["config.json", "model.safetensors"]);
}

#[test]
fn two_writers_at_once_take_turns_and_leave_one_whole_checkpoint() {
    let dir = temp_dir("two-writers");
    let start = Instant::now();
    let writers: Vec<_> = [1.0, 2.0]
        .into_iter()
        .map(|value| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let acc = Accelerator::new().unwrap();
                for i in 0..8 {
                    let shard = if i % 2 == 0 { "10GB" } else { "20KB" };
                    save_both(&acc, &dir, value, shard).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert!(start.elapsed() < CHILD_LIMIT, "{:?}", start.elapsed());
    let acc = Accelerator::new().unwrap();
    let state = loaded_state_value(&acc, &dir.join("state"));
    let model = loaded_model_value(&acc, &dir.join("model"));
    assert!([1.0, 2.0].contains(&state) && [1.0, 2.0].contains(&model));
}

#[test]
fn a_failure_on_the_main_process_reaches_every_rank_at_once() {
    let dir = temp_dir("rank0");
    // A file where the checkpoint's folder should go: the main process cannot create it.
    std::fs::write(dir.join("blocked"), b"").unwrap();
    let target = dir.join("blocked").join("ckpt");
    let start = Instant::now();
    let errors = Accelerator::builder()
        .collective_timeout(Duration::from_secs(60))
        .launch(3, |acc| {
            let model = net(1.0, acc.device());
            let parts = StateToSave::new().model(&model)?;
            let state = acc
                .save_state(Some(&target), &parts)
                .unwrap_err()
                .to_string();
            let weights = acc
                .save_model(&model, &target, "10GB", true)
                .unwrap_err()
                .to_string();
            Ok((acc.process_index(), state, weights))
        })
        .unwrap();
    let elapsed = start.elapsed();
    // Released by rank 0's failure, not by the 60 s collective timeout (half of it leaves a loaded machine room).
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    for (rank, state, weights) in errors {
        for err in [&state, &weights] {
            if rank == 0 {
                assert!(err.contains("blocked"), "rank 0: {err}");
            } else {
                assert!(
                    err.contains("rank 0 failed, so every rank stops"),
                    "rank {rank}: {err}"
                );
                assert!(err.contains("blocked"), "rank {rank}: {err}");
            }
        }
    }
}

#[test]
fn sigkill_while_save_model_replaces_a_folder_never_mixes_weights() {
    let dir = temp_dir("kill-model");
    let acc = Accelerator::new().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for run in 0..30 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let delay = Duration::from_millis(state % 300);
        let mut child = child_command("save_model_loop", &dir, &[])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill only after a first save, so that there is a previous model to keep.
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with("child: saved") {
            line.clear();
            let n = std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
            assert!(n > 0, "run {run}: the child ended before its first save");
        }
        std::thread::sleep(delay);
        child.kill().unwrap();
        child.wait().unwrap();
        // The last save the child reported complete (it prints once the folder is in place, each line flushed).
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        let last_reported: u32 = line
            .lines()
            .chain(rest.lines())
            .filter_map(|l| l.strip_prefix("child: saved ")?.trim().parse().ok())
            .max()
            .unwrap();
        let value = loaded_model_value(&acc, &dir.join("model"));
        // The latest complete save: the last one reported, or the next when the kill fell between its
        // completion and its line.
        assert!(
            value == last_reported as f32 || value == (last_reported + 1) as f32,
            "run {run}: loaded generation {value}, the last reported complete save is {last_reported}"
        );
        seen.insert(value as u32 % 6);
    }
    // Kills landed in several of the six kinds of replacement (the generation a kill leaves tells which).
    assert!(seen.len() >= 3, "{seen:?}");
}
