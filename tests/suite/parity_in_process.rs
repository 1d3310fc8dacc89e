//! In-process ranks against one process, value by value: every setting users combine with data parallelism
//! (plain, accumulation with a short last window, clipping by norm and by value, bf16 and fp16, uneven last
//! batches with `even_batches(false)`), each rank's final weights read back from the file it wrote. The same
//! comparison under `mpirun` is `tests/mpi/parity_mpi.rs`.

use crate::parity;

use parity::{CASES, check_cases_did_something, compare_case, run_local, scratch};

#[test]
fn in_process_ranks_end_with_the_weights_of_one_process_in_every_case() {
    let dir = scratch("in-process");
    let one = dir.join("p1");
    run_local(&one, &[]);
    check_cases_did_something(&one);
    for p in [2, 3] {
        let ranks = dir.join(format!("p{p}"));
        run_local(&ranks, &["--processes", &p.to_string()]);
        for (case, bound) in CASES {
            let diff = compare_case(&one, &ranks, p, case, bound);
            println!("in-process P={p} {case}: max |Δ| = {diff:e}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
