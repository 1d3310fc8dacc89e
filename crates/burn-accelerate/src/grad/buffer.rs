use std::any::Any;
use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Shape, Tensor};

/// Highest tensor rank kept in its own shape; higher ranks are stored flat from the start.
const MAX_SHAPED_RANK: usize = 8;

/// One parameter's gradient: in its own shape as long as only the optimizer needs it (the common path, no
/// copies), flattened once an operation over all gradients (clipping, reduction) touches it.
enum GradValue {
    /// A `Tensor<D>` with `D = shape.num_dims() <= MAX_SHAPED_RANK`.
    Shaped(Box<dyn Any + Send>),
    Flat(Box<Tensor<1>>),
}

struct StoredGrad {
    shape: Shape,
    value: GradValue,
}

impl StoredGrad {
    fn into_shaped<const D: usize>(self) -> Tensor<D> {
        match self.value {
            GradValue::Shaped(any) => match any.downcast::<Tensor<D>>() {
                Ok(t) => *t,
                Err(any) => to_flat(any, &self.shape).reshape(self.shape),
            },
            GradValue::Flat(t) => (*t).reshape(self.shape),
        }
    }

    fn flat(&mut self) -> &mut Tensor<1> {
        if let GradValue::Shaped(_) = self.value {
            let GradValue::Shaped(any) =
                std::mem::replace(&mut self.value, GradValue::Shaped(Box::new(())))
            else {
                unreachable!("checked above")
            };
            self.value = GradValue::Flat(Box::new(to_flat(any, &self.shape)));
        }
        match &mut self.value {
            GradValue::Flat(t) => t,
            GradValue::Shaped(_) => unreachable!("flattened above"),
        }
    }
}

/// Flattens a type-erased `Tensor<D>` whose rank is `shape.num_dims()`.
fn to_flat(any: Box<dyn Any + Send>, shape: &Shape) -> Tensor<1> {
    let numel = shape.num_elements();
    macro_rules! ranks {
        ($any:ident; $($d:literal),*) => {
            $(
                let $any = match $any.downcast::<Tensor<$d>>() {
                    Ok(t) => return t.reshape([numel]),
                    Err(other) => other,
                };
            )*
        };
    }
    ranks!(any; 1, 2, 3, 4, 5, 6, 7, 8);
    let _ = any;
    unreachable!("gradients of rank > {MAX_SHAPED_RANK} are stored flat")
}

/// The gradients accumulated since the last optimizer step, keyed by parameter id.
#[derive(Default)]
pub struct GradientBuffer {
    grads: HashMap<ParamId, StoredGrad>,
}

impl std::fmt::Debug for GradientBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientBuffer")
            .field("params", &self.grads.len())
            .finish()
    }
}

impl GradientBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of parameters holding a gradient.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// Whether no gradient is stored.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// Drops every stored gradient.
    pub fn clear(&mut self) {
        self.grads.clear();
    }

    /// Moves the gradients of `module`'s trainable parameters out of `grads` and adds them to the buffer.
    pub fn collect<M: Module>(&mut self, module: &M, grads: &mut Gradients) {
        struct Collect<'a> {
            grads: &'a mut Gradients,
            buffer: &'a mut GradientBuffer,
        }
        impl ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if !param.is_require_grad() {
                    return;
                }
                if let Some(grad) = param.val().grad_remove(self.grads) {
                    self.buffer.add(param.id, grad);
                }
            }
        }
        module.visit(&mut Collect {
            grads,
            buffer: self,
        });
    }

    /// Adds `grad` to the gradient stored for `id` (or stores it).
    pub fn add<const D: usize>(&mut self, id: ParamId, grad: Tensor<D>) {
        match self.grads.remove(&id) {
            None => {
                let shape = grad.shape();
                let value = if D <= MAX_SHAPED_RANK {
                    GradValue::Shaped(Box::new(grad))
                } else {
                    GradValue::Flat(Box::new(grad.reshape([shape.num_elements()])))
                };
                self.grads.insert(id, StoredGrad { shape, value });
            }
            Some(mut stored) => {
                stored.value = match stored.value {
                    GradValue::Shaped(any) => match any.downcast::<Tensor<D>>() {
                        Ok(t) => GradValue::Shaped(Box::new(*t + grad)),
                        Err(any) => {
                            let numel = stored.shape.num_elements();
                            GradValue::Flat(Box::new(
                                to_flat(any, &stored.shape) + grad.reshape([numel]),
                            ))
                        }
                    },
                    GradValue::Flat(t) => {
                        let numel = stored.shape.num_elements();
                        GradValue::Flat(Box::new(*t + grad.reshape([numel])))
                    }
                };
                self.grads.insert(id, stored);
            }
        }
    }

    /// The gradient stored for `id`, in its parameter's shape.
    pub fn get<const D: usize>(&self, id: ParamId) -> Option<Tensor<D>> {
        let stored = self.grads.get(&id)?;
        match &stored.value {
            GradValue::Shaped(any) => any.downcast_ref::<Tensor<D>>().cloned(),
            GradValue::Flat(t) => Some((**t).clone().reshape(stored.shape.clone())),
        }
    }

    /// Applies `f` to the flat gradient of every id in `ids` that has one.
    pub(crate) fn map_flat(&mut self, ids: &[ParamId], mut f: impl FnMut(Tensor<1>) -> Tensor<1>) {
        for id in ids {
            if let Some(stored) = self.grads.get_mut(id) {
                let flat = stored.flat();
                *flat = f(flat.clone());
            }
        }
    }

    /// The flat gradients of the ids in `ids` that have one, in the order of `ids`.
    pub(crate) fn flat(&mut self, ids: &[ParamId]) -> Vec<Tensor<1>> {
        ids.iter()
            .filter_map(|id| self.grads.get_mut(id).map(|g| g.flat().clone()))
            .collect()
    }

    /// Stores `flat` as the gradient of `id`, keeping the shape recorded for it; `id` must already have a
    /// gradient or be given by a module whose parameter has `flat.dims()[0]` elements.
    pub(crate) fn set_flat(&mut self, id: ParamId, flat: Tensor<1>) {
        match self.grads.get_mut(&id) {
            Some(stored) => stored.value = GradValue::Flat(Box::new(flat)),
            None => {
                let shape = Shape::from(vec![flat.dims()[0]]);
                self.grads.insert(
                    id,
                    StoredGrad {
                        shape,
                        value: GradValue::Flat(Box::new(flat)),
                    },
                );
            }
        }
    }

    /// Multiplies every stored gradient by `factor`.
    pub(crate) fn scale_all(&mut self, factor: f32) {
        for stored in self.grads.values_mut() {
            let flat = stored.flat();
            *flat = flat.clone().mul_scalar(factor);
        }
    }

    /// Removes the gradients of `module`'s parameters and returns them in Burn's optimizer format.
    pub fn take_for<M: Module>(&mut self, module: &M) -> GradientsParams {
        struct Take<'a> {
            buffer: &'a mut GradientBuffer,
            out: GradientsParams,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(mut stored) = self.buffer.grads.remove(&param.id) {
                    // A gradient first seen through `set_flat` (a parameter unused on this rank) takes the
                    // parameter's shape here.
                    if stored.shape.num_dims() != D {
                        stored.shape = param.shape();
                    }
                    self.out.register::<D>(param.id, stored.into_shaped::<D>());
                }
            }
        }
        let mut take = Take {
            buffer: self,
            out: GradientsParams::new(),
        };
        module.visit(&mut take);
        take.out
    }
}

/// The ids of `module`'s float parameters, in visiting order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
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
