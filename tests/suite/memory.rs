//! Out-of-memory batch-size search and memory estimates: Accelerate's retry sequence, halving, propagation of
//! other errors, the floor, ranks agreeing on every size, panicking backends, and `estimate-memory` figures
//! against a hand computation.

use crate::examples;

use std::collections::HashMap;
use std::sync::Mutex;

use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn_accelerate::memory::{
    BatchSizeError, BatchSizeFinder, ModelSize, Shrink, find_executable_batch_size,
};
use burn_accelerate::{Accelerator, Error, MixedPrecision};

/// The error a GPU backend's read gives when an allocation failed.
fn oom() -> Error {
    Error::Execution {
        operation: "check_step",
        device: "Vulkan(0)".into(),
        reason: "Several failures at once: The bytes were never written: can't allocate buffer of size: 1".into(),
    }
}

/// A step that runs out of memory above `fits` samples, recording each size it is called with.
fn step_fitting(
    fits: usize,
    tried: &Mutex<Vec<usize>>,
) -> impl FnMut(usize) -> Result<usize, Error> + '_ {
    move |batch_size| {
        tried.lock().unwrap().push(batch_size);
        if batch_size > fits {
            Err(oom())
        } else {
            Ok(batch_size)
        }
    }
}

#[test]
fn the_sequence_from_128_is_accelerates() {
    let tried = Mutex::new(Vec::new());
    let fitted = find_executable_batch_size(128, step_fitting(8, &tried)).unwrap();
    assert_eq!(fitted, 8);
    // Accelerate's tests/test_memory_utils.py, with `int(bs * 0.9)`.
    assert_eq!(
        *tried.lock().unwrap(),
        vec![
            128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11,
            9, 8
        ]
    );
}

#[test]
fn halving_follows_the_troubleshoot_guide() {
    let tried = Mutex::new(Vec::new());
    let fitted = BatchSizeFinder::new(128)
        .shrink(Shrink::Halve)
        .run(step_fitting(8, &tried))
        .unwrap();
    assert_eq!(fitted, 8);
    assert_eq!(*tried.lock().unwrap(), vec![128, 64, 32, 16, 8]);
}

#[test]
fn other_errors_propagate_unchanged_without_a_retry() {
    let mut calls = 0;
    let err = find_executable_batch_size(64, |_| {
        calls += 1;
        Err::<(), _>(Error::InvalidArgument("labels out of range".into()))
    })
    .unwrap_err();
    assert_eq!(calls, 1);
    match err {
        BatchSizeError::Failed(Error::InvalidArgument(m)) => assert_eq!(m, "labels out of range"),
        other => panic!("expected the closure's own error, got {other:?}"),
    }
}

#[test]
fn reaching_the_floor_lists_every_size_tried() {
    let tried = Mutex::new(Vec::new());
    let err = BatchSizeFinder::new(100)
        .floor(60)
        .run(step_fitting(10, &tried))
        .unwrap_err();
    match &err {
        BatchSizeError::Exhausted { tried, floor, last } => {
            assert_eq!(tried, &vec![100, 90, 81, 72, 64]);
            assert_eq!(*floor, 60);
            assert!(last.contains("can't allocate buffer"), "{last}");
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("[100, 90, 81, 72, 64]") && text.contains("floor of 60"),
        "{text}"
    );
    // Starting below the floor, or at zero, is the same error without a call.
    let zero = find_executable_batch_size(0, |_| Ok::<_, Error>(())).unwrap_err();
    assert!(
        matches!(zero, BatchSizeError::Exhausted { ref tried, .. } if tried.is_empty()),
        "{zero:?}"
    );
}

#[test]
fn a_panic_reporting_out_of_memory_is_retried_and_other_panics_propagate() {
    let mut tried = Vec::new();
    let fitted = find_executable_batch_size(32, |batch_size| {
        tried.push(batch_size);
        if batch_size > 20 {
            panic!("CUDA out of memory. Tried to allocate 2.00 GiB"); // what LibTorch does
        }
        Ok::<_, Error>(batch_size)
    })
    .unwrap();
    assert_eq!((fitted, tried), (19, vec![32, 28, 25, 22, 19]));
    let other = std::panic::catch_unwind(|| {
        find_executable_batch_size(8, |_| -> Result<(), Error> {
            panic!("index out of bounds")
        })
    });
    assert!(
        other.is_err(),
        "a panic that is not out-of-memory is not swallowed"
    );
}

#[test]
fn ranks_agree_on_every_size_when_only_rank_1_runs_out_of_memory() {
    let per_rank = Accelerator::builder()
        .launch(3, |acc| {
            let mut tried = Vec::new();
            let rank = acc.process_index();
            let fitted = acc.find_executable_batch_size(128, |batch_size| {
                tried.push(batch_size);
                if rank == 1 && batch_size > 50 {
                    Err(oom())
                } else {
                    Ok(batch_size)
                }
            });
            Ok((fitted.map_err(|e| e.to_string()), tried))
        })
        .unwrap();
    for (rank, (fitted, tried)) in per_rank.iter().enumerate() {
        assert_eq!(fitted.as_ref().ok(), Some(&46), "rank {rank}");
        assert_eq!(
            tried,
            &vec![128, 115, 103, 92, 82, 73, 65, 58, 52, 46],
            "rank {rank}"
        );
    }
}

#[test]
fn another_ranks_failure_stops_every_rank() {
    let per_rank = Accelerator::builder()
        .launch(2, |acc| {
            let rank = acc.process_index();
            let out = acc.find_executable_batch_size(16, |_| {
                if rank == 0 {
                    Err(Error::InvalidArgument("bad data".into()))
                } else {
                    Ok(())
                }
            });
            Ok(out.map_err(|e| e.to_string()).err())
        })
        .unwrap();
    assert!(
        per_rank[0].as_deref().unwrap().contains("bad data"),
        "{per_rank:?}"
    );
    assert!(
        per_rank[1]
            .as_deref()
            .unwrap()
            .contains("another rank failed at batch size 16"),
        "{per_rank:?}"
    );
}

#[test]
fn check_step_passes_a_healthy_step_and_free_memory_resets_the_window() {
    let accelerator = Accelerator::builder()
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let model: Linear = accelerator
        .prepare_model(LinearConfig::new(3, 1).init(accelerator.device()))
        .unwrap();
    accelerator.accumulate();
    let loss = model
        .forward(Tensor::<2>::ones([4, 3], accelerator.device()))
        .mean();
    accelerator.backward(loss.clone(), &model).unwrap();
    accelerator.check_step(&loss).unwrap();
    assert!(!accelerator.sync_gradients(), "inside the window");
    assert!(accelerator.grad(&model.weight).is_some());
    accelerator.free_memory();
    assert!(accelerator.sync_gradients(), "the window starts afresh");
    assert!(
        accelerator.grad(&model.weight).is_none(),
        "gradients dropped"
    );
}

/// Writes a safetensors file with the given (name, dtype, shape) tensors, zero-filled.
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, safetensors::Dtype, Vec<usize>)]) {
    let buffers: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, shape)| vec![0u8; shape.iter().product::<usize>() * dtype.bitsize() / 8])
        .collect();
    let views: HashMap<String, safetensors::tensor::TensorView> = tensors
        .iter()
        .zip(&buffers)
        .map(|((name, dtype, shape), data)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn estimates_match_a_hand_computation() {
    use safetensors::Dtype;
    let dir = std::env::temp_dir().join(format!("ba-estimate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    write_safetensors(
        &file,
        &[
            ("encoder.weight", Dtype::F32, vec![300, 200]), // 60,000
            ("encoder.bias", Dtype::F32, vec![200]),        //    200
            ("head.weight", Dtype::BF16, vec![200, 10]),    //  2,000
            ("positions", Dtype::I64, vec![512]),           //    512, not trained
        ],
    );
    let size = ModelSize::from_path(&dir).unwrap();
    assert_eq!(size.float_parameters, 62_200);
    assert_eq!(size.parameters(), 62_712);
    assert_eq!(size.per_dtype["F32"].bytes, 60_200 * 4);
    assert_eq!(size.per_dtype["BF16"].bytes, 2_000 * 2);
    assert_eq!(size.other_bytes, 512 * 8);
    assert_eq!(size.largest, Some(("encoder.weight".into(), 60_000)));
    // f32: 4 (weights) + 4 (gradients) + 8 (Adam) bytes per float parameter, plus the integer buffer.
    assert_eq!(size.training(MixedPrecision::No).total, 62_200 * 16 + 4096);
    // bf16/fp16: 2 more for the half copy autocast computes with.
    assert_eq!(
        size.training(MixedPrecision::Bf16).total,
        62_200 * 18 + 4096
    );
    assert_eq!(
        size.training(MixedPrecision::Fp16).total,
        62_200 * 18 + 4096
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_memory_example_finds_a_size_and_trains() {
    let out = std::process::Command::new(examples::example("memory"))
        .args(["--start", "256", "--fits-up-to", "100", "--steps", "20"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 256, 230, 207, 186, 167, 150, 135, 121, 108, 97: the first size at most 100.
    assert!(stdout.contains("batch_size=97"), "{stdout}");
    let loss: f32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("final_loss="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f32::NAN);
    assert!(loss.is_finite(), "{stdout}");
}
