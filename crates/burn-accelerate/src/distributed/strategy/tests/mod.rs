//! The strategies end to end: transports, sharded modes and their checkpoints against data parallelism.

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::AdamConfig;
use burn::tensor::Device;

use super::*;
use crate::accelerator::AcceleratorBuilder;
use crate::config::ShardingStrategy;
use crate::distributed::ProcessGroup;
use crate::distributed::collectives;
use crate::distributed::comm::ReduceOp;
use crate::{Accelerator, StateToSave};

mod leader;
mod policy;
mod prefetch;
mod pretrained;
mod shared_device;

#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
}

/// Another gradient transport, in the shape of a device all-reduce: the flat buffer is averaged by a tensor
/// collective and scaled as a tensor (no host buffer of the transport's own), and its calls are counted.
#[derive(Debug)]
struct DeviceDouble {
    group: Arc<ProcessGroup>,
    calls: Arc<AtomicUsize>,
}

impl DeviceEngine for DeviceDouble {
    fn name(&self) -> &'static str {
        "device double"
    }
    fn average(&self, flat: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let sum = collectives::reduce(&self.group, flat, ReduceOp::Sum)?;
        Ok(sum.mul_scalar(scale / self.group.num_processes() as f32))
    }
}

/// A linear layer with fixed, uneven weights: the device's random generator is shared by the tests that
/// run beside this one, and Burn draws parameters lazily, so drawn weights would differ between runs.
fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    crate::diagnostics::fixed_linear(d_in, d_out, salt, device)
}

fn net(device: &Device) -> Net {
    Net {
        a: linear(4, 8, 0.1, device),
        b: linear(8, 2, 1.3, device),
    }
}

fn weights(net: &Net) -> Vec<f32> {
    [
        net.a.weight.val().into_data(),
        net.b.weight.val().into_data(),
    ]
    .into_iter()
    .flat_map(|d| d.try_to_vec::<f32>().unwrap())
    .collect()
}

/// Trains `Net` with Adam for `steps` steps on 2 ranks (each rank its own data) and returns each rank's
/// weights and the number of optimizer state elements it holds.
fn train(builder: AcceleratorBuilder, steps: usize) -> Vec<(Vec<f32>, usize)> {
    builder
        .launch(2, move |acc: Accelerator| {
            let device = acc.device().clone();
            let mut net = acc.prepare_model(net(&device))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let rank = acc.process_index() as f32;
            for step in 0..steps {
                let values: Vec<f32> = (0..24)
                    .map(|i| i as f32 * (0.05 * (rank + 1.0) + step as f32 * 0.01))
                    .collect();
                let x = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([6, 4]);
                let whole = acc.unshard(&net)?;
                let loss = whole
                    .b
                    .forward(whole.a.forward(x).tanh())
                    .powi_scalar(2)
                    .mean();
                acc.backward(loss, &whole)?;
                net = optimizer.try_step(net)?;
            }
            // FULL_SHARD holds only this rank's parameters between steps: compare the whole model.
            Ok((
                weights(&acc.unshard(&net)?),
                state_elements(optimizer.inner().to_record()),
            ))
        })
        .unwrap()
}

/// The number of elements of every tensor an optimizer record holds.
fn state_elements(record: burn::optim::OptimizerRecord) -> usize {
    let bytes = record.into_bytes().unwrap();
    burn_pack::Reader::from_bytes(bytes)
        .unwrap()
        .into_tensors()
        .unwrap()
        .iter()
        .map(|t| t.shape.num_elements())
        .sum()
}

fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-6))
        .fold(0.0, f32::max)
}

#[test]
fn another_gradient_transport_trains_the_same_model_as_the_host_all_reduce() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let device = AcceleratorBuilder::default().strategy(Arc::new(move |group| {
        let transport = DeviceDouble {
            group: group.clone(),
            calls: counted.clone(),
        };
        Ok(Arc::new(DataParallel::new(
            OnDevice::checked(Box::new(transport), group),
            25 << 20,
        )))
    }));
    let host = train(AcceleratorBuilder::default(), 20);
    let other = train(device, 20);
    // One bucket per step on each of the 2 ranks (the initial broadcast is not an average).
    assert_eq!(calls.load(Ordering::Relaxed), 2 * 20);
    for ((h, _), (o, _)) in host.iter().zip(&other) {
        let diff = max_relative_difference(h, o);
        assert!(diff < 1e-5, "device double vs host all-reduce: {diff}");
    }
    assert_eq!(other[0].0, other[1].0, "ranks agree");
}

#[test]
fn the_device_all_reduce_path_trains_the_same_model_as_the_host_all_reduce() {
    // DeviceCollectives as NCCL drives it (id from rank 0 over the communicator, asynchronous calls polled
    // against the timeout), over the host-memory double of the library.
    let device = AcceleratorBuilder::default().strategy(Arc::new(|group| {
        let transport = on_device::DeviceCollectives::connect(
            group.clone(),
            &on_device::double::HostLibrary::default(),
            std::time::Duration::from_secs(30),
        )?;
        Ok(Arc::new(DataParallel::new(
            OnDevice::checked(Box::new(transport), group),
            25 << 20,
        )))
    }));
    let host = train(AcceleratorBuilder::default(), 20);
    let other = train(device, 20);
    for ((h, _), (o, _)) in host.iter().zip(&other) {
        let diff = max_relative_difference(h, o);
        assert!(diff < 1e-5, "device all-reduce vs host all-reduce: {diff}");
    }
    assert_eq!(other[0].0, other[1].0, "ranks agree");
}

#[test]
fn the_transport_is_chosen_from_the_setting_and_named() {
    use crate::config::GradientTransport;
    let named = |preference| {
        AcceleratorBuilder::default()
            .gradient_transport(preference)
            .launch(2, |acc| Ok(acc.strategy_name()))
            .unwrap()
    };
    // In-process ranks on one device hand each other tensors unless host memory is asked for.
    let shared = "data parallel over device exchange (in-process ranks sharing one device)";
    assert_eq!(named(GradientTransport::Auto), vec![shared; 2]);
    assert_eq!(named(GradientTransport::Device), vec![shared; 2]);
    assert_eq!(
        named(GradientTransport::Host),
        vec!["data parallel over host all-reduce"; 2]
    );
    // One rank needs no transport, whatever the setting.
    let single = AcceleratorBuilder::default()
        .gradient_transport(GradientTransport::Device)
        .launch(1, |acc| Ok(acc.strategy_name()))
        .unwrap();
    assert_eq!(single, vec!["single device"]);
}

#[test]
fn sharded_strategies_step_each_ranks_slice_of_every_parameter_and_match_data_parallelism() {
    let replicated = train(AcceleratorBuilder::default(), 20);
    // Four parameters (32, 8, 16 and 2 elements), each cut into two even row slices: each rank holds half of
    // every tensor's Adam moments.
    assert_eq!(
        replicated[0].1, replicated[1].1,
        "data parallelism: every rank holds all state"
    );
    for mode in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
        // Small buckets: several reduce-scatter and all-gather rounds per step.
        let sharded = AcceleratorBuilder::default()
            .sharding(mode)
            .bucket_size_mb(40.0 / (1 << 20) as f64);
        let shards = train(sharded, 20);
        for rank in 0..2 {
            assert_eq!(
                shards[rank].0, replicated[rank].0,
                "{mode} rank {rank}: the same reduction, so the same weights bit for bit"
            );
        }
        assert_eq!(
            (shards[0].1, shards[1].1),
            (replicated[0].1 / 2, replicated[0].1 / 2),
            "{mode}: each rank holds its slice"
        );
    }
}

/// Elements of the float parameters of `module` this rank holds.
fn held_elements<M: Module>(module: &M) -> usize {
    let mut n = 0;
    crate::named_params::floats(module, |p| n += p.num_elements());
    n
}

/// Elements of the gradients of `module`'s parameters this rank holds.
fn grad_elements<M: Module>(acc: &Accelerator, module: &M) -> usize {
    struct Count<'a>(&'a Accelerator, usize);
    impl burn::module::ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.grad(param) {
                self.1 += grad.shape().num_elements();
            }
        }
    }
    let mut count = Count(acc, 0);
    module.visit(&mut count);
    count.1
}

/// A model whose input layer holds 90 % of the parameters (an embedding's or an output head's share in an LLM):
/// cut in dim-0 slices, every rank holds the same share of it, of the gradients and of the optimizer state, on
/// 3 and 4 ranks (more ranks than the last layer's rows included), and trains the weights of data parallelism.
#[test]
fn one_large_tensor_is_shared_evenly_by_every_rank() {
    #[derive(Module, Debug)]
    struct Lopsided {
        embed: Linear,
        head: Linear,
    }
    for ranks in [3usize, 4] {
        let run = |mode: ShardingStrategy| {
            AcceleratorBuilder::default()
                .sharding(mode)
                .launch(ranks, move |acc: Accelerator| {
                    let device = acc.device().clone();
                    let initial = Lopsided {
                        embed: linear(30, 8, 0.2, &device),
                        head: linear(8, 2, 0.7, &device),
                    };
                    let mut model = acc.prepare_model(initial)?;
                    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
                    let mut grads = 0;
                    for step in 0..3 {
                        let rank = acc.process_index() as f32;
                        let values: Vec<f32> = (0..60)
                            .map(|i| ((i as f32 + step as f32) * (0.03 + 0.01 * rank)).cos())
                            .collect();
                        let x =
                            Tensor::<1>::from_floats(values.as_slice(), &device).reshape([2, 30]);
                        let whole = acc.unshard(&model)?;
                        let loss = whole
                            .head
                            .forward(whole.embed.forward(x))
                            .powi_scalar(2)
                            .mean();
                        acc.backward(loss, &whole)?;
                        grads = grad_elements(&acc, &whole);
                        model = optimizer.try_step(model)?;
                    }
                    let held = held_elements(&model);
                    let state = state_elements(optimizer.inner().to_record());
                    let whole = acc.unshard(&model)?;
                    Ok((
                        [
                            whole.embed.weight.val().into_data(),
                            whole.head.weight.val().into_data(),
                        ]
                        .into_iter()
                        .flat_map(|d| d.try_to_vec::<f32>().unwrap())
                        .collect::<Vec<f32>>(),
                        held,
                        grads,
                        state,
                    ))
                })
                .unwrap()
        };
        let replicated = run(ShardingStrategy::NoShard);
        let sharded = run(ShardingStrategy::FullShard);
        let whole_params = 30 * 8 + 8 + 8 * 2 + 2;
        assert_eq!(replicated[0].1, whole_params);
        for rank in 0..ranks {
            assert_eq!(
                sharded[rank].0, replicated[rank].0,
                "{ranks} ranks, rank {rank}: the weights of data parallelism bit for bit"
            );
        }
        for (what, held) in [
            (
                "parameters",
                sharded.iter().map(|r| r.1).collect::<Vec<_>>(),
            ),
            ("gradients", sharded.iter().map(|r| r.2).collect()),
            ("optimizer state", sharded.iter().map(|r| r.3).collect()),
        ] {
            let (least, most) = (
                *held.iter().min().unwrap() as f64,
                *held.iter().max().unwrap() as f64,
            );
            assert!(
                most <= least * 1.05 && least > 0.0,
                "{ranks} ranks: the {what} each rank holds differ by more than 5 %: {held:?}"
            );
        }
        // Every rank's share is the whole over the ranks, plus at most one padding row per tensor.
        let share = whole_params.div_ceil(ranks);
        assert!(
            sharded.iter().all(|r| r.1 <= share + 8 + 8 + 2 + 1),
            "{ranks} ranks: {:?} parameters held, share {share}",
            sharded.iter().map(|r| r.1).collect::<Vec<_>>()
        );
    }
}

/// An optimizer whose update needs each parameter whole (LAMB's trust ratio) is refused under a strategy that
/// cuts parameters into row slices, with what to use instead.
#[test]
fn a_whole_tensor_optimizer_is_refused_where_parameters_are_cut_in_rows() {
    let errors = AcceleratorBuilder::default()
        .sharding(ShardingStrategy::FullShard)
        .launch(2, |acc: Accelerator| {
            let device = acc.device().clone();
            let model = acc.prepare_model(net(&device))?;
            let lamb = burn::optim::LambConfig::new().build();
            let mut optimizer = acc.prepare_optimizer(lamb, 1e-2);
            let whole = acc.unshard(&model)?;
            let x = Tensor::<2>::ones([3, 4], &device);
            acc.backward(whole.b.forward(whole.a.forward(x)).sum(), &whole)?;
            Ok(optimizer.try_step(model).unwrap_err().to_string())
        })
        .unwrap();
    for err in errors {
        assert!(
            err.contains("Lamb") && err.contains("FULL_SHARD") && err.contains("AdamW"),
            "{err}"
        );
    }
}

#[test]
fn a_sharded_strategy_saves_and_restores_each_ranks_optimizer_slice() {
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-sharded-state-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let sharded = AcceleratorBuilder::default().sharding(ShardingStrategy::ShardGradOp);
    let target = dir.clone();
    let restored = sharded
        .launch(2, move |acc: Accelerator| {
            let device = acc.device().clone();
            let net = acc.prepare_model(net(&device))?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let x = Tensor::<2>::ones([3, 4], &device);
            acc.backward(net.b.forward(net.a.forward(x)).sum(), &net)?;
            let net = optimizer.try_step(net)?;
            let parts = StateToSave::new().model(&net)?.optimizer(&optimizer)?;
            acc.save_state(Some(&target), &parts)?;
            let mut fresh = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
            let mut state = acc.load_state(Some(&target))?;
            let _ = state.model(net)?;
            state.optimizer(&mut fresh)?;
            state.finish()?;
            Ok(state_elements(fresh.inner().to_record()))
        })
        .unwrap();
    assert!(dir.join("optimizer_rank0.bpk").is_file());
    assert!(dir.join("optimizer_rank1.bpk").is_file());
    assert!(!dir.join("optimizer.bpk").exists());
    // Half of each of the four tensors' two Adam moments: (16 + 4 + 8 + 1) * 2.
    assert_eq!(restored, vec![58, 58], "each rank read back its own slice");
    assert!(restored[0] > 0);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = Device::default();
}

#[test]
fn a_sharded_run_says_fsdp_and_refuses_what_sharding_cannot_honour() {
    let sharded = || AcceleratorBuilder::default().sharding(ShardingStrategy::ShardGradOp);
    let kinds = sharded()
        .launch(2, |acc| Ok(acc.distributed_type()))
        .unwrap();
    assert_eq!(kinds, vec![crate::DistributedType::Fsdp; 2]);
    let alone = sharded()
        .launch(1, |acc| Ok(acc.distributed_type()))
        .unwrap();
    assert_eq!(alone, vec![crate::DistributedType::No]);
    let err = sharded()
        .sync_each_batch(true)
        .launch(2, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("sync_each_batch") && err.contains("SHARD_GRAD_OP"),
        "{err}"
    );
}

#[test]
fn owners_are_balanced_by_size_and_deterministic() {
    let ids: Vec<ParamId> = (0..5).map(|_| ParamId::new()).collect();
    let params: Vec<(ParamId, usize)> = ids.iter().copied().zip([10, 40, 10, 20, 20]).collect();
    assert_eq!(balanced_owners(&params, 2), vec![0, 0, 1, 1, 1]);
    assert_eq!(balanced_owners(&params, 3), vec![1, 0, 2, 1, 2]);
    assert_eq!(balanced_owners(&params, 1), vec![0; 5]);
}

#[test]
fn a_backward_that_reaches_none_of_its_models_parameters_is_an_error_alone_and_zeros_with_peers() {
    // Two models; the second `backward` is handed a model its loss never reached, while the first model's
    // gradients sit in the buffer.
    let outcome = |ranks: usize| {
        AcceleratorBuilder::default()
            .launch(ranks, |acc: Accelerator| {
                let device = acc.device().clone();
                let first = acc.prepare_model(linear(4, 2, 0.3, &device))?;
                let second = acc.prepare_model(linear(4, 2, 0.9, &device))?;
                let x = Tensor::<2>::ones([3, 4], &device);
                acc.backward(first.forward(x.clone()).sum(), &first)?;
                Ok(acc
                    .backward(first.forward(x).sum(), &second)
                    .err()
                    .map(|e| e.to_string()))
            })
            .unwrap()
    };
    let alone = outcome(1);
    let err = alone[0].as_deref().unwrap_or("no error");
    assert!(
        err.contains("none of the model's parameters received a gradient"),
        "{err}"
    );
    // With peers it takes part in the reduction with zeros, on every rank alike.
    assert_eq!(outcome(2), vec![None, None]);
}

/// A rank that holds none of the gradients of parameters its strategy never saw whole (unfrozen after
/// `prepare_model`; its part of the batch reached none of them) takes part in their reduce-scatter with zeros:
/// before, it returned at once and left its peer in the collective until the timeout.
#[test]
fn a_rank_without_gradients_of_unknown_parameters_still_joins_their_reduction() {
    let ids = [ParamId::new(), ParamId::new()];
    let slices = Accelerator::builder()
        .cpu(true)
        .collective_timeout(std::time::Duration::from_secs(20))
        .launch(2, move |acc| {
            let group = acc.group_arc();
            let comm: Arc<dyn crate::distributed::tensor_comm::TensorComm> = Arc::new(
                crate::distributed::tensor_comm::Checked::host(group.clone()),
            );
            let sharded = Sharded::new(group, comm, ShardingStrategy::FullShard, 1 << 20);
            let mut grads = GradientBuffer::new();
            if acc.process_index() == 0 {
                for (k, id) in ids.iter().enumerate() {
                    let values: Vec<f32> = (0..4).map(|i| (10 * k + i) as f32).collect();
                    grads.add(
                        *id,
                        Tensor::<1>::from_floats(values.as_slice(), acc.device()),
                    );
                }
            }
            let params: Vec<(ParamId, usize)> = ids.iter().map(|id| (*id, 4)).collect();
            sharded.reduce_gradients(&mut grads, &params, 1.0)?;
            Ok(ids
                .iter()
                .map(|id| {
                    grads
                        .flat(&[*id])
                        .pop()
                        .map(|g| g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap())
                        .unwrap_or_default()
                })
                .collect::<Vec<_>>())
        })
        .unwrap();
    // Each parameter owned whole by one rank (balanced), holding the mean: rank 0's values halved.
    let mut held: Vec<Vec<f32>> = slices
        .into_iter()
        .flatten()
        .filter(|g| !g.is_empty())
        .collect();
    held.sort_by(|a, b| a[0].total_cmp(&b[0]));
    assert_eq!(
        held,
        vec![vec![0.0, 0.5, 1.0, 1.5], vec![5.0, 5.5, 6.0, 6.5]]
    );
}
