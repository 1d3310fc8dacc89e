//! A pipelined rank's Learner model against burn-train's rule that a record cannot change a model's shapes.
//!
//! After the first optimizer step a stage drops to empty placeholders what is outside the blocks and only another
//! stage trains (the head on the first stage, the embeddings on the last). burn-train's Learner cannot take a
//! model of other shapes (`Learner::load_model` refuses the record), so under the Learner the stage keeps its copy
//! of those parameters, never used or trained again (`Stages::keeps_rest`); the trained model the run returns has
//! placeholders for them ([`with_placeholders`]), and a stage prepared by `prepare_blocks` is told by its
//! placeholders for the other stages' blocks ([`has_placeholder`]).

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

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
