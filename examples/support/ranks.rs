//! Running an example's training on the ranks asked for: `--processes N` in-process ranks, or once as this
//! process's rank when a launcher (`mpirun`, `burn-accelerate launch`) started it.

#![allow(dead_code)]

use burn_accelerate::{Accelerator, AcceleratorBuilder, Result};

/// Whether an MPI launcher started this process (then it is one rank of the job).
pub fn under_launcher() -> bool {
    #[cfg(feature = "mpi")]
    return burn_accelerate::distributed::cluster::launched_by_mpi();
    #[cfg(not(feature = "mpi"))]
    false
}

/// Runs `train` on every rank and returns the main rank's result, or `None` in a process that does not hold
/// the main rank (the other processes of an MPI job): `processes` in-process ranks unless a launcher started
/// this process.
pub fn run_ranks<T, F>(builder: AcceleratorBuilder, processes: usize, train: F) -> Result<Option<T>>
where
    T: Send,
    F: Fn(Accelerator) -> Result<T> + Send + Sync,
{
    if under_launcher() || processes <= 1 {
        let accelerator = builder.build()?;
        let main = accelerator.is_main_process();
        let result = train(accelerator)?;
        Ok(main.then_some(result))
    } else {
        Ok(builder.launch(processes, train)?.into_iter().next())
    }
}

/// The device for values made before the accelerator, such as initial weights every rank starts from: the one
/// runs take ([`burn_accelerate::backend::default_device`]; Burn's `Device::default()` takes CUDA even where no
/// driver can run it). On an error, prints it and exits with status 1.
pub fn default_device() -> burn::tensor::Device {
    match burn_accelerate::backend::default_device() {
        Ok(device) => device,
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}

/// Ends the example: on an error, prints it and exits with status 1.
pub fn exit_on_error(result: Result<()>) {
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

/// Fails unless every rank holds, bit for bit, the weights of the main rank (as data parallelism promises):
/// each rank's fingerprint of its float parameters is gathered and compared, so a run under a launcher checks
/// every process, not only the one that prints.
pub fn check_ranks_agree<M: burn::module::Module>(acc: &Accelerator, model: &M) -> Result<()> {
    struct Fingerprint(u64, usize);
    impl burn::module::ModuleVisitor for Fingerprint {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            for value in param.val().into_data().iter::<f32>() {
                // FNV-1a over the bits of every value, in visiting order.
                for byte in value.to_bits().to_le_bytes() {
                    self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                }
                self.1 += 1;
            }
        }
    }
    let mut mine = Fingerprint(0xcbf2_9ce4_8422_2325, 0);
    model.visit(&mut mine);
    let all = acc.gather_object(&(mine.0, mine.1))?;
    match all.iter().position(|f| *f != all[0]) {
        Some(rank) => Err(burn_accelerate::Error::other(format!(
            "rank {rank}'s weights differ from rank 0's after training ({} and {} values, fingerprints {:#x} and {:#x})",
            all[rank].1, all[0].1, all[rank].0, all[0].0
        ))),
        None => Ok(()),
    }
}

/// Ends this process with SIGKILL, as the out-of-memory killer or a lost machine would: nothing runs after it.
/// The notice goes out in one write, so that `mpirun`'s forwarding cannot cut the line.
pub fn kill_self(rank: usize, when: &str) -> ! {
    let line = format!("fault: rank {rank} is killed {when}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    // SAFETY: a plain system call that ends this process.
    #[cfg(unix)]
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort()
}
