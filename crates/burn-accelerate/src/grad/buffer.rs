use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Shape, Tensor};

/// One parameter's gradient, flattened.
#[derive(Debug, Clone)]
pub(crate) struct FlatGrad {
    pub shape: Shape,
    pub value: Tensor<1>,
}

/// The gradients accumulated since the last optimizer step, keyed by parameter id, in first-seen order.
#[derive(Debug, Default)]
pub struct GradientBuffer {
    grads: HashMap<ParamId, FlatGrad>,
    order: Vec<ParamId>,
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
        self.order.clear();
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
        let shape = grad.shape();
        let numel = shape.num_elements();
        let flat = grad.reshape([numel]);
        match self.grads.get_mut(&id) {
            Some(existing) => existing.value = existing.value.clone().add(flat),
            None => {
                self.order.push(id);
                self.grads.insert(id, FlatGrad { shape, value: flat });
            }
        }
    }

    /// The gradient stored for `id`, in its parameter's shape.
    pub fn get<const D: usize>(&self, id: ParamId) -> Option<Tensor<D>> {
        self.grads
            .get(&id)
            .map(|g| g.value.clone().reshape(g.shape.clone()))
    }

    /// Applies `f` to the flat gradient of every id in `ids` that has one.
    pub(crate) fn map_flat(&mut self, ids: &[ParamId], mut f: impl FnMut(Tensor<1>) -> Tensor<1>) {
        for id in ids {
            if let Some(grad) = self.grads.get_mut(id) {
                grad.value = f(grad.value.clone());
            }
        }
    }

    /// The flat gradients of the ids in `ids` that have one, in the order of `ids`.
    pub(crate) fn flat(&self, ids: &[ParamId]) -> Vec<Tensor<1>> {
        ids.iter()
            .filter_map(|id| self.grads.get(id).map(|g| g.value.clone()))
            .collect()
    }

    /// Removes the gradients of `module`'s parameters and returns them in Burn's optimizer format.
    pub fn take_for<M: Module>(&mut self, module: &M) -> GradientsParams {
        struct Take<'a> {
            buffer: &'a mut GradientBuffer,
            out: GradientsParams,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(grad) = self.buffer.grads.remove(&param.id) {
                    self.out
                        .register::<D>(param.id, grad.value.reshape(grad.shape));
                }
            }
        }
        let mut take = Take {
            buffer: self,
            out: GradientsParams::new(),
        };
        module.visit(&mut take);
        let out = take.out;
        self.order.retain(|id| self.grads.contains_key(id));
        out
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
