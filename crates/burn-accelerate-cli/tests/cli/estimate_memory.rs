//! `burn-accelerate estimate-memory` on a generated checkpoint gives the hand-computed figures.

use std::collections::HashMap;
use std::process::Command;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

#[test]
fn figures_match_a_hand_computation() {
    let dir = std::env::temp_dir().join(format!("ba-estimate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("weights.safetensors");
    let (w, b, ids) = (vec![0u8; 1000 * 4], vec![0u8; 10 * 2], vec![0u8; 7 * 8]);
    let views: HashMap<String, TensorView> = [
        (
            "layer.weight",
            TensorView::new(Dtype::F32, vec![100, 10], &w).unwrap(),
        ),
        (
            "layer.bias",
            TensorView::new(Dtype::F16, vec![10], &b).unwrap(),
        ),
        (
            "token_ids",
            TensorView::new(Dtype::I64, vec![7], &ids).unwrap(),
        ),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v))
    .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();

    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
            .arg("estimate-memory")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json: serde_json::Value =
        serde_json::from_str(&run(&[file.to_str().unwrap(), "--json"])).unwrap();
    // 1,010 float parameters; f32 trains with 16 bytes each, bf16/fp16 with 18; the 7 ids add 56 bytes.
    assert_eq!(json["parameters"], 1017);
    assert_eq!(json["float_parameters"], 1010);
    assert_eq!(json["per_dtype"]["F16"]["bytes"], 20);
    let totals: Vec<u64> = json["training_with_adam"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["total"].as_u64().unwrap())
        .collect();
    assert_eq!(totals, vec![1010 * 16 + 56, 1010 * 18 + 56, 1010 * 18 + 56]);

    let table = run(&[file.to_str().unwrap()]);
    assert!(table.contains("| I64 | 7 | 56 B |"), "{table}");
    assert!(table.contains("| no |"), "{table}");

    let missing = Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
        .args(["estimate-memory", "/nonexistent/model.safetensors"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/model.safetensors"));
    std::fs::remove_dir_all(&dir).ok();
}
