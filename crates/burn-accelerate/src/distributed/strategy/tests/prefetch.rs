//! Block-wise `FULL_SHARD` prefetches: a recording communicator shows each block's all-gather started before the
//! block ahead of it computes, and never more than two blocks gathered at once, forward and backward.

use std::sync::Mutex;

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{DType, Device, Tensor};

use super::*;
use crate::distributed::ProcessGroup;
use crate::distributed::tensor_comm::{Checked, Incoming, Pending, Reduction, TensorComm};

/// What rank 0 saw, in order: `G` a parameter all-gather started, `R` / `r` a gradient reduce-scatter started /
/// waited for, `C<i>` block `i` computed.
type Log = Arc<Mutex<Vec<String>>>;

/// The host implementation, logging every all-gather it starts on rank 0.
#[derive(Debug)]
struct Recording {
    inner: Arc<dyn TensorComm>,
    log: Log,
}

impl TensorComm for Recording {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn wire_dtype(&self, dtype: DType) -> DType {
        self.inner.wire_dtype(dtype)
    }
    fn all_reduce(
        &self,
        flat: Tensor<1>,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        self.inner.all_reduce(flat, how, operation)
    }
    fn reduce(
        &self,
        flat: Tensor<1>,
        root: usize,
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Option<Tensor<1>>>> {
        self.inner.reduce(flat, root, how, operation)
    }
    fn reduce_scatter(
        &self,
        flat: Tensor<1>,
        counts: &[usize],
        how: Reduction,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        let pending = self.inner.reduce_scatter(flat, counts, how, operation)?;
        if self.rank() != 0 {
            return Ok(pending);
        }
        // `R` when started, `r` when waited for.
        self.log.lock().unwrap().push("R".into());
        let log = self.log.clone();
        Ok(pending.then(move |part| {
            log.lock().unwrap().push("r".into());
            Ok(part)
        }))
    }
    fn all_gather(
        &self,
        part: Tensor<1>,
        counts: &[usize],
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        if self.rank() == 0 {
            self.log.lock().unwrap().push("G".into());
        }
        self.inner.all_gather(part, counts, operation)
    }
    fn broadcast(
        &self,
        flat: Tensor<1>,
        root: usize,
        operation: &'static str,
    ) -> Result<Pending<Tensor<1>>> {
        self.inner.broadcast(flat, root, operation)
    }
    fn all_reduce_value(&self, value: f64, op: ReduceOp, operation: &'static str) -> Result<f64> {
        self.inner.all_reduce_value(value, op, operation)
    }
    fn send_recv(
        &self,
        sends: Vec<(usize, Tensor<1>)>,
        recvs: Vec<Incoming>,
        operation: &'static str,
    ) -> Result<Pending<Vec<Tensor<1>>>> {
        self.inner.send_recv(sends, recvs, operation)
    }
    fn on_group(&self, group: Arc<ProcessGroup>) -> Result<Arc<dyn TensorComm>> {
        Ok(Arc::new(Recording {
            inner: self.inner.on_group(group)?,
            log: self.log.clone(),
        }))
    }
}

/// Blocks (one bucket each) and a head outside them.
#[derive(Module, Debug)]
pub(super) struct Deep {
    pub blocks: Vec<Linear>,
    pub head: Linear,
}

impl crate::Blocks for Deep {
    type Block = Linear;
    fn blocks(&self) -> &[Linear] {
        &self.blocks
    }
}

#[test]
fn each_block_is_gathered_and_reduced_while_its_neighbour_computes_and_never_more_than_two_gathered()
 {
    const BLOCKS: usize = 4;
    let log: Log = Arc::default();
    let recorded = log.clone();
    let builder = AcceleratorBuilder::default()
        .sharding(ShardingStrategy::FullShard)
        .strategy(Arc::new(move |group| {
            let comm: Arc<dyn TensorComm> = Arc::new(Recording {
                inner: Arc::new(Checked::host(group.clone())),
                log: recorded.clone(),
            });
            Ok(Arc::new(Sharded::new(
                group.clone(),
                comm,
                ShardingStrategy::FullShard,
                25 << 20,
            )))
        }));
    let blocks_log = log.clone();
    builder
        .launch(2, move |acc: Accelerator| {
            let device: Device = acc.device().clone();
            let deep = Deep {
                blocks: (0..BLOCKS)
                    .map(|i| super::linear(6, 6, 0.1 * i as f32, &device))
                    .collect(),
                head: super::linear(6, 1, 0.9, &device),
            };
            let model = acc.prepare_model(deep)?;
            let rank = acc.process_index();
            if rank == 0 {
                blocks_log.lock().unwrap().clear();
            }
            acc.wait_for_everyone()?;
            let x = Tensor::<2>::ones([3, 6], &device);
            let index = |layer: &Linear, model: &Deep| {
                model
                    .blocks
                    .iter()
                    .position(|b| b.weight.id == layer.weight.id)
                    .unwrap_or(usize::MAX)
            };
            let _ = acc.backward_blocks(
                &model,
                |_| x.clone(),
                |layer, h| {
                    if rank == 0 {
                        let i = index(layer, &model);
                        blocks_log.lock().unwrap().push(format!("C{i}"));
                    }
                    layer.forward(h).tanh()
                },
                |m, h| m.head.forward(h).sum(),
            )?;
            Ok(())
        })
        .unwrap();
    let log = log.lock().unwrap().clone();
    // The first gather is what lies outside the blocks (the head), for `before`; then one per block forward, the
    // head again for `after`, and one per block backward.
    let computes: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, e)| e.starts_with('C'))
        .map(|(at, _)| at)
        .collect();
    assert_eq!(computes.len(), 2 * BLOCKS, "{log:?}");
    let gathers_before = |at: usize| log[..at].iter().filter(|e| *e == "G").count();
    for (k, &at) in computes.iter().enumerate() {
        // Forward: block k runs after the rest and blocks 0..=k+1 were started (block k + 1 prefetched). Backward
        // (k = BLOCKS + j runs block BLOCKS - 1 - j): the forward's gathers, the rest gathered again for `after`
        // (it was freed after `before`), then BLOCKS - j + 1 of its own.
        let expected = if k < BLOCKS {
            1 + (k + 2).min(BLOCKS)
        } else {
            let j = k - BLOCKS;
            1 + BLOCKS + 1 + (j + 2).min(BLOCKS)
        };
        assert_eq!(
            gathers_before(at),
            expected,
            "compute #{k} ({}): the next block's gather must be started before it, and no further one: {log:?}",
            log[at]
        );
        // Backward, after the last block: the block behind's gradient reduction runs while this one computes.
        if k > BLOCKS {
            let count = |e: &str| log[..at].iter().filter(|x| *x == e).count();
            assert_eq!(
                count("R") - count("r"),
                1,
                "compute #{k} ({}): one reduction in flight: {log:?}",
                log[at]
            );
        }
    }
}
