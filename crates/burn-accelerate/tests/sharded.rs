//! Sharded training (`SHARD_GRAD_OP`, `FULL_SHARD`) on 2, 3 and 4 in-process ranks against the unsharded run of
//! the same ranks, value by value, in every case of the parity harness (accumulation, clipping, bf16, fp16 and
//! uneven batches included), and a sharded save / resume bit for bit. The same under `mpirun`, with a SIGKILL in
//! the middle, is in `tests/parity_mpi.rs`.

#[path = "support/isolation.rs"]
mod isolation;

#[path = "support/examples.rs"]
mod examples;
#[path = "support/parity.rs"]
mod parity;

use parity::{CASES, compare_sharded, report, run_local, scratch, weights};

#[test]
fn sharded_ranks_train_the_weights_of_unsharded_ranks_in_every_case() {
    let dir = scratch("sharded");
    for p in [2, 3, 4] {
        let procs = p.to_string();
        let unsharded = dir.join(format!("p{p}"));
        run_local(&unsharded, &["--processes", &procs]);
        for sharding in ["SHARD_GRAD_OP", "FULL_SHARD"] {
            let sharded = dir.join(format!("p{p}-{sharding}"));
            run_local(&sharded, &["--processes", &procs, "--sharding", sharding]);
            for (case, _) in CASES {
                let diff = compare_sharded(&unsharded, &sharded, p, case);
                println!("in-process P={p} {sharding} {case}: max |Δ| vs NO_SHARD = {diff:e}");
                assert_eq!(report(&sharded, case, 0)["sharding"], sharding);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_sharded_state_saved_mid_run_resumes_bit_for_bit() {
    let dir = scratch("sharded-resume");
    for sharding in ["SHARD_GRAD_OP", "FULL_SHARD"] {
        let whole = dir.join(format!("whole-{sharding}"));
        let args = [
            "--processes",
            "3",
            "--sharding",
            sharding,
            "--case",
            "resume",
        ];
        // Saves after step 10 and trains on to step 21.
        run_local(&whole, &args);
        let state = whole.join("resume-state");
        for rank in 0..3 {
            assert!(
                state.join(format!("optimizer_rank{rank}.bpk")).is_file(),
                "{sharding}"
            );
            let model = state.join(format!("model_rank{rank}.bpk"));
            assert_eq!(
                model.is_file(),
                sharding == "FULL_SHARD",
                "{sharding}: {}",
                model.display()
            );
        }
        // Resumed from that state, in a new process.
        let resumed = dir.join(format!("resumed-{sharding}"));
        std::fs::create_dir_all(&resumed).unwrap();
        copy_dir(&state, &resumed.join("resume-state"));
        run_local(&resumed, &[&args[..], &["--resume"]].concat());
        for rank in 0..3 {
            let file = format!("rank{rank}.safetensors");
            assert_eq!(
                weights(&resumed.join("resume").join(&file)),
                weights(&whole.join("resume").join(&file)),
                "{sharding}, rank {rank}: resumed weights differ from the uninterrupted run"
            );
            let counted = report(&resumed, "resume", rank);
            assert_eq!(counted["resumed_at"], 10, "{sharding}, rank {rank}");
            assert_eq!(
                counted["steps"], 11,
                "{sharding}, rank {rank}: steps 11 to 21"
            );
        }
        // The same state on 2 ranks is refused, naming both sizes.
        let out = std::process::Command::new(parity::harness())
            .arg("--out")
            .arg(&resumed)
            .args([
                "--processes",
                "2",
                "--sharding",
                sharding,
                "--case",
                "resume",
                "--resume",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("saved by 3 ranks, loaded by 2"), "{text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}
