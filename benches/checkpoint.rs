//! Checkpoint throughput for a 100 MB model, against plain file I/O of the same bytes in the same run:
//! `cargo bench -p burn-accelerate-examples --bench checkpoint`.
//!
//! Each round times the operation and its baseline back to back; the figures are medians of the per-round
//! ratios (baseline time / operation time, so 1.0 means as fast as plain I/O), with a noise floor from pairing
//! the baseline with itself.
//!
//! - `save_write_ratio`: `save_model` (safetensors, one file, written to a temporary name, synced, renamed) vs
//!   `write` + `sync_all` of the same number of bytes (the durable baseline); `save_vs_fs_write_ratio` against
//!   `std::fs::write` without sync, for reference.
//! - `load_read_ratio`: `load_checkpoint_in_model` into a model whose parameters are already initialised (so
//!   Burn's lazy random initialisation is not counted) vs `std::fs::read` of the file.

#[path = "../tests/support/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_accelerate::{Accelerator, LoadOptions};
use stats::{median, paired_ratio};

#[derive(Module, Debug)]
struct Big {
    layer: Linear,
}

/// A model with every parameter initialised now.
fn fresh() -> Big {
    struct Draw;
    impl ModuleVisitor for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let _ = param.val();
        }
    }
    let model = Big {
        layer: LinearConfig::new(5000, 5000).init(&Device::default()),
    };
    model.visit(&mut Draw);
    model
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn main() -> burn_accelerate::Result<()> {
    let accelerator = Accelerator::new()?;
    // 5000 x 5000 f32 weights + bias: 100 MB.
    let model = fresh();
    let bytes = 5000 * 5000 * 4 + 5000 * 4;
    let dir = std::env::temp_dir().join(format!("ba-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let raw_path = dir.join("raw.bin");
    let payload = vec![7u8; bytes];
    let file = dir.join("model.safetensors");
    let mb = bytes as f64 / 1e6;
    let rounds = 9;

    let write_sync = || {
        timed(|| {
            let mut f = std::fs::File::create(&raw_path).expect("create");
            std::io::Write::write_all(&mut f, &payload).expect("write");
            f.sync_all().expect("sync");
        })
    };
    let read = || timed(|| drop(std::hint::black_box(std::fs::read(&file).expect("read"))));
    let (mut save, mut write, mut durable, mut durable_again) = (vec![], vec![], vec![], vec![]);
    let (mut load, mut plain_read, mut plain_read_again) = (vec![], vec![], vec![]);
    for _ in 0..rounds {
        save.push(timed(|| {
            accelerator
                .save_model(&model, &dir, "10GB", true)
                .expect("save");
        }));
        durable.push(write_sync());
        durable_again.push(write_sync());
        write.push(timed(|| {
            std::fs::write(&raw_path, &payload).expect("write")
        }));
        // Not timed: the unsynced write's dirty pages would otherwise be written back during the next round's
        // save, and slow it down.
        std::fs::File::open(&raw_path)
            .and_then(|f| f.sync_all())
            .expect("sync");
        let target = fresh();
        load.push(timed(|| {
            let loaded = accelerator
                .load_checkpoint_in_model(target, &file, &LoadOptions::default())
                .expect("load");
            std::hint::black_box(loaded);
        }));
        plain_read.push(read());
        plain_read_again.push(read());
    }
    let rate = |times: &[Duration]| mb / median(times.to_vec()).as_secs_f64();
    println!("model_mb={mb:.1} rounds={rounds}");
    println!(
        "save_MBps={:.0} fs_write_sync_MBps={:.0} fs_write_MBps={:.0} load_MBps={:.0} fs_read_MBps={:.0}",
        rate(&save),
        rate(&durable),
        rate(&write),
        rate(&load),
        rate(&plain_read)
    );
    println!(
        "save_write_ratio={:.3} (save_model vs write + fsync of the same bytes)",
        paired_ratio(&durable, &save)
    );
    println!(
        "save_noise_floor={:.3} (write + fsync against itself)",
        paired_ratio(&durable_again, &durable)
    );
    println!(
        "save_vs_fs_write_ratio={:.3} (vs write without fsync)",
        paired_ratio(&write, &save)
    );
    println!(
        "load_read_ratio={:.3} (load_checkpoint_in_model vs std::fs::read)",
        paired_ratio(&plain_read, &load)
    );
    println!(
        "load_noise_floor={:.3} (read against itself)",
        paired_ratio(&plain_read_again, &plain_read)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
