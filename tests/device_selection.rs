//! Settings from the environment: the device choice (`ACCELERATE_USE_CPU`, `BURN_DEVICE`), a launcher's restart
//! count and the resume request, and bad values. One test function per environment change sequence, run one
//! after the other (the second waits for the first through a lock).

#[path = "support/isolation.rs"]
mod isolation;

use burn_accelerate::{Accelerator, Backend, Error};

fn set(key: &str, value: Option<&str>) {
    // SAFETY: this test binary runs a single test function; nothing else reads the environment meanwhile.
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}

/// The environment is one for the whole process: the tests take turns.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn environment_drives_the_device_choice() {
    let _turn = ENV.lock().unwrap_or_else(|p| p.into_inner());
    set("BURN_DEVICE", None);
    set("ACCELERATE_USE_CPU", Some("yes"));
    let accelerator = Accelerator::new().expect("a CPU backend is compiled in");
    assert_eq!(
        accelerator.process_group().backend().map(Backend::is_cpu),
        Some(true)
    );

    set("ACCELERATE_USE_CPU", Some("sometimes"));
    let err = Accelerator::new().unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert!(err.to_string().contains("ACCELERATE_USE_CPU"), "{err}");
    set("ACCELERATE_USE_CPU", None);

    set("BURN_DEVICE", Some("quantum"));
    let err = Accelerator::new().unwrap_err().to_string();
    assert!(err.contains("BURN_DEVICE") && err.contains("flex"), "{err}");

    // No build compiles every backend in (Metal and CUDA do not build on the same machine).
    let absent = Backend::ALL.into_iter().find(|b| !b.is_compiled());
    {
        let absent = absent.expect("a backend that is not compiled in");
        set("BURN_DEVICE", Some(absent.feature()));
        let err = Accelerator::new().unwrap_err();
        assert!(matches!(err, Error::BackendNotCompiled { .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("feature `{}`", absent.feature())),
            "{err}"
        );
    }

    let present = Backend::compiled()[0];
    set("BURN_DEVICE", Some(present.feature()));
    let accelerator = Accelerator::new().unwrap();
    assert_eq!(accelerator.process_group().backend(), Some(present));

    set("BURN_DEVICE", None);
    set("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", Some("0"));
    let err = Accelerator::new().unwrap_err().to_string();
    assert!(err.contains("gradient_accumulation_steps"), "{err}");
    set("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", None);

    let accelerator = Accelerator::builder().backend(present).build().unwrap();
    assert_eq!(accelerator.num_processes(), 1);
    assert!(accelerator.is_main_process() && accelerator.is_local_main_process());
    assert_eq!(accelerator.distributed_type().as_str(), "NO");
    assert_eq!(accelerator.main_process_first(|| 7).unwrap(), 7);
    accelerator.wait_for_everyone().unwrap();
}

#[test]
fn a_restarted_job_resumes_from_its_latest_checkpoint_on_every_rank() {
    let _turn = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("restart-env-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let project = burn_accelerate::ProjectConfiguration::new(&dir);
    let builder = Accelerator::builder().project_configuration(project);
    let resumed_dirs = |builder: burn_accelerate::AcceleratorBuilder| {
        builder
            .launch(2, |acc| {
                let state = acc.resume()?;
                let dir = state.as_ref().map(|s| s.dir().to_path_buf());
                if let Some(state) = state {
                    state.finish()?;
                }
                Ok((acc.restart_count(), dir))
            })
            .unwrap()
    };
    // A first run neither resumes nor fails without a checkpoint; neither does a restart before the first save.
    assert_eq!(resumed_dirs(builder.clone()), vec![(0, None), (0, None)]);
    set("ACCELERATE_RESTART_COUNT", Some("2"));
    assert_eq!(resumed_dirs(builder.clone()), vec![(2, None), (2, None)]);
    builder
        .clone()
        .launch(2, |acc| {
            acc.save_state(None, &burn_accelerate::StateToSave::new())?;
            acc.save_state(None, &burn_accelerate::StateToSave::new())
        })
        .unwrap();
    // An interrupted save's leftovers are never resumed from.
    std::fs::create_dir_all(dir.join("checkpoints/checkpoint_2.partial")).unwrap();
    let latest = Some(dir.join("checkpoints/checkpoint_1"));
    assert_eq!(
        resumed_dirs(builder.clone()),
        vec![(2, latest.clone()), (2, latest.clone())]
    );
    // torchrun's variable counts too; ours wins when both are set.
    set("ACCELERATE_RESTART_COUNT", None);
    set("TORCHELASTIC_RESTART_COUNT", Some("1"));
    assert_eq!(
        resumed_dirs(builder.clone()),
        vec![(1, latest.clone()), (1, latest.clone())]
    );
    set("ACCELERATE_RESTART_COUNT", Some("3"));
    assert_eq!(
        resumed_dirs(builder.clone()),
        vec![(3, latest.clone()), (3, latest.clone())]
    );
    set("ACCELERATE_RESTART_COUNT", None);
    set("TORCHELASTIC_RESTART_COUNT", None);
    // A first run that asks to resume, through the environment.
    set("ACCELERATE_RESUME_FROM_LATEST", Some("yes"));
    assert_eq!(
        resumed_dirs(builder.clone()),
        vec![(0, latest.clone()), (0, latest)]
    );
    // Asking to resume without a project folder is an error; a restart without one starts from scratch.
    let err = Accelerator::new()
        .unwrap()
        .resume()
        .unwrap_err()
        .to_string();
    assert!(err.contains("project_configuration"), "{err}");
    set("ACCELERATE_RESUME_FROM_LATEST", None);
    set("ACCELERATE_RESTART_COUNT", Some("1"));
    assert!(Accelerator::new().unwrap().resume().unwrap().is_none());
    set("ACCELERATE_RESTART_COUNT", Some("one"));
    let err = Accelerator::new().unwrap_err().to_string();
    assert!(err.contains("ACCELERATE_RESTART_COUNT"), "{err}");
    set("ACCELERATE_RESTART_COUNT", None);
    std::fs::remove_dir_all(&dir).ok();
}
