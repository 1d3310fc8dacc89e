//! A pipelined rank's Learner model against burn-train's rule that a record cannot change a model's shapes.
//!
//! After the first optimizer step a stage drops to empty placeholders what is outside the blocks and only another
//! stage trains (the head on the first stage, the embeddings on the last). burn-train's Learner cannot take a
//! model of other shapes (`Learner::load_model` refuses the record), so the Learner keeps its copy of those
//! parameters, never used or trained again ([`keep_shapes`]); the trained model the run returns has the
//! placeholders the strategy made ([`with_placeholders`]).

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

/// `placed` (the model the strategy placed after a step) where each parameter it made a placeholder of takes
/// `current`'s value instead, so that its record loads into the Learner; returns it with those parameters' ids.
pub(crate) fn keep_shapes<M: Module>(placed: M, current: &M) -> (M, HashSet<ParamId>) {
    struct Whole(HashMap<ParamId, (Tensor<1>, bool)>);
    impl ModuleVisitor for Whole {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let n = value.shape().num_elements();
            if n > 0 {
                let trains = value.is_require_grad();
                // Burn's `detach` keeps a leaf's gradient requirement: dropped, so that the flat view is a leaf.
                let flat = value.detach().set_require_grad(false).reshape([n]);
                self.0.insert(param.id, (flat, trains));
            }
        }
    }
    struct Restore {
        whole: HashMap<ParamId, (Tensor<1>, bool)>,
        kept: HashSet<ParamId>,
    }
    impl ModuleMapper for Restore {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let empty = param.val().shape().num_elements() == 0;
            let Some((value, trains)) = empty.then(|| self.whole.remove(&param.id)).flatten()
            else {
                return param;
            };
            self.kept.insert(param.id);
            param.map(|placeholder| {
                let mut dims = placeholder.dims();
                let n = value.dims()[0];
                // Only the first dimension of a placeholder is emptied (see `Staged::after_step`).
                dims[0] = n / dims[1..].iter().product::<usize>().max(1);
                let value = value.reshape(dims);
                if trains { value.require_grad() } else { value }
            })
        }
    }
    let mut whole = Whole(HashMap::new());
    current.visit(&mut whole);
    let mut restore = Restore {
        whole: whole.0,
        kept: HashSet::new(),
    };
    let placed = placed.map(&mut restore);
    (placed, restore.kept)
}

/// `model` with the parameters `ids` as empty placeholders (their first dimension 0, no gradient).
pub(crate) fn with_placeholders<M: Module>(model: M, ids: &HashSet<ParamId>) -> M {
    struct Empty<'a>(&'a HashSet<ParamId>);
    impl ModuleMapper for Empty<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !self.0.contains(&param.id) {
                return param;
            }
            param.map(|value| {
                let mut dims = value.dims();
                if let Some(first) = dims.first_mut() {
                    *first = 0;
                }
                let (device, dtype) = (value.device(), value.dtype());
                drop(value);
                Tensor::<D>::zeros(dims, (&device, dtype))
            })
        }
    }
    if ids.is_empty() {
        return model;
    }
    model.map(&mut Empty(ids))
}

/// Whether `model` holds a placeholder (a parameter of no elements): a pipeline's stage prepared by
/// `prepare_blocks` holds one for each parameter of the other stages' blocks.
pub(crate) fn has_placeholder<M: Module>(model: &M) -> bool {
    struct Find(bool);
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= param.val().shape().num_elements() == 0;
        }
    }
    let mut find = Find(false);
    model.visit(&mut find);
    find.0
}
