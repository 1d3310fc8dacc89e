//! Tests of the launch plan, the restart slots and the failure classification.

use super::{hostfile_slots, processes_for_restart, threads_per_process};

#[test]
fn a_restart_runs_on_the_slots_the_hostfile_offers_within_the_bounds() {
    let dir = std::env::temp_dir().join(format!("ba-hostfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hosts = dir.join("hosts");
    let write = |text: &str| std::fs::write(&hosts, text).unwrap();
    write("# two machines\nnode1 slots=2\n\nnode2 slots=1 max_slots=4\n");
    assert_eq!(hostfile_slots(&hosts).unwrap(), Some(3));
    assert_eq!(processes_for_restart(3, 3, 2, &hosts), Ok(3));
    write("node1 slots=2\n");
    assert_eq!(
        processes_for_restart(3, 3, 2, &hosts),
        Ok(2),
        "a machine lost"
    );
    write("node1 slots=8\n");
    assert_eq!(
        processes_for_restart(3, 2, 2, &hosts),
        Ok(3),
        "never past --num-processes"
    );
    write("node1 slots=1\n");
    let err = processes_for_restart(3, 3, 2, &hosts).unwrap_err();
    assert!(
        err.contains("offers 1 slot(s), fewer than --min-processes 2"),
        "{err}"
    );
    write("node1\nnode2 slots=2\n");
    assert_eq!(hostfile_slots(&hosts).unwrap(), None, "slots unknown");
    assert_eq!(
        processes_for_restart(3, 3, 2, &hosts),
        Ok(3),
        "unknown slots change nothing"
    );
    write("node1 slots=two\n");
    assert!(hostfile_slots(&hosts).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn each_local_process_gets_its_share_of_the_cores_unless_told_otherwise() {
    let split = |flag, set: Option<(&'static str, String)>, np, nm| {
        threads_per_process(flag, set, (8, np, nm))
            .unwrap()
            .map(|(n, _)| n)
    };
    assert_eq!(split(None, None, 2, 1), Some(4));
    assert_eq!(split(None, None, 3, 1), Some(2), "8 cores / 3 rounds down");
    assert_eq!(split(None, None, 16, 1), Some(1), "never 0");
    assert_eq!(split(None, None, 8, 2), Some(2), "4 per machine");
    assert_eq!(
        split(None, None, 1, 1),
        None,
        "one process keeps every core"
    );
    assert_eq!(split(Some(3), None, 2, 1), Some(3), "the flag wins");
    let mine = Some(("OMP_NUM_THREADS", "6".to_string()));
    assert_eq!(
        split(None, mine.clone(), 2, 1),
        None,
        "the user's variable passes through"
    );
    assert_eq!(split(Some(2), mine, 2, 1), Some(2));
    let (_, source) = threads_per_process(None, None, (2, 2, 1)).unwrap().unwrap();
    assert_eq!(source, "2 cores / 2 processes per machine");
    assert!(threads_per_process(Some(0), None, (8, 2, 1)).is_err());
}

#[test]
fn open_mpis_report_of_a_dead_rank_is_read() {
    let line =
        "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).";
    assert_eq!(
        super::rank_death(line),
        Some((1, "exited on signal 9 (Killed)".to_string()))
    );
    assert_eq!(super::rank_death("Primary job  terminated normally"), None);
}

#[test]
fn a_rank_error_of_its_own_outranks_the_timeouts_and_deaths_it_caused() {
    use super::{MpirunSaw, RankReport, classify, parse_report};
    use crate::restart::Failure;
    let timeout = parse_report(0, "70 collective-timeout\n").unwrap();
    assert!(timeout.timed_out);
    let own = parse_report(2, "1").unwrap();
    assert_eq!(
        own,
        RankReport {
            rank: 2,
            status: 1,
            timed_out: false,
            said: None,
        }
    );
    assert_eq!(parse_report(1, "garbage"), None);
    let died = MpirunSaw {
        died: Some((1, "exited on signal 9 (Killed)".to_string())),
        returned_non_zero: false,
    };
    let another = parse_report(3, "4").unwrap();
    assert_eq!(
        classify(&[timeout.clone(), own, another], &died, 1),
        Failure::Error {
            rank: Some(2),
            status: 1,
            others: vec![(3, 4)],
            said: None,
        }
    );
    assert_eq!(
        classify(&[timeout], &died, 70),
        Failure::Timeout { rank: 0, code: 70 }
    );
    assert!(matches!(
        classify(&[], &died, 137),
        Failure::Killed {
            rank: Some(1),
            code: 137,
            ..
        }
    ));
    let nothing = MpirunSaw::default();
    assert_eq!(classify(&[], &nothing, 3), Failure::Unexplained { code: 3 });
}

#[test]
fn a_program_that_fails_before_reporting_is_its_own_error_unless_a_signal_ended_it() {
    use super::{MpirunSaw, classify, returned_non_zero};
    use crate::restart::Failure;
    // Open MPI's two lines when a process returns an error status by itself.
    assert!(returned_non_zero(
        "Primary job  terminated normally, but 1 process returned"
    ));
    assert!(!returned_non_zero(
        "a non-zero exit code. Per user-direction, the job has been aborted."
    ));
    let returned = MpirunSaw {
        died: None,
        returned_non_zero: true,
    };
    let own = classify(&[], &returned, 3);
    assert_eq!(
        own,
        Failure::Error {
            rank: None,
            status: 3,
            others: Vec::new(),
            said: None,
        }
    );
    assert!(!own.restartable(false) && own.restartable(true));
    // 137: a shell's SIGKILL, which a restart may cure.
    assert_eq!(
        classify(&[], &returned, 137),
        Failure::Unexplained { code: 137 }
    );
}

#[test]
fn a_failure_ends_with_what_the_rank_last_wrote() {
    use crate::restart::Failure;
    let mut report = super::parse_report(1, "1\n").unwrap();
    assert_eq!(report.said, None);
    report.said = Some("Error: rank 1 returns an error on purpose".into());
    let failure = super::classify(&[report], &super::MpirunSaw::default(), 1);
    assert_eq!(failure.to_string(), "rank 1 exited with status 1");
    assert_eq!(
        failure.last_words(),
        "\n  rank 1 last wrote:\n    Error: rank 1 returns an error on purpose"
    );
    assert!(matches!(failure, Failure::Error { said: Some(_), .. }));
}
