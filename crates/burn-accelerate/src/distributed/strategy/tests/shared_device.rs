//! Every strategy with no parameter or gradient through host memory — over a communicator double that refuses
//! every call carrying values — training the weights of the host path: in-process ranks on one device (Flex here,
//! one GPU in the GPU kit) through the shared device path, and ranks on a device library's path (NCCL's code,
//! over the library's host-memory double).

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::optim::AdamConfig;

use super::leader::{stack, stack_steps, stack_weights};
use super::*;
use crate::config::GradientTransport;
use crate::diagnostics::{ControlBudget, NoHostBuffers};
use crate::distributed::ProcessGroup;
use crate::distributed::cluster::launch_ranks_over;
use crate::distributed::comm::Communicator;
use crate::distributed::tensor_comm::shared_device::SharedDevice;
use crate::distributed::tensor_comm::{Checked, TensorComm};

/// The control each run on the shared device path may pass through host memory, all its ranks together
/// (agreements, call checks, parameter ids; a save and a load): measured at most 126 bytes, under one parameter of
/// the stack (a 6 × 6 weight, 144 bytes; one step's gradients are 316 bytes a rank).
const BUDGET: ControlBudget = ControlBudget {
    name: "the shared-device tests",
    bytes: 144,
    single_values: 0,
};

/// On a device library's path the communicator's id (128 bytes) and each sub-group's colours cross host memory
/// too, and so do single values (verdicts, norms, each a value of its own): under 512 bytes in all, where the
/// stack's gradients of the 3 steps are 948 bytes a rank, and 24 single values a rank.
const LIBRARY_BUDGET: ControlBudget = ControlBudget {
    name: "the device library's path in the shared-device tests",
    bytes: 512,
    single_values: 24,
};

/// Runs `f` on `ranks` in-process ranks built by `builder`, each over a [`NoHostBuffers`] double (passing single
/// values where `budget` lets any through) within `budget`; the results, and the control bytes every rank sent
/// together.
fn launch_without_host_buffers<T: Send>(
    (builder, budget): (&AcceleratorBuilder, ControlBudget),
    ranks: usize,
    f: impl Fn(Accelerator) -> Result<T> + Send + Sync,
) -> (Vec<T>, usize) {
    let control_bytes = Arc::new(AtomicUsize::new(0));
    let counted = control_bytes.clone();
    let results = launch_ranks_over(
        ranks,
        std::time::Duration::from_secs(60),
        move |inner| {
            Arc::new(NoHostBuffers::new(
                inner,
                counted.clone(),
                budget.single_values > 0,
                budget,
            )) as Arc<dyn Communicator>
        },
        |cluster| f(builder.build_in(cluster)?),
    )
    .unwrap();
    (results, control_bytes.load(Ordering::Relaxed))
}

/// Steps of Adam on the block stack, alternating a whole backward and a checkpointed block-wise one, clipping
/// every other step, then a save and a load (as the leader strategy's test): each rank's weights and the
/// strategy's name.
fn train_stack_steps(acc: Accelerator, dir: &std::path::Path) -> Result<(Vec<f32>, String)> {
    let device = acc.device().clone();
    let net = acc.prepare_model(stack(&device))?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let net = stack_steps(&acc, net, &mut optimizer)?;
    let parts = StateToSave::new().model(&net)?.optimizer(&optimizer)?;
    acc.save_state(Some(dir), &parts)?;
    let mut state = acc.load_state(Some(dir))?;
    let net = state.model(net)?;
    state.optimizer(&mut optimizer)?;
    state.finish()?;
    Ok((stack_weights(&acc.unshard(&net)?), acc.strategy_name()))
}

/// The strategy of `mode` over `comm` for `group`'s rank, with 64-byte buckets (hybrids: shard groups of 2).
fn strategy_over(
    comm: Arc<dyn TensorComm>,
    group: &Arc<ProcessGroup>,
    mode: ShardingStrategy,
) -> Result<Arc<dyn Strategy>> {
    let bucket = 64;
    Ok(match mode {
        ShardingStrategy::NoShard => Arc::new(DataParallel::new(comm, bucket)),
        m if m.is_hybrid() => Arc::new(Sharded::hybrid(
            group.clone(),
            comm,
            crate::distributed::mesh::hybrid_groups(group, 2)?,
            m,
            bucket,
        )?),
        m => Arc::new(Sharded::new(group.clone(), comm, m, bucket)),
    })
}

/// Every strategy, on how many ranks, with activation checkpointing or not.
const CASES: [(ShardingStrategy, usize, bool); 7] = [
    (ShardingStrategy::NoShard, 2, false),
    (ShardingStrategy::ShardGradOp, 2, false),
    (ShardingStrategy::FullShard, 2, false),
    (ShardingStrategy::FullShard, 3, true),
    (ShardingStrategy::HybridShard, 4, false),
    (ShardingStrategy::HybridShardZero2, 4, false),
    (ShardingStrategy::NoShard, 3, true),
];

/// A builder for `mode` with small buckets (several rounds per step) and shard groups of 2 for hybrids.
fn case_builder(mode: ShardingStrategy, checkpointing: bool) -> AcceleratorBuilder {
    let builder = AcceleratorBuilder::default()
        .sharding(mode)
        .activation_checkpointing(checkpointing)
        .bucket_size_mb(64.0 / (1 << 20) as f64);
    if mode.is_hybrid() {
        builder.dp_shard_size(2)
    } else {
        builder
    }
}

#[test]
fn every_strategy_trains_through_a_device_librarys_path_without_host_buffers_as_through_host_memory()
 {
    let base = std::env::temp_dir().join(format!(
        "burn-accelerate-device-library-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&base);
    for (n, (mode, ranks, checkpointing)) in CASES.into_iter().enumerate() {
        let dir = base.join(format!("case{n}"));
        let host_dir = dir.join("host");
        let host = case_builder(mode, checkpointing)
            .gradient_transport(GradientTransport::Host)
            .launch(ranks, |acc| train_stack_steps(acc, &host_dir))
            .unwrap();
        let library = crate::distributed::tensor_comm::on_device::double::HostLibrary::default();
        let counted = library.clone();
        let on_library = case_builder(mode, checkpointing).strategy(Arc::new(move |group| {
            let engine = crate::distributed::tensor_comm::on_device::DeviceCollectives::connect(
                group.clone(),
                &counted,
                std::time::Duration::from_secs(60),
            )?;
            strategy_over(OnDevice::checked(Box::new(engine), group), group, mode)
        }));
        let library_dir = dir.join("library");
        let (through_library, control_bytes) =
            launch_without_host_buffers((&on_library, LIBRARY_BUDGET), ranks, |acc| {
                train_stack_steps(acc, &library_dir)
            });
        for rank in 0..ranks {
            // The library sums in f64 from the last rank: other roundings than the host engine's.
            let diff = max_relative_difference(&host[rank].0, &through_library[rank].0);
            println!(
                "{mode} on {ranks} ranks, rank {rank}: max relative |Δ| vs host path = {diff:e}"
            );
            assert!(diff <= 1e-5, "{mode} rank {rank}: {diff}");
            assert!(
                through_library[rank]
                    .1
                    .contains("device collectives (NCCL)"),
                "{mode}: {}",
                through_library[rank].1
            );
        }
        let calls = library.started.load(Ordering::Relaxed);
        println!(
            "{mode} on {ranks} ranks: {calls} library calls, {} splits, {control_bytes} control bytes and \
             single values through host memory in all",
            library.splits.load(Ordering::Relaxed)
        );
        assert!(calls > 0, "{mode}: nothing went through the library");
        if mode.is_hybrid() {
            assert_eq!(library.splits.load(Ordering::Relaxed), 2 * ranks, "{mode}");
        }
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// Steps of Adam on the block stack cut into pipeline stages (2 micro-batches a batch, the norm clipped): the
/// losses every rank gets back, and the values this rank passed through host memory from its start.
fn pipelined_losses(acc: Accelerator) -> Result<(Vec<f32>, u64)> {
    let device = acc.device().clone();
    let mut net = acc.prepare_blocks(stack(&device))?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let mut losses = Vec::new();
    for step in 0..4 {
        // Every replica reads the same batch: the stages of one replica must.
        let x = super::leader::input(0, step, &device);
        let loss = acc.backward_batch(
            &net,
            x,
            |_, x| x.clone(),
            |b, h| b.forward(h).tanh(),
            |m, h, _| m.head.forward(h).powi_scalar(2).mean(),
        )?;
        losses.push(loss.into_scalar::<f32>());
        acc.clip_grad_norm(&net, 0.05)?;
        net = optimizer.try_step(net)?;
    }
    Ok((losses, acc.host_values()))
}

#[test]
fn pipeline_stages_on_a_shared_device_pass_no_value_through_host_memory_and_train_as_through_it() {
    // Two stages on 2 ranks; two stages of 2 FULL_SHARD ranks each on 4.
    for (ranks, mode) in [
        (2, ShardingStrategy::NoShard),
        (4, ShardingStrategy::FullShard),
    ] {
        let builder = || {
            AcceleratorBuilder::default()
                .pp_size(2)
                .pp_microbatches(2)
                .sharding(mode)
        };
        let host = builder()
            .gradient_transport(GradientTransport::Host)
            .launch(ranks, pipelined_losses)
            .unwrap();
        let (shared, control_bytes) =
            launch_without_host_buffers((&builder(), BUDGET), ranks, pipelined_losses);
        for rank in 0..ranks {
            assert!(
                host[rank].1 > 0,
                "the host path passes values through host memory"
            );
            assert_eq!(shared[rank].1, 0, "{mode} on {ranks} ranks, rank {rank}");
            let diff = max_relative_difference(&host[rank].0, &shared[rank].0);
            assert!(diff <= 1e-6, "{mode} on {ranks} ranks, rank {rank}: {diff}");
        }
        println!("pipeline, {mode} on {ranks} ranks: {control_bytes} control bytes in all");
    }
}

#[test]
fn every_strategy_trains_on_a_shared_device_without_host_buffers_as_through_host_memory() {
    let base = std::env::temp_dir().join(format!(
        "burn-accelerate-shared-device-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&base);
    for (n, (mode, ranks, checkpointing)) in CASES.into_iter().enumerate() {
        let builder = || case_builder(mode, checkpointing);
        let dir = base.join(format!("case{n}"));
        let host_dir = dir.join("host");
        let host = builder()
            .gradient_transport(GradientTransport::Host)
            .launch(ranks, |acc| train_stack_steps(acc, &host_dir))
            .unwrap();
        let shared_dir = dir.join("shared");
        let (shared, control_bytes) =
            launch_without_host_buffers((&builder(), BUDGET), ranks, |acc| {
                train_stack_steps(acc, &shared_dir)
            });
        // The protocol of deferred backends (queues run around every call, copies, a second round), on Flex.
        let deferred_dir = dir.join("deferred");
        let deferred = builder().strategy(Arc::new(move |group| {
            let comm: Arc<dyn TensorComm> = Arc::new(Checked::new(
                Arc::new(SharedDevice::with_deferred(group.clone(), true)),
                group.clone(),
            ));
            strategy_over(comm, group, mode)
        }));
        let (deferred, _) = launch_without_host_buffers((&deferred, BUDGET), ranks, |acc| {
            train_stack_steps(acc, &deferred_dir)
        });
        for rank in 0..ranks {
            let diff = max_relative_difference(&host[rank].0, &shared[rank].0);
            println!(
                "{mode} on {ranks} ranks, rank {rank}: max relative |Δ| vs host path = {diff:e}"
            );
            assert!(diff <= 1e-6, "{mode} rank {rank}: {diff}");
            let diff = max_relative_difference(&host[rank].0, &deferred[rank].0);
            assert!(
                diff <= 1e-6,
                "{mode} rank {rank}, deferred protocol: {diff}"
            );
            assert!(
                shared[rank].1.contains("device exchange"),
                "{mode}: {}",
                shared[rank].1
            );
            assert!(
                !host[rank].1.contains("device exchange"),
                "{}",
                host[rank].1
            );
        }
        println!(
            "{mode} on {ranks} ranks: {control_bytes} control bytes through host memory in all"
        );
        // Agreements and call checks only (the double refuses more): less than one parameter of the stack.
        assert!(
            control_bytes <= BUDGET.bytes,
            "{mode}: {control_bytes} control bytes"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// The budget is what lets control bytes through, and no more: a rank that sends values as bytes (every step's
/// gradients of the stack serialised, as a strategy could to dodge the refusal of buffers) is refused.
#[test]
fn values_sent_as_bytes_are_refused_past_the_control_budget() {
    let builder = AcceleratorBuilder::default();
    let (outcomes, _) = launch_without_host_buffers((&builder, BUDGET), 2, |acc| {
        let gradients: Vec<f32> = (0..79).map(|i| i as f32 * 0.01).collect();
        Ok(acc
            .gather_object(&gradients)
            .map(|_| ())
            .map_err(|e| e.to_string()))
    });
    for outcome in outcomes {
        let err = outcome.unwrap_err();
        assert!(err.contains("past the budget of 144"), "{err}");
    }
}
