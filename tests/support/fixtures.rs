//! Fixtures shared by the integration tests: the starting model, weight comparison, and a counting
//! communicator for tests that check when ranks communicate.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::module::Module;
use burn::tensor::Device;
use burn_accelerate::distributed::cluster::InProcess;
use burn_accelerate::distributed::comm::{
    CommResult, Communicator, InProcessGroup, ReduceBuffer, ReduceOp,
};
use burn_accelerate::{Accelerator, AcceleratorBuilder, Result};

use crate::mlp::{Mlp, weights};

/// The quicktour MLP with its parameters drawn (Burn draws them lazily), on the autodiff device: the same values on
/// every call and every run, with fresh parameter ids. Burn's random generator is process-wide, and the tests of a
/// binary run side by side, so a draw made while a test runs could take other tests' draws in between the seed and
/// the parameters; the values are therefore drawn once, before `main` starts any test thread (seed 17, as the
/// tolerances of the tests that use this model were measured on), and every call loads them into a new model.
pub fn initial() -> Mlp {
    let device = Device::default().autodiff();
    let mut values = initial_values().iter();
    let model = Mlp::new(&device).map(&mut Load(&mut values));
    assert!(
        values.next().is_none(),
        "the quicktour MLP has as many parameters as were drawn"
    );
    model
}

/// The values of [`initial`]'s parameters, in visiting order.
fn initial_values() -> &'static [Vec<f32>] {
    static VALUES: std::sync::OnceLock<Vec<Vec<f32>>> = std::sync::OnceLock::new();
    VALUES.get_or_init(|| {
        let device = Device::default().autodiff();
        device.seed(17);
        weights(&Mlp::new(&device))
    })
}

#[ctor::ctor(unsafe)]
fn draw_initial_values_before_any_test_runs() {
    initial_values();
}

/// Replaces each float parameter, in visiting order, with the next values (same shape, same `require_grad`).
struct Load<'a, 'b>(&'a mut std::slice::Iter<'b, Vec<f32>>);

impl burn::module::ModuleMapper for Load<'_, '_> {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<burn::tensor::Tensor<D>>,
    ) -> burn::module::Param<burn::tensor::Tensor<D>> {
        let values = self
            .0
            .next()
            .expect("more parameters than were drawn")
            .clone();
        param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            let data = burn::tensor::TensorData::new(values, tensor.shape());
            burn::tensor::Tensor::from_data(data, &tensor.device()).set_require_grad(require_grad)
        })
    }
}

/// The largest absolute difference between two models' weights (as [`weights`] lists them). A different
/// number of tensors or elements, or a NaN on either side, is infinitely different, so a tolerance check on
/// the result fails.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.len() != y.len()) {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

/// A communicator that counts the all-reduces it forwards to the one it wraps (a decorator for tests).
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn Communicator>,
    all_reduces: Arc<AtomicU64>,
}

impl Communicator for Counting {
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
    fn all_reduce(&self, data: ReduceBuffer, op: ReduceOp) -> CommResult<ReduceBuffer> {
        let out = self.inner.all_reduce(data, op)?;
        self.all_reduces.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
    fn all_gather(&self, data: Vec<u8>) -> CommResult<Vec<Vec<u8>>> {
        self.inner.all_gather(data)
    }
    fn broadcast(&self, data: Vec<u8>, root: usize) -> CommResult<Vec<u8>> {
        self.inner.broadcast(data, root)
    }
}

/// Runs `f` on `ranks` in-process ranks whose communicators count their all-reduces; `f` gets its rank's
/// accelerator and a reader of that count. Returns every rank's result in rank order.
pub fn launch_counting<T, F>(builder: AcceleratorBuilder, ranks: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Accelerator, &dyn Fn() -> u64) -> Result<T> + Sync,
{
    let group = InProcessGroup::new(ranks, Duration::from_secs(120));
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (group, builder, f) = (&group, &builder, &f);
                scope.spawn(move || {
                    let all_reduces = Arc::new(AtomicU64::new(0));
                    let comm = Counting {
                        inner: Arc::new(group.comm(rank)),
                        all_reduces: all_reduces.clone(),
                    };
                    let count = move || all_reduces.load(Ordering::Relaxed);
                    let out = builder
                        .build_in(&InProcess::new(Arc::new(comm)))
                        .and_then(|acc| f(acc, &count));
                    group.leave(rank, "finished");
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}
