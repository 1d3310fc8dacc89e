//! AdamW in one pass over each parameter (torch's `AdamW(fused=True)`, DeepSpeed's `DeepSpeedCPUAdam`): on the
//! Flex (CPU) backend, one loop reads a parameter, its gradient and both moments and writes the parameter and the
//! moments back in place, where Burn's [`AdamW`] makes about a dozen whole-tensor passes. Every element gets the
//! same f32 operations in the same order as Burn's AdamW, so the results are the same bits; the state is Burn's
//! own [`AdamWState`], so a checkpoint written with either optimizer loads into the other. Tensors the loop
//! cannot take (another backend, another dtype than f32, a strided view) go through Burn's AdamW, as do AMSGrad
//! and cautious weight decay, which this optimizer does not offer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::optim::{AdamW, AdamWConfig, AdamWState, LearningRate, ModuleOptimizer, Optimizer};
use burn::tensor::{Device, Tensor};

/// The settings of [`FusedAdamW`]: those of Burn's [`AdamWConfig`], with its defaults (β₁ 0.9, β₂ 0.999, ε
/// 1e-5, weight decay 1e-4).
///
/// ```
/// use burn_accelerate::optim::FusedAdamWConfig;
/// # let accelerator = burn_accelerate::Accelerator::new()?;
/// let optimizer = accelerator.prepare_optimizer(FusedAdamWConfig::new().with_weight_decay(0.01).init(), 1e-3);
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdamWConfig {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl Default for FusedAdamWConfig {
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 1e-4,
        }
    }
}

impl FusedAdamWConfig {
    /// Burn's AdamW defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The first moment's decay rate β₁.
    pub fn with_beta_1(mut self, beta_1: f32) -> Self {
        self.beta_1 = beta_1;
        self
    }

    /// The second moment's decay rate β₂.
    pub fn with_beta_2(mut self, beta_2: f32) -> Self {
        self.beta_2 = beta_2;
        self
    }

    /// The term added to the denominator for numerical stability.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// The decoupled weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Burn's [`AdamWConfig`] with the same settings (what runs for tensors the fused loop cannot take).
    pub fn to_burn(&self) -> AdamWConfig {
        AdamWConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
    }

    /// The optimizer, for one parameter group (Burn's `ModuleOptimizer::with_group`).
    pub fn build(&self) -> FusedAdamW {
        FusedAdamW {
            config: *self,
            burn: self.to_burn().build(),
            updates: FusedAdamWUpdates::default(),
        }
    }

    /// The optimizer of a whole module, for `Accelerator::prepare_optimizer` or burn-train's `Learner`.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }

    /// [`init`](Self::init), with a count of the tensor updates the fused loop made and of those that went
    /// through Burn's AdamW (to see that a setup takes the fast path):
    ///
    /// ```
    /// use burn_accelerate::optim::FusedAdamWConfig;
    /// let (optimizer, updates) = FusedAdamWConfig::new().init_counted();
    /// # drop(optimizer);
    /// assert_eq!((updates.fused(), updates.fallback()), (0, 0));
    /// ```
    pub fn init_counted(&self) -> (ModuleOptimizer, FusedAdamWUpdates) {
        let optimizer = self.build();
        let updates = optimizer.updates();
        (ModuleOptimizer::from(optimizer), updates)
    }
}

/// How many tensor updates a [`FusedAdamW`] (and its copies) made in its fused loop, and how many went through
/// Burn's AdamW (another backend or dtype, a strided view); shared, so that it can be read while the optimizer
/// steps.
#[derive(Debug, Clone, Default)]
pub struct FusedAdamWUpdates(Arc<[AtomicU64; 2]>);

impl FusedAdamWUpdates {
    /// Tensor updates made by the fused loop.
    pub fn fused(&self) -> u64 {
        self.0[0].load(Ordering::Relaxed)
    }

    /// Tensor updates that went through Burn's AdamW.
    pub fn fallback(&self) -> u64 {
        self.0[1].load(Ordering::Relaxed)
    }

    fn count(&self, fused: bool) {
        self.0[usize::from(!fused)].fetch_add(1, Ordering::Relaxed);
    }
}

/// AdamW in one pass over each parameter (see the module's documentation and [`FusedAdamWConfig`]).
#[derive(Clone)]
pub struct FusedAdamW {
    config: FusedAdamWConfig,
    burn: AdamW,
    updates: FusedAdamWUpdates,
}

impl FusedAdamW {
    /// The count of this optimizer's updates, each way (shared with its copies).
    pub fn updates(&self) -> FusedAdamWUpdates {
        self.updates.clone()
    }
}

impl std::fmt::Debug for FusedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdamW")
            .field("config", &self.config)
            .finish()
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        #[cfg(feature = "flex")]
        let (tensor, grad, state) = match flex::step(&self.config, lr, tensor, grad, state) {
            Ok(done) => {
                self.updates.count(true);
                return done;
            }
            Err(given_back) => *given_back,
        };
        self.updates.count(false);
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <AdamW as Optimizer>::to_device(state, device)
    }
}

/// The coefficients of one step, computed once per tensor as Burn's AdamW computes them.
#[cfg(feature = "flex")]
#[derive(Debug, Clone, Copy)]
struct Coefficients {
    beta_1: f32,
    beta_2: f32,
    /// 1 - β₁, 1 - β₂.
    factor_1: f32,
    factor_2: f32,
    /// The bias corrections 1 - β₁ᵗ, 1 - β₂ᵗ.
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    /// What the parameter is multiplied by before the update (1 - lr × decay, narrowed to f32), if anything.
    decay: Option<f32>,
    lr: f32,
}

#[cfg(feature = "flex")]
impl Coefficients {
    fn new(config: &FusedAdamWConfig, lr: LearningRate, time: usize) -> Self {
        let time = time as i32;
        let decay_rate = lr * (config.weight_decay as f64);
        Self {
            beta_1: config.beta_1,
            beta_2: config.beta_2,
            factor_1: 1.0 - config.beta_1,
            factor_2: 1.0 - config.beta_2,
            correction_1: 1f32 - config.beta_1.powi(time),
            correction_2: 1f32 - config.beta_2.powi(time),
            epsilon: config.epsilon,
            decay: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: lr as f32,
        }
    }

    /// One element, in Burn's order of operations. `first`: no moments yet (Burn starts them from the gradient
    /// alone, not from zeros, which can differ in the sign of a zero).
    #[inline(always)]
    fn update(&self, param: &mut f32, grad: f32, m: &mut f32, v: &mut f32, first: bool) {
        if first {
            *m = grad * self.factor_1;
            *v = (grad * grad) * self.factor_2;
        } else {
            *m = *m * self.beta_1 + grad * self.factor_1;
            *v = *v * self.beta_2 + (grad * grad) * self.factor_2;
        }
        let m_hat = *m / self.correction_1;
        let v_hat = *v / self.correction_2;
        let delta = m_hat / (v_hat.sqrt() + self.epsilon);
        let decayed = match self.decay {
            Some(factor) => *param * factor,
            None => *param,
        };
        *param = decayed - delta * self.lr;
    }
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;
    use burn::optim::AdaptiveMomentumState;
    use burn::tensor::{DType, Device, Tensor};

    use super::*;

    type Step<const D: usize> = (Tensor<D>, Option<AdamWState<D>>);
    type Inputs<const D: usize> = (Tensor<D>, Tensor<D>, Option<AdamWState<D>>);

    /// Whether `tensor` is an f32 tensor of the Flex backend.
    fn on_flex<const D: usize>(tensor: &Tensor<D>) -> bool {
        tensor.dtype() == DType::F32 && tensor.device() == Device::flex()
    }

    /// A handle on `tensor`'s Flex buffer when it is contiguous from its start (sharing the buffer: once the
    /// tensor itself is dropped, the handle is its only holder, unless the caller keeps another, in which case
    /// writing copies it once).
    fn primitive<const D: usize>(tensor: &Tensor<D>) -> Option<FlexTensor> {
        let flex = tensor.clone().try_into_primitive::<Flex>().ok()?;
        matches!(flex.layout().contiguous_offsets(), Some((0, _))).then_some(flex)
    }

    /// A handle on `tensor`'s Flex buffer and where its values start, when they lie contiguous anywhere in it: a
    /// gradient that is a view into a bucket's reduced buffer, a rank's slice of a parameter (`SHARD_GRAD_OP` cuts
    /// each to its slice before the step: a view into the whole, then the view's alone).
    fn readable<const D: usize>(tensor: &Tensor<D>) -> Option<(FlexTensor, usize)> {
        let flex = tensor.clone().try_into_primitive::<Flex>().ok()?;
        let (start, _) = flex.layout().contiguous_offsets()?;
        Some((flex, start))
    }

    /// The fused step, or the inputs back when a tensor is not a plain f32 Flex tensor.
    pub(super) fn step<const D: usize>(
        config: &FusedAdamWConfig,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> Result<Step<D>, Box<Inputs<D>>> {
        let moments_fit = state.as_ref().is_none_or(|s| {
            s.momentum.max_moment_2.is_none()
                && on_flex(&s.momentum.moment_1)
                && on_flex(&s.momentum.moment_2)
                && s.momentum.moment_1.shape() == tensor.shape()
                && s.momentum.moment_2.shape() == tensor.shape()
        });
        if !(on_flex(&tensor) && on_flex(&grad) && grad.shape() == tensor.shape() && moments_fit) {
            return Err(Box::new((tensor, grad, state)));
        }
        let shape = tensor.shape();
        let n = shape.num_elements();
        let first = state.is_none();
        let time = state.as_ref().map_or(1, |s| s.momentum.time + 1);
        let handles = (
            readable(&tensor),
            readable(&grad),
            state.as_ref().map(|s| primitive(&s.momentum.moment_1)),
            state.as_ref().map(|s| primitive(&s.momentum.moment_2)),
        );
        let ((mut param, at), grad_flex, mut m, mut v) = match handles {
            (Some(p), Some(g), None, None) => {
                let device = tensor.device();
                let zeros = || primitive(&Tensor::<D>::zeros(shape.clone(), &device));
                match (zeros(), zeros()) {
                    (Some(m), Some(v)) => (p, g, m, v),
                    _ => return Err(Box::new((tensor, grad, state))),
                }
            }
            (Some(p), Some(g), Some(Some(m)), Some(Some(v))) => (p, g, m, v),
            _ => return Err(Box::new((tensor, grad, state))),
        };
        // The handles alone hold the buffers now, so the loop writes them in place.
        drop((tensor, grad, state));
        let coefficients = Coefficients::new(config, lr, time);
        {
            let (grad_flex, start) = grad_flex;
            let grads: &[f32] = &grad_flex.storage::<f32>()[start..start + n];
            // A slice's buffer is its own by now (the whole it was cut from is gone), so this writes in place.
            let params: &mut [f32] = &mut param.storage_mut::<f32>()[at..at + n];
            let ms: &mut [f32] = &mut m.storage_mut::<f32>()[..n];
            let vs: &mut [f32] = &mut v.storage_mut::<f32>()[..n];
            for (((p, g), m), v) in params
                .iter_mut()
                .zip(grads)
                .zip(ms.iter_mut())
                .zip(vs.iter_mut())
            {
                coefficients.update(p, *g, m, v, first);
            }
        }
        let state = AdamWState::new(AdaptiveMomentumState::new(
            time,
            Tensor::from_primitive::<Flex>(m),
            Tensor::from_primitive::<Flex>(v),
        ));
        Ok((Tensor::from_primitive::<Flex>(param), Some(state)))
    }
}
