//! Every strategy trained on in-process ranks sharing one device over a communicator that refuses every call
//! carrying values through host memory ([`NoHostBuffers`]), against the same training through host memory: what
//! `burn-accelerate test` runs where its ranks share a device (one GPU, or wgpu on Vulkan's software driver in
//! CI), so that "no parameter or gradient crosses host memory" is shown by a run that would fail, not by a count.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::AdamConfig;
use burn::tensor::{DType, Device, Tensor};

use super::fixed_linear;
use crate::Blocks;
use crate::accelerator::{Accelerator, AcceleratorBuilder};
use crate::config::{GradientTransport, ShardingStrategy};
use crate::distributed::cluster::launch_ranks_over;
use crate::distributed::comm::{
    CommError, CommResult, Communicator, ReduceBuffer, ReduceOp, SharedValue,
};
use crate::distributed::tensor_comm::on_device::{DtypeCheck, compare};
use crate::error::{Error, Result};

/// A communicator that refuses every call carrying values through host memory (collective buffers and
/// point-to-point messages) and forwards the rest: byte messages (control: agreements, call checks, parameter
/// ids) and the shared values of ranks in one process; with `single_values`, also the all-reduce of one f64 (a
/// verdict or a norm), which a device library's path leaves on the host. The bytes and single values it forwards
/// are counted in `control_bytes` (shared by the ranks of one run; single values apart, each rank its own)
/// and bounded by its [`ControlBudget`]: past it, they are refused too, so that values sent as bytes (a serialised
/// gradient) or one by one cannot pass for control.
#[derive(Debug)]
pub(crate) struct NoHostBuffers {
    inner: Arc<dyn Communicator>,
    control_bytes: Arc<AtomicUsize>,
    single_values_sent: Arc<AtomicUsize>,
    single_values: bool,
    budget: ControlBudget,
}

/// The control bytes a run over [`NoHostBuffers`] may pass through host memory, all its ranks together: what its
/// agreements, call checks and parameter ids take, well under one step's parameters or gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ControlBudget {
    /// What the budget is for, in the refusal.
    pub name: &'static str,
    /// Bytes, all ranks together.
    pub bytes: usize,
    /// Single values (where they are let through), each rank.
    pub single_values: usize,
}

/// The budget of [`check_strategies_without_host_buffers`]'s trainings (3 steps of a 273-parameter stack on 2 or
/// 4 ranks): their agreements and parameter ids measured 122 to 126 bytes, where one block's weight is 400 bytes
/// and one step's gradients 1,092 bytes a rank.
pub(crate) const CHECK_BUDGET: ControlBudget = ControlBudget {
    name: "the no-host-buffer check's trainings",
    bytes: 256,
    single_values: 0,
};

impl NoHostBuffers {
    /// `inner`, refusing buffers; control bytes added to `control_bytes`, and refused past `budget`.
    pub fn new(
        inner: Arc<dyn Communicator>,
        control_bytes: Arc<AtomicUsize>,
        single_values: bool,
        budget: ControlBudget,
    ) -> Self {
        Self {
            inner,
            control_bytes,
            single_values_sent: Arc::new(AtomicUsize::new(0)),
            single_values,
            budget,
        }
    }

    /// Counts `bytes` of control; an error once the run's control is past its budget.
    fn control(&self, operation: &str, bytes: usize) -> CommResult<()> {
        let total = self.control_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.within(operation, total, self.budget.bytes, "control bytes")
    }

    /// Counts one single value; an error once the run's single values are past their budget.
    fn single_value(&self, operation: &str) -> CommResult<()> {
        let total = self.single_values_sent.fetch_add(1, Ordering::Relaxed) + 1;
        self.within(operation, total, self.budget.single_values, "single values")
    }

    fn within(&self, operation: &str, total: usize, budget: usize, what: &str) -> CommResult<()> {
        if total <= budget {
            return Ok(());
        }
        Err(CommError::Engine {
            engine: "no host buffers",
            operation: operation.into(),
            reason: format!(
                "{total} {what} through host memory, past the budget of {budget} for {}: values sent as control?",
                self.budget.name
            ),
        })
    }

    fn refuse<T>(&self, operation: &str, values: usize, kind: &str) -> CommResult<T> {
        Err(CommError::Engine {
            engine: "no host buffers",
            operation: operation.into(),
            reason: format!("{values} {kind} values through host memory"),
        })
    }
}

impl Communicator for NoHostBuffers {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn barrier(&self) -> CommResult<()> {
        self.inner.barrier()
    }
    fn concurrent(&self) -> bool {
        self.inner.concurrent()
    }
    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> CommResult<ReduceBuffer> {
        if self.single_values && matches!(&data, ReduceBuffer::F64(v) if v.len() == 1) {
            self.single_value("all_reduce")?;
            return self.inner.all_reduce(data, op);
        }
        self.refuse("all_reduce", data.len(), data.kind())
    }
    fn reduce_scatter(
        &self,
        data: ReduceBuffer,
        _counts: &[usize],
        _op: ReduceOp,
    ) -> CommResult<ReduceBuffer> {
        self.refuse("reduce_scatter", data.len(), data.kind())
    }
    fn reduce(
        &self,
        data: ReduceBuffer,
        _root: usize,
        _op: ReduceOp,
    ) -> CommResult<Option<ReduceBuffer>> {
        self.refuse("reduce", data.len(), data.kind())
    }
    fn broadcast_buffer(&self, data: ReduceBuffer, _root: usize) -> CommResult<ReduceBuffer> {
        self.refuse("broadcast_buffer", data.len(), data.kind())
    }
    fn all_gather_parts(&self, data: ReduceBuffer, _counts: &[usize]) -> CommResult<ReduceBuffer> {
        self.refuse("all_gather_parts", data.len(), data.kind())
    }
    fn send_recv(
        &self,
        sends: Vec<(usize, ReduceBuffer)>,
        recvs: Vec<(usize, ReduceBuffer)>,
    ) -> CommResult<Vec<ReduceBuffer>> {
        let values = sends.iter().chain(&recvs).map(|(_, b)| b.len()).sum();
        self.refuse("send_recv", values, "f32")
    }
    fn all_gather(&self, data: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        self.control("all_gather", data.len())?;
        self.inner.all_gather(data)
    }
    fn broadcast(&self, data: Vec<u8>, root: usize) -> CommResult<Vec<u8>> {
        self.control("broadcast", data.len())?;
        self.inner.broadcast(data, root)
    }
    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        Ok(Arc::new(Self {
            inner: self.inner.split(color, key)?,
            control_bytes: self.control_bytes.clone(),
            single_values_sent: self.single_values_sent.clone(),
            single_values: self.single_values,
            budget: self.budget,
        }))
    }
    fn shares_memory(&self) -> bool {
        self.inner.shares_memory()
    }
    fn share(&self, operation: &'static str, value: SharedValue) -> CommResult<Vec<SharedValue>> {
        self.inner.share(operation, value)
    }
    fn send_recv_shared(
        &self,
        sends: Vec<(usize, SharedValue)>,
        recvs: Vec<usize>,
    ) -> CommResult<Vec<SharedValue>> {
        self.inner.send_recv_shared(sends, recvs)
    }
}

/// The check's model: two blocks and a head with fixed weights.
#[derive(Module, Debug)]
struct CheckStack {
    blocks: Vec<Linear>,
    head: Linear,
}

impl Blocks for CheckStack {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.blocks
    }
}

/// Each strategy the check trains: its name, the strategy, the ranks, and whether the pass is block-wise
/// (`backward_blocks`, each block gathered and reduced on its own). The hybrids shard over groups of 2.
const CASES: [(&str, ShardingStrategy, usize, bool); 6] = [
    ("NO_SHARD", ShardingStrategy::NoShard, 2, false),
    ("SHARD_GRAD_OP", ShardingStrategy::ShardGradOp, 2, false),
    ("FULL_SHARD", ShardingStrategy::FullShard, 2, false),
    (
        "FULL_SHARD block-wise",
        ShardingStrategy::FullShard,
        2,
        true,
    ),
    ("HYBRID_SHARD", ShardingStrategy::HybridShard, 4, false),
    (
        "_HYBRID_SHARD_ZERO2",
        ShardingStrategy::HybridShardZero2,
        4,
        false,
    ),
];

/// Three Adam steps of [`CheckStack`] on each rank's own fixed data, whole or block-wise: the rank's weights
/// after (the whole model, gathered).
fn train(acc: Accelerator, block_wise: bool) -> Result<Vec<f32>> {
    let device = acc.device().clone();
    let stack = CheckStack {
        blocks: vec![
            fixed_linear(12, 10, 0.3, &device),
            fixed_linear(10, 10, 0.9, &device),
        ],
        head: fixed_linear(10, 3, 1.7, &device),
    };
    let mut net = acc.prepare_model(stack)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
    let rank = acc.process_index();
    for step in 0..3 {
        let values: Vec<f32> = (0..8 * 12)
            .map(|i| ((i * 5 + step * 3 + rank * 11) as f32 * 0.21).cos())
            .collect();
        let x = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([8, 12]);
        if block_wise {
            acc.backward_blocks(
                &net,
                |_| x.clone(),
                |b, h| b.forward(h).tanh(),
                |m, h| m.head.forward(h).powi_scalar(2).mean(),
            )?;
        } else {
            let whole = acc.unshard(&net)?;
            let mut h = x;
            for b in &whole.blocks {
                h = b.forward(h).tanh();
            }
            acc.backward(whole.head.forward(h).powi_scalar(2).mean(), &whole)?;
        }
        net = optimizer.try_step(net)?;
    }
    let whole = acc.unshard(&net)?;
    let mut weights = Vec::new();
    for layer in whole.blocks.iter().chain([&whole.head]) {
        weights.extend(layer.weight.val().into_data().iter::<f32>());
    }
    Ok(weights)
}

/// Trains every strategy of [`CASES`] on in-process ranks on `device` twice: through host memory, and with
/// `transport` over a communicator that refuses every buffer ([`NoHostBuffers`], within [`CHECK_BUDGET`]);
/// `(strategy, check, control bytes)`: every rank's weights against the host path's, within 1e-5 of their scale
/// (the paths combine in other orders), and the control bytes the ranks passed through host memory.
///
/// # Errors
/// A training that failed, named: where `transport` passes a buffer through host memory, the refusal.
pub(crate) fn check_strategies_without_host_buffers(
    device: &Device,
    timeout: Duration,
    transport: GradientTransport,
) -> Result<Vec<(&'static str, DtypeCheck, usize)>> {
    let device = device.clone().without_autodiff();
    CASES
        .into_iter()
        .map(|(name, mode, ranks, block_wise)| {
            let builder = |preference: GradientTransport| {
                let builder = AcceleratorBuilder::default()
                    .device(device.clone())
                    .collective_timeout(timeout)
                    .sharding(mode)
                    .gradient_transport(preference)
                    // 256-byte buckets: several exchanges a step.
                    .bucket_size_mb(256.0 / (1 << 20) as f64);
                if mode.is_hybrid() {
                    builder.dp_shard_size(2)
                } else {
                    builder
                }
            };
            let failed = |path: &str, e: Error| Error::Execution {
                operation: "training without host buffers",
                device: format!("{device:?}"),
                reason: format!("{name} on {ranks} ranks, {path}: {e}"),
            };
            let host = builder(GradientTransport::Host)
                .launch(ranks, |acc| train(acc, block_wise))
                .map_err(|e| failed("through host memory", e))?;
            let refusing = builder(transport);
            let control = Arc::new(AtomicUsize::new(0));
            let refused = launch_ranks_over(
                ranks,
                timeout,
                |inner| {
                    Arc::new(NoHostBuffers::new(
                        inner,
                        control.clone(),
                        false,
                        CHECK_BUDGET,
                    )) as Arc<dyn Communicator>
                },
                |cluster| train(refusing.build_in(cluster)?, block_wise),
            )
            .map_err(|e| failed("with no buffer through host memory", e))?;
            let got: Vec<f32> = refused.concat();
            let exact: Vec<f64> = host.concat().into_iter().map(f64::from).collect();
            let bound = 1e-5 * exact.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1.0);
            let control = control.load(Ordering::Relaxed);
            Ok((name, compare(&got, &exact, bound, DType::F32), control))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;

    #[test]
    fn every_strategy_on_a_shared_device_passes_the_check_and_the_host_path_is_refused() {
        let device = Device::default();
        let timeout = Duration::from_secs(60);
        let checks =
            check_strategies_without_host_buffers(&device, timeout, GradientTransport::Auto)
                .unwrap();
        assert_eq!(checks.len(), CASES.len());
        for (name, check, control) in &checks {
            println!(
                "{name}: max |weights - the host path's| = {:e} (bound {:e}, {} weights), {control} control bytes",
                check.max_error, check.bound, check.checked
            );
            assert!(*control <= CHECK_BUDGET.bytes, "{name}: {control}");
            assert!(check.passed(), "{name}: {check:?}");
            assert!(check.checked > 0, "{name}");
        }
        // The same trainings forced through host memory fail at their first buffer.
        let refused =
            check_strategies_without_host_buffers(&device, timeout, GradientTransport::Host)
                .unwrap_err()
                .to_string();
        assert!(
            refused.contains("NO_SHARD") && refused.contains("through host memory"),
            "{refused}"
        );
    }

    #[test]
    fn the_transport_check_of_ranks_sharing_a_device_trains_every_strategy_on_the_main_process() {
        let checks = Accelerator::builder()
            .launch(2, |acc| {
                let check = acc.check_gradient_transport()?;
                Ok((acc.is_main_process(), check))
            })
            .unwrap();
        for (main, check) in checks {
            let check = check.expect("ranks sharing a device check the shared device path");
            assert!(check.transport.contains("device exchange"), "{check:?}");
            assert!(check.passed(), "{check:?}");
            let names: Vec<&str> = check.without_host_buffers.iter().map(|(n, _)| *n).collect();
            let expected: Vec<&str> = if main {
                CASES.iter().map(|c| c.0).collect()
            } else {
                Vec::new()
            };
            assert_eq!(names, expected);
        }
    }
}
