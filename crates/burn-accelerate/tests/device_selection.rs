//! Device choice from the environment: `ACCELERATE_USE_CPU`, `BURN_DEVICE`, and bad values.
//! One test function, so that the environment changes run one after the other.

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

#[test]
fn environment_drives_the_device_choice() {
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

    if let Some(absent) = Backend::ALL.into_iter().find(|b| !b.is_compiled()) {
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
