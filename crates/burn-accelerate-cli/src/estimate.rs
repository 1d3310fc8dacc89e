//! `burn-accelerate estimate-memory`: the memory a safetensors checkpoint needs to load and to train with Adam.

use std::fmt::Write;
use std::path::Path;

use burn_accelerate::MixedPrecision;
use burn_accelerate::memory::ModelSize;

/// Human-readable bytes, in binary units.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// The report for `path`, as a table or as JSON.
pub fn report(path: &Path, json: bool) -> burn_accelerate::Result<String> {
    let size = ModelSize::from_path(path)?;
    let precisions = [
        MixedPrecision::No,
        MixedPrecision::Bf16,
        MixedPrecision::Fp16,
    ];
    let training: Vec<_> = precisions.iter().map(|p| size.training(*p)).collect();
    if json {
        let value = serde_json::json!({
            "files": size.files,
            "parameters": size.parameters(),
            "float_parameters": size.float_parameters,
            "per_dtype": size.per_dtype,
            "largest": size.largest,
            "training_with_adam": training,
        });
        return Ok(format!("{value:#}\n"));
    }
    let mut out = String::new();
    let _ = writeln!(out, "Memory for `{}`", path.display());
    let _ = writeln!(
        out,
        "parameters: {} ({} floating-point)",
        size.parameters(),
        size.float_parameters
    );
    if let Some((name, n)) = &size.largest {
        let _ = writeln!(out, "largest tensor: {name} ({n} elements)");
    }
    let _ = writeln!(out, "\n| dtype | parameters | bytes |\n|---|---|---|");
    for (dtype, count) in &size.per_dtype {
        let _ = writeln!(
            out,
            "| {dtype} | {} | {} |",
            count.parameters,
            bytes(count.bytes)
        );
    }
    let _ = writeln!(
        out,
        "\nTraining with Adam (without activations, which depend on the batch):\n\
         | precision | weights | half copy | gradients | optimizer | total |\n|---|---|---|---|---|---|"
    );
    for t in &training {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            t.precision,
            bytes(t.weights),
            bytes(t.half_copy),
            bytes(t.gradients),
            bytes(t.optimizer),
            bytes(t.total)
        );
    }
    Ok(out)
}
