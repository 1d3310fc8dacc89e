use rustc_hash::{FxHashMap as HashMap, FxHashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Shape, Tensor};

/// Highest tensor rank kept in its own shape; higher ranks are stored flat from the start.
const MAX_SHAPED_RANK: usize = 8;

/// The gradients accumulated since the last optimizer step, keyed by parameter id.
///
/// A gradient stays in Burn's own container, in its own shape, as long as only the optimizer needs it (the
/// common path: the container is handed to the optimizer as is). An operation over all gradients (clipping,
/// cross-rank averaging) flattens the gradients it touches.
#[derive(Default)]
pub(crate) struct GradientBuffer {
    /// Gradients in their own shape.
    shaped: GradientsParams,
    /// Gradients that were flattened, with their shape.
    flat: HashMap<ParamId, (Shape, Tensor<1>)>,
    /// The number of dimensions of every stored gradient, by parameter (no shape is kept on the common path: it would cost an allocation
    /// per parameter and step).
    tensor_ranks: HashMap<ParamId, usize>,
    /// The gradients stored in `flat` that a sharded strategy reduced to this rank's slice: a whole gradient added
    /// for one of them (the next micro-batch of an accumulation window that synchronises each batch) sets the
    /// slice aside, and the next reduction adds it back ([`add_reduced`](Self::add_reduced)).
    reduced: FxHashSet<ParamId>,
    /// Reduced slices set aside while whole gradients for the same parameters accumulate.
    set_aside: HashMap<ParamId, (Shape, Tensor<1>)>,
}

impl std::fmt::Debug for GradientBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientBuffer")
            .field("params", &self.tensor_ranks.len())
            .field("flattened", &self.flat.len())
            .finish()
    }
}

/// Where the gradients of a backward pass can be taken from, parameter by parameter.
pub(crate) trait GradSource {
    /// Removes and returns the gradient of `param`, if there is one.
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>>;
}

impl GradSource for Gradients {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>> {
        param.val().grad_remove(self)
    }
}

impl GradSource for GradientsParams {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>> {
        self.remove::<D>(param.id)
    }
}

impl GradSource for GradientBuffer {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Option<Tensor<D>> {
        let id = param.id;
        if let Some((shape, flat)) = self.flat.remove(&id) {
            self.tensor_ranks.remove(&id);
            let shape = if shape.num_dims() == D {
                shape
            } else {
                param.shape()
            };
            return Some(flat.reshape(shape));
        }
        let grad = self.shaped.remove::<D>(id)?;
        self.tensor_ranks.remove(&id);
        Some(grad)
    }
}

/// Moves the gradient of `id` (of rank `rank`) out of `shaped` and flattens it.
fn take_flat(shaped: &mut GradientsParams, id: ParamId, rank: usize) -> Option<(Shape, Tensor<1>)> {
    macro_rules! ranks {
        ($($d:literal),*) => {
            match rank {
                $($d => shaped.remove::<$d>(id).map(|t| {
                    let shape = t.shape();
                    let numel = shape.num_elements();
                    (shape, t.reshape([numel]))
                }),)*
                _ => None,
            }
        };
    }
    ranks!(1, 2, 3, 4, 5, 6, 7, 8)
}

impl GradientBuffer {
    /// An empty buffer.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Number of parameters holding a gradient.
    pub(crate) fn len(&self) -> usize {
        self.tensor_ranks.len()
    }

    /// Whether no gradient is stored.
    pub(crate) fn is_empty(&self) -> bool {
        self.tensor_ranks.is_empty()
    }

    /// The ids of every stored gradient.
    pub(crate) fn ids(&self) -> Vec<ParamId> {
        self.tensor_ranks.keys().copied().collect()
    }

    /// Drops every stored gradient.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Drops the gradient of one parameter (a rank that does not step it, under a sharded strategy).
    #[cfg_attr(not(test), allow(dead_code))]
    /// The device and dtype of the first of `ids` that has a gradient. Only those: a clone of the gradient kept
    /// here would share its memory, and moving that gradient to the host would then copy it instead of taking it.
    pub(crate) fn device_and_dtype(
        &mut self,
        ids: impl IntoIterator<Item = ParamId>,
    ) -> Option<(burn::tensor::Device, burn::tensor::DType)> {
        ids.into_iter()
            .find_map(|id| self.flat_mut(id).map(|like| (like.device(), like.dtype())))
    }

    /// Removes the gradient of `id` and returns its shape and flat values (the buffer's own tensor, not a clone,
    /// so that reading it back to the host can move its data); [`put`](Self::put) stores one back.
    pub(crate) fn take(&mut self, id: ParamId) -> Option<(Shape, Tensor<1>)> {
        self.flat_mut(id)?;
        self.tensor_ranks.remove(&id);
        self.flat.remove(&id)
    }

    /// [`take`](Self::take) of a gradient not yet reduced: `None` where `id`'s stored gradient is a reduced slice
    /// (set aside, to be added back by [`add_reduced`](Self::add_reduced)) or where there is none.
    pub(crate) fn take_unreduced(&mut self, id: ParamId) -> Option<(Shape, Tensor<1>)> {
        if self.reduced.remove(&id) {
            if let Some(slice) = self.take(id) {
                self.set_aside.insert(id, slice);
            }
            return None;
        }
        self.take(id)
    }

    /// Adds `flat`, this rank's reduced slice of `id`'s gradient, to the slice already reduced in this window
    /// (stored, or set aside), and stores it as a reduced slice of `shape` (`None`: its parameter's, taken when
    /// the optimizer takes it).
    pub(crate) fn add_reduced(&mut self, id: ParamId, shape: Option<Shape>, flat: Tensor<1>) {
        let earlier = match self.set_aside.remove(&id) {
            Some(slice) => Some(slice),
            None if self.reduced.contains(&id) => self.take(id),
            None => None,
        };
        let (shape, flat) = match (earlier, shape) {
            (Some((earlier_shape, earlier)), shape) => {
                (Some(shape.unwrap_or(earlier_shape)), earlier + flat)
            }
            (None, shape) => (shape, flat),
        };
        match shape {
            Some(shape) => self.put(id, shape, flat),
            None => self.set_flat(id, flat),
        }
        self.reduced.insert(id);
    }

    /// Stores `flat` as the gradient of `id`, of `shape`.
    pub(crate) fn put(&mut self, id: ParamId, shape: Shape, flat: Tensor<1>) {
        self.tensor_ranks.insert(id, shape.num_dims());
        self.flat.insert(id, (shape, flat));
    }

    /// Moves the gradients of `module`'s trainable parameters out of `grads` (the autodiff graph's `Gradients`,
    /// or Burn's optimizer container `GradientsParams`, as burn-train's `TrainStep` returns it) and adds them to
    /// the buffer. Returns how many parameters received a gradient.
    pub(crate) fn collect<M: Module, S: GradSource>(&mut self, module: &M, grads: &mut S) -> usize {
        struct Collect<'a, S> {
            grads: &'a mut S,
            buffer: &'a mut GradientBuffer,
            added: usize,
        }
        impl<S: GradSource> ModuleVisitor for Collect<'_, S> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if !param.is_require_grad() {
                    return;
                }
                if let Some(grad) = self.grads.take(param) {
                    self.buffer.add(param.id, grad);
                    self.added += 1;
                }
            }
        }
        let mut collect = Collect {
            grads,
            buffer: self,
            added: 0,
        };
        module.visit(&mut collect);
        collect.added
    }

    /// Adds `grad` to the gradient stored for `id` (or stores it).
    pub(crate) fn add<const D: usize>(&mut self, id: ParamId, grad: Tensor<D>) {
        // (Data parallelism never marks a gradient reduced: nothing is hashed on its path.)
        if !self.reduced.is_empty()
            && self.reduced.remove(&id)
            && let Some(slice) = self.take(id)
        {
            // A whole gradient for a parameter whose slice was reduced earlier in the window.
            self.set_aside.insert(id, slice);
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.tensor_ranks.entry(id) {
            slot.insert(D);
            if D <= MAX_SHAPED_RANK {
                self.shaped.register::<D>(id, grad);
            } else {
                let shape = grad.shape();
                let numel = shape.num_elements();
                self.flat.insert(id, (shape, grad.reshape([numel])));
            }
            return;
        }
        if let Some((shape, flat)) = self.flat.remove(&id) {
            let numel = shape.num_elements();
            self.flat.insert(id, (shape, flat + grad.reshape([numel])));
        } else if let Some(existing) = self.shaped.remove::<D>(id) {
            self.shaped.register::<D>(id, existing + grad);
        }
    }

    /// Makes sure this buffer holds a gradient of at least one of `params` (a zero gradient of the first one,
    /// found in `module`, when it holds none), so that a rank whose part of the batch gave none of them a gradient
    /// still makes the same collective calls as every other rank, with zeros of the right device and dtype.
    pub(crate) fn hold_one_of<M: Module>(&mut self, module: &M, params: &[(ParamId, usize)]) {
        let Some((first, _)) = params.first() else {
            return;
        };
        // Only whether one is held: nothing is flattened (a single device's step keeps its gradients as they are).
        if params
            .iter()
            .any(|(id, _)| self.tensor_ranks.contains_key(id))
        {
            return;
        }
        struct Zeros<'a> {
            id: ParamId,
            buffer: &'a mut GradientBuffer,
        }
        impl ModuleVisitor for Zeros<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if param.id == self.id && !self.buffer.tensor_ranks.contains_key(&param.id) {
                    self.buffer.add(param.id, param.val().detach().zeros_like());
                }
            }
        }
        module.visit(&mut Zeros {
            id: *first,
            buffer: self,
        });
    }

    /// Adds every gradient of `other` to this buffer's (gradients another pass produced, already reduced).
    pub(crate) fn absorb(&mut self, mut other: GradientBuffer) {
        for id in other.ids() {
            let reduced = other.reduced.remove(&id);
            let Some((shape, flat)) = other.take(id) else {
                continue;
            };
            if reduced {
                self.add_reduced(id, Some(shape), flat);
                continue;
            }
            match self.flat_mut(id) {
                Some(existing) => *existing = existing.clone() + flat,
                None => self.put(id, shape, flat),
            }
        }
    }

    /// The gradient stored for `id`, in its parameter's shape.
    pub(crate) fn get<const D: usize>(&self, id: ParamId) -> Option<Tensor<D>> {
        match self.flat.get(&id) {
            Some((shape, flat)) => Some(flat.clone().reshape(shape.clone())),
            None => self.shaped.get::<D>(id),
        }
    }

    /// The flat gradient of `id`, flattening it in the buffer if needed.
    fn flat_mut(&mut self, id: ParamId) -> Option<&mut Tensor<1>> {
        if !self.flat.contains_key(&id) {
            let rank = *self.tensor_ranks.get(&id)?;
            let entry = take_flat(&mut self.shaped, id, rank)?;
            self.flat.insert(id, entry);
        }
        self.flat.get_mut(&id).map(|(_, t)| t)
    }

    /// Applies `f` to the flat gradient of every id in `ids` that has one.
    pub(crate) fn map_flat(&mut self, ids: &[ParamId], mut f: impl FnMut(Tensor<1>) -> Tensor<1>) {
        for id in ids {
            if let Some(flat) = self.flat_mut(*id) {
                *flat = f(flat.clone());
            }
        }
    }

    /// Replaces the flat gradient of `id` with `f` of it, handing `f` the buffer's own tensor (not a clone), so
    /// that reading it back to the host can move its data instead of copying it. Returns `Ok(false)` when `id`
    /// has no gradient. When `f` fails, the gradient is gone (the step fails with that error).
    pub(crate) fn replace_flat<E>(
        &mut self,
        id: ParamId,
        f: impl FnOnce(Tensor<1>) -> std::result::Result<Tensor<1>, E>,
    ) -> std::result::Result<bool, E> {
        if self.flat_mut(id).is_none() {
            return Ok(false);
        }
        let (shape, flat) = self.flat.remove(&id).expect("flattened above");
        let new = f(flat)?;
        self.flat.insert(id, (shape, new));
        Ok(true)
    }

    /// The flat gradients of the ids in `ids` that have one, in the order of `ids`.
    pub(crate) fn flat(&mut self, ids: &[ParamId]) -> Vec<Tensor<1>> {
        ids.iter()
            .filter_map(|id| self.flat_mut(*id).map(|t| t.clone()))
            .collect()
    }

    /// Stores `flat` as the gradient of `id`. A parameter without a gradient so far (unused on this rank) gets
    /// its shape when the optimizer takes it.
    pub(crate) fn set_flat(&mut self, id: ParamId, flat: Tensor<1>) {
        let shape = match self.flat.remove(&id) {
            Some((shape, _)) => shape,
            None => match self.tensor_ranks.get(&id) {
                Some(rank) => take_flat(&mut self.shaped, id, *rank)
                    .map(|(shape, _)| shape)
                    .unwrap_or_else(|| Shape::from(vec![flat.dims()[0]])),
                None => {
                    self.tensor_ranks.insert(id, 1);
                    Shape::from(vec![flat.dims()[0]])
                }
            },
        };
        self.flat.insert(id, (shape, flat));
    }

    /// Removes the gradients of `module`'s parameters and returns them in Burn's optimizer format. When every
    /// stored gradient belongs to `module` (the usual case), the container is handed over without copying.
    pub(crate) fn take_for<M: Module>(&mut self, module: &M) -> GradientsParams {
        struct Gather<'a> {
            buffer: &'a mut GradientBuffer,
            ids: Vec<ParamId>,
        }
        impl ModuleVisitor for Gather<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let id = param.id;
                if !self.buffer.tensor_ranks.contains_key(&id) {
                    return;
                }
                self.ids.push(id);
                if self.buffer.flat.is_empty() {
                    return;
                }
                if let Some((shape, flat)) = self.buffer.flat.remove(&id) {
                    // Back to the parameter's shape (a gradient first stored flat takes it from the parameter).
                    let shape = if shape.num_dims() == D {
                        shape
                    } else {
                        param.shape()
                    };
                    self.buffer.shaped.register::<D>(id, flat.reshape(shape));
                }
            }
        }
        let mut gather = Gather {
            buffer: self,
            ids: Vec::new(),
        };
        module.visit(&mut gather);
        let ids = gather.ids;
        if !self.reduced.is_empty() || !self.set_aside.is_empty() {
            for id in &ids {
                self.reduced.remove(id);
                self.set_aside.remove(id);
            }
        }
        if ids.len() == self.tensor_ranks.len() {
            self.tensor_ranks.clear();
            return std::mem::take(&mut self.shaped);
        }
        struct Move<'a>(&'a mut GradientsParams, GradientsParams);
        impl ModuleVisitor for Move<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.0.remove::<D>(param.id) {
                    self.1.register::<D>(param.id, g);
                }
            }
        }
        for id in &ids {
            self.tensor_ranks.remove(id);
        }
        let mut mover = Move(&mut self.shaped, GradientsParams::new());
        module.visit(&mut mover);
        mover.1
    }
}

/// The ids of `module`'s float parameters, in visiting order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    let mut ids = Vec::new();
    crate::named_params::floats(module, |p| ids.push(p.id()));
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn accumulates_in_shape_and_after_flattening() {
        let device = Device::default();
        let mut buffer = GradientBuffer::new();
        let id = ParamId::new();
        let g = || Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
        buffer.add(id, g());
        buffer.add(id, g());
        assert_eq!(
            values(buffer.get::<2>(id).unwrap()),
            vec![2.0, 4.0, 6.0, 8.0]
        );
        // Flatten (as clipping does), then keep accumulating.
        buffer.map_flat(&[id], |t| t.mul_scalar(0.5));
        buffer.add(id, g());
        let back = buffer.get::<2>(id).unwrap();
        assert_eq!(back.dims(), [2, 2]);
        assert_eq!(values(back), vec![2.0, 4.0, 6.0, 8.0]);
        assert!(buffer.get::<3>(ParamId::new()).is_none());
    }

    #[test]
    fn high_rank_gradients_round_trip() {
        let device = Device::default();
        let mut buffer = GradientBuffer::new();
        let id = ParamId::new();
        buffer.add(id, Tensor::<9>::ones([1, 1, 1, 1, 1, 1, 1, 2, 3], &device));
        buffer.add(id, Tensor::<9>::ones([1, 1, 1, 1, 1, 1, 1, 2, 3], &device));
        assert_eq!(buffer.flat(&[id])[0].dims(), [6]);
        assert_eq!(values(buffer.get::<9>(id).unwrap()), vec![2.0; 6]);
    }
}
