//! Checkpoint throughput for a 100 MB model, against plain file I/O of the same bytes in the same run:
//! `cargo bench -p burn-accelerate --bench checkpoint`.
//!
//! - save: `save_model` (safetensors, one file, written to a temporary name, synced, renamed) vs
//!   `std::fs::write` of the same number of bytes (and vs `write` + `sync_all`, the durable baseline);
//! - load: `load_checkpoint_in_model` vs `std::fs::read` of the file.

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Device;
use burn_accelerate::{Accelerator, LoadOptions};

#[derive(Module, Debug)]
struct Big {
    layer: Linear,
}

fn best(mut f: impl FnMut() -> Duration, rounds: usize) -> Duration {
    (0..rounds).map(|_| f()).min().expect("rounds > 0")
}

fn main() -> burn_accelerate::Result<()> {
    let accelerator = Accelerator::new()?;
    // 5000 x 5000 f32 weights + bias: 100 MB.
    let model = Big {
        layer: LinearConfig::new(5000, 5000).init(&Device::default()),
    };
    let bytes = 5000 * 5000 * 4 + 5000 * 4;
    let dir = std::env::temp_dir().join(format!("ba-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let raw_path = dir.join("raw.bin");
    let payload = vec![7u8; bytes];
    let mb = bytes as f64 / 1e6;
    let rounds = 5;

    let save = best(
        || {
            let t = Instant::now();
            accelerator
                .save_model(&model, &dir, "10GB", true)
                .expect("save");
            t.elapsed()
        },
        rounds,
    );
    let write = best(
        || {
            let t = Instant::now();
            std::fs::write(&raw_path, &payload).expect("write");
            t.elapsed()
        },
        rounds,
    );
    let write_sync = best(
        || {
            let t = Instant::now();
            let mut f = std::fs::File::create(&raw_path).expect("create");
            std::io::Write::write_all(&mut f, &payload).expect("write");
            f.sync_all().expect("sync");
            t.elapsed()
        },
        rounds,
    );
    let file = dir.join("model.safetensors");
    let load = best(
        || {
            let fresh = Big {
                layer: LinearConfig::new(5000, 5000).init(&Device::default()),
            };
            let t = Instant::now();
            let _ = accelerator
                .load_checkpoint_in_model(fresh, &file, &LoadOptions::default())
                .expect("load");
            t.elapsed()
        },
        rounds,
    );
    let read = best(
        || {
            let t = Instant::now();
            std::hint::black_box(std::fs::read(&file).expect("read"));
            t.elapsed()
        },
        rounds,
    );
    let rate = |d: Duration| mb / d.as_secs_f64();
    println!("model_mb={mb:.1}");
    println!(
        "save_MBps={:.0} fs_write_MBps={:.0} fs_write_sync_MBps={:.0}",
        rate(save),
        rate(write),
        rate(write_sync)
    );
    println!("save_vs_fs_write_ratio={:.3}", rate(save) / rate(write));
    println!(
        "save_vs_fs_write_sync_ratio={:.3}",
        rate(save) / rate(write_sync)
    );
    println!("load_MBps={:.0} fs_read_MBps={:.0}", rate(load), rate(read));
    println!("load_vs_fs_read_ratio={:.3}", rate(load) / rate(read));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
