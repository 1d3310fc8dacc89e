//! The collectives suite under `mpirun -np 2` and `-np 3` (feature `mpi`; needs Open MPI's `mpirun`).

use std::path::PathBuf;
use std::process::Command;

#[path = "support/examples.rs"]
mod examples;

use examples::{example, result_lines};

pub fn mpirun(np: usize, program: &PathBuf, args: &[&str]) -> std::process::Output {
    assert!(program.exists(), "{} is not built", program.display());
    Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ])
        .arg(program)
        .args(args)
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}

#[test]
fn collectives_suite_under_mpirun() {
    let program = example("mpi_collectives");
    for np in [2, 3] {
        let out = mpirun(np, &program, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "np={np}\n{stdout}\n{stderr}");
        for rank in 0..np {
            assert!(
                stdout.contains(&format!("suite passed on rank {rank} of {np}")),
                "np={np}\n{stdout}\n{stderr}"
            );
        }
    }
}

#[test]
fn a_rank_that_skips_a_collective_is_named_under_mpirun() {
    let program = example("mpi_collectives");
    let out = mpirun(3, &program, &["--skip"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("rank {rank} got after")))
            .unwrap_or_else(|| panic!("no error on rank {rank}:\n{stdout}"));
        assert!(line.contains("rank(s) [2] did not arrive"), "{line}");
        let secs: f64 = line["rank 0 got after ".len()..]
            .split('s')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            secs < 3.0,
            "the timeout is 1 s plus a short diagnosis: {line}"
        );
    }
    assert!(
        !out.status.success(),
        "the job is aborted after a timeout rather than left hanging"
    );
}

#[test]
fn data_parallel_example_under_mpirun_matches_one_process() {
    let program = example("data_parallel");
    let lines = |out| result_lines(out, &["final_loss=", "accuracy="]);
    let one = lines(
        Command::new(&program)
            .args(["--processes", "1"])
            .output()
            .unwrap(),
    );
    assert_eq!(one.len(), 2, "{one:?}");
    let two = lines(mpirun(2, &program, &[]));
    assert_eq!(
        two, one,
        "mpirun -np 2 prints the main process's result once"
    );
}

#[test]
fn hostfile_launch_works() {
    let dir = std::env::temp_dir().join(format!("ba-hostfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "localhost slots=3\n").unwrap();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--hostfile"])
        .arg(&hostfile)
        .args(["-np", "3"])
        .arg(example("mpi_collectives"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.matches("suite passed on rank").count(),
        3,
        "{stdout}"
    );
}
