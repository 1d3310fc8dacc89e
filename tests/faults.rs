//! Hostile or mistaken settings: each gives a clear error or works, never a panic, a hang or lost data.

use std::time::Duration;

use burn::tensor::Tensor;
use burn_accelerate::config::MAX_COLLECTIVE_TIMEOUT;
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
    let config = AcceleratorConfig {
        collective_timeout_secs: 1e20,
        ..AcceleratorConfig::default()
    };
    config.validate().unwrap();
    assert_eq!(config.collective_timeout(), MAX_COLLECTIVE_TIMEOUT);
    let config = AcceleratorConfig {
        collective_timeout_secs: 2.5,
        ..AcceleratorConfig::default()
    };
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
