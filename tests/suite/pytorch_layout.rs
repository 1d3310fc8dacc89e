//! Weights shared with PyTorch and Hugging Face: a model with Conv1d, LayerNorm and Linear layers saved in
//! PyTorch's layout has torch's names and shapes and Burn's values under the documented conversions; a
//! checkpoint written the way PyTorch tools write it loads into the Burn module and gives numpy's outputs; Burn
//! round trips are exact in either layout; key remapping on save and load.

use crate::python;

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::nn::conv::{Conv1d, Conv1dConfig};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_accelerate::checkpoint::{KeyRemap, SaveOptions, WeightLayout};
use burn_accelerate::{Accelerator, LoadOptions};

/// The network of `tests/python/net.py`.
#[derive(Module, Debug)]
struct Net {
    conv: Conv1d,
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            conv: Conv1dConfig::new(2, 4, 3).init(device),
            norm: LayerNormConfig::new(24).with_epsilon(1e-5).init(device),
            fc1: LinearConfig::new(24, 16).init(device),
            fc2: LinearConfig::new(16, 3).init(device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<2> {
        let h: Tensor<2> = self.conv.forward(x).flatten(1, 2);
        self.fc2
            .forward(relu(self.fc1.forward(self.norm.forward(h))))
    }
}

/// PyTorch's names and shapes for `Net` (torch.nn.Conv1d / LayerNorm / Linear of the same sizes).
const TORCH_SHAPES: [(&str, &[usize]); 8] = [
    ("conv.bias", &[4]),
    ("conv.weight", &[4, 2, 3]),
    ("fc1.bias", &[16]),
    ("fc1.weight", &[16, 24]),
    ("fc2.bias", &[3]),
    ("fc2.weight", &[3, 16]),
    ("norm.bias", &[24]),
    ("norm.weight", &[24]),
];

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ba-torch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// Every float of the model, by parameter, in visiting order.
fn all_values(net: &Net) -> Vec<Vec<f32>> {
    vec![
        values(net.conv.weight.val()),
        values(net.conv.bias.as_ref().unwrap().val()),
        values(net.norm.gamma.val()),
        values(net.norm.beta.as_ref().unwrap().val()),
        values(net.fc1.weight.val()),
        values(net.fc1.bias.as_ref().unwrap().val()),
        values(net.fc2.weight.val()),
        values(net.fc2.bias.as_ref().unwrap().val()),
    ]
}

/// The tensors of a safetensors file: name -> (shape, f32 values).
fn read_file(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = TensorData::from_bytes_vec(
                view.data().to_vec(),
                view.shape().to_vec(),
                burn::tensor::DType::F32,
            );
            (
                name,
                view.shape().to_vec(),
                data.try_to_vec::<f32>().unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| values[r * cols + c]))
        .collect()
}

#[test]
fn pytorch_layout_has_torchs_names_shapes_and_burns_values() {
    let acc = Accelerator::new().unwrap();
    let net = Net::new(acc.device());
    let dir = temp_dir("save");
    acc.save_model(&net, &dir, "10GB", true).unwrap(); // PyTorch's layout is the default
    let saved = read_file(&dir.join("model.safetensors"));
    let names: Vec<(&str, &[usize])> = saved
        .iter()
        .map(|(n, s, _)| (n.as_str(), s.as_slice()))
        .collect();
    assert_eq!(names, TORCH_SHAPES.to_vec());
    let by_name = |n: &str| {
        saved
            .iter()
            .find(|(name, _, _)| name == n)
            .unwrap()
            .2
            .clone()
    };
    assert_eq!(
        by_name("fc1.weight"),
        transpose(&values(net.fc1.weight.val()), 24, 16)
    );
    assert_eq!(
        by_name("fc2.weight"),
        transpose(&values(net.fc2.weight.val()), 16, 3)
    );
    assert_eq!(by_name("norm.weight"), values(net.norm.gamma.val()));
    assert_eq!(
        by_name("norm.bias"),
        values(net.norm.beta.as_ref().unwrap().val())
    );
    assert_eq!(
        by_name("conv.weight"),
        values(net.conv.weight.val()),
        "convolutions share the layout"
    );

    // Round trips are exact in both layouts.
    for layout in [WeightLayout::PyTorch, WeightLayout::Burn] {
        let out = temp_dir(&format!("round-{}", layout.tag()));
        let options = SaveOptions {
            layout,
            ..SaveOptions::default()
        };
        acc.save_model_with(&net, &out, &options).unwrap();
        let strict = LoadOptions {
            strict: true,
            ..LoadOptions::default()
        };
        let (loaded, report) = acc
            .load_checkpoint_in_model(Net::new(acc.device()), &out, &strict)
            .unwrap();
        assert_eq!(all_values(&loaded), all_values(&net), "{layout:?}");
        assert!(
            report.missing.is_empty() && report.unexpected.is_empty(),
            "{report:?}"
        );
        std::fs::remove_dir_all(&out).ok();
    }

    // The Python cross-check (mandatory in CI): the same comparison, read by numpy.
    if let Some(py) = python::python_with(&["numpy", "safetensors.numpy"]) {
        let burn_dir = temp_dir("burn-layout");
        let options = SaveOptions {
            layout: WeightLayout::Burn,
            ..SaveOptions::default()
        };
        acc.save_model_with(&net, &burn_dir, &options).unwrap();
        let out = python::run(
            &py,
            "check_torch_layout.py",
            &[
                &dir.join("model.safetensors"),
                &burn_dir.join("model.safetensors"),
            ],
        );
        assert!(out.contains("torch layout ok: 8 tensors"), "{out}");
        std::fs::remove_dir_all(&burn_dir).ok();
    }

    // For the by-hand check with PyTorch (tests/python/torch_load_state_dict.py): keep the file and Burn's output.
    if let Ok(keep) = std::env::var("BURN_ACCELERATE_KEEP_DIR") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::copy(
            dir.join("model.safetensors"),
            keep.join("model.safetensors"),
        )
        .unwrap();
        let input: Vec<f32> = (0..32)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let x = Tensor::<3>::from_data(TensorData::new(input.clone(), [2, 2, 8]), acc.device());
        let json = serde_json::json!({"input": input, "shape": [2, 2, 8], "output": values(net.forward(x))});
        std::fs::write(keep.join("burn_output.json"), json.to_string()).unwrap();
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_written_like_pytorch_tools_do_gives_numpys_outputs() {
    let Some(py) = python::python_with(&["numpy", "safetensors.numpy"]) else {
        return;
    };
    let dir = temp_dir("from-numpy");
    python::run(&py, "write_torch_checkpoint.py", &[&dir]);
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let floats = |key: &str| -> Vec<f32> {
        expected[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    let acc = Accelerator::new().unwrap();
    // No layout is recorded in the file, so it is read as PyTorch's.
    let strict = LoadOptions {
        strict: true,
        ..LoadOptions::default()
    };
    let (net, _) = acc
        .load_checkpoint_in_model(Net::new(acc.device()), &dir, &strict)
        .unwrap();
    let x = Tensor::<3>::from_data(TensorData::new(floats("input"), [2, 2, 8]), acc.device());
    let got = values(net.forward(x));
    let want = floats("output");
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0.0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    eprintln!("max |burn - numpy| = {diff:.3e}");
    assert!(diff <= 1e-6, "max |burn - numpy| = {diff}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn key_remapping_on_save_and_load_is_reported() {
    let acc = Accelerator::new().unwrap();
    let net = Net::new(acc.device());
    let dir = temp_dir("remap");
    let options = SaveOptions {
        remap: KeyRemap::new().rule("^", "model.").unwrap(),
        max_shard_size: "1KB".into(), // sharded
        ..SaveOptions::default()
    };
    acc.save_model_with(&net, &dir, &options).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert!(
        index["weight_map"].get("model.fc1.weight").is_some(),
        "{index}"
    );

    // Without the remapping nothing matches; with it, everything does, and the report says what was renamed.
    let (_, report) = acc
        .load_checkpoint_in_model(Net::new(acc.device()), &dir, &LoadOptions::default())
        .unwrap();
    assert_eq!(report.missing.len(), 8, "{report:?}");
    let strip = LoadOptions {
        strict: true,
        remap: KeyRemap::new().strip_prefix("model.").unwrap(),
        ..LoadOptions::default()
    };
    let (loaded, report) = acc
        .load_checkpoint_in_model(Net::new(acc.device()), &dir, &strip)
        .unwrap();
    assert_eq!(all_values(&loaded), all_values(&net));
    assert_eq!(report.remapped.len(), 8);
    assert!(
        report
            .remapped
            .contains(&("model.norm.weight".to_string(), "norm.weight".to_string())),
        "{report:?}"
    );

    // A checkpoint loaded with the wrong layout is an error that says so, not silently transposed data.
    let wrong = LoadOptions {
        layout: Some(WeightLayout::Burn),
        ..strip
    };
    let err = acc
        .load_checkpoint_in_model(Net::new(acc.device()), &dir, &wrong)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layout"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn half_precision_weights_keep_their_dtype_in_pytorch_layout_and_cast_on_load() {
    use burn::tensor::DType;
    use safetensors::Dtype;
    let acc = Accelerator::new().unwrap();
    let net = Net::new(acc.device());
    let f32_dir = temp_dir("half-src");
    acc.save_model(&net, &f32_dir, "10GB", true).unwrap();
    for (dtype, stored) in [(DType::F16, Dtype::F16), (DType::BF16, Dtype::BF16)] {
        // A half-precision copy of the model (loaded with a cast), saved sharded in PyTorch's layout.
        let cast = LoadOptions {
            dtype: Some(dtype),
            ..LoadOptions::default()
        };
        let (half, _) = acc
            .load_checkpoint_in_model(Net::new(acc.device()), &f32_dir, &cast)
            .unwrap();
        assert_eq!(half.fc1.weight.val().dtype(), dtype);
        let dir = temp_dir(&format!("half-{dtype:?}"));
        acc.save_model(&half, &dir, "1KB", true).unwrap();
        let index: serde_json::Value = serde_json::from_slice(
            &std::fs::read(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let shard = index["weight_map"]["fc1.weight"]
            .as_str()
            .unwrap()
            .to_string();
        let bytes = std::fs::read(dir.join(shard)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let view = file.tensor("fc1.weight").unwrap();
        assert_eq!(
            (view.dtype(), view.shape()),
            (stored, &[16usize, 24][..]),
            "{dtype:?}"
        );
        // Back to f32 with a cast: within the half type's rounding of the original.
        let to_f32 = LoadOptions {
            dtype: Some(DType::F32),
            strict: true,
            ..LoadOptions::default()
        };
        let (back, _) = acc
            .load_checkpoint_in_model(Net::new(acc.device()), &dir, &to_f32)
            .unwrap();
        assert_eq!(back.fc1.weight.val().dtype(), DType::F32);
        let (a, b) = (values(back.fc1.weight.val()), values(net.fc1.weight.val()));
        assert_eq!(a.len(), b.len());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| ((x - y) / y.abs().max(1e-3)).abs())
            .fold(
                0.0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        assert!(worst < 1e-2, "{dtype:?}: relative error {worst}");
        std::fs::remove_dir_all(&dir).ok();
    }
    std::fs::remove_dir_all(&f32_dir).ok();
}
