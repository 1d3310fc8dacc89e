//! The parameter table: a model's float parameters as a strategy's lifecycle hooks see them, whatever the
//! model's type.
//!
//! The pipeline reads a [`ParamTable`] from the model ([`ParamTable::of`]), a hook of the
//! [`Strategy`](super::Strategy) replaces some of its values (gathers them from other ranks, or drops them to
//! placeholders), and the pipeline writes the replacements back ([`ParamTable::apply`]). A strategy never sees
//! the module's type, so the pipeline never asks which strategy it has.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// One float parameter of a model.
pub(crate) struct ParamEntry {
    /// The parameter's id.
    pub id: ParamId,
    /// Its shape in the model now (a `FULL_SHARD` placeholder's first dimension is 0).
    pub dims: Vec<usize>,
    /// The device it lives on.
    pub device: Device,
    /// Its element type.
    pub dtype: DType,
    /// Whether it trains (tracks a gradient).
    pub trainable: bool,
    /// Its value, flat: a handle on the model's tensor (no copy), read only when a hook asks.
    value: Box<dyn Fn() -> Tensor<1>>,
}

impl ParamEntry {
    /// The number of elements it holds now.
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Its value, flat (a handle on the model's tensor).
    pub fn value(&self) -> Tensor<1> {
        (self.value)()
    }

    /// Whether it is a placeholder: a parameter held by another rank, with no elements here.
    pub fn is_placeholder(&self) -> bool {
        self.dims.first().is_some_and(|d| *d == 0)
    }
}

/// A new value for one parameter, written back by [`ParamTable::apply`].
struct Replacement {
    /// The new value, flat.
    value: Tensor<1>,
    dims: Vec<usize>,
    /// Whether the new value tracks a gradient (on an autodiff device): a gathered parameter does, a placeholder
    /// does not.
    trains: bool,
}

/// The float parameters of a model, in visiting order (the same on every rank for the same model), and the new
/// values a strategy's hook gave some of them.
pub(crate) struct ParamTable {
    entries: Vec<ParamEntry>,
    index: HashMap<ParamId, usize>,
    replaced: HashMap<ParamId, Replacement>,
}

impl ParamTable {
    /// The float parameters of `module`. A parameter still lazy is drawn when a hook reads its value (a prepared
    /// model's parameters are all drawn).
    pub fn of<M: Module>(module: &M) -> Self {
        let mut entries = Vec::new();
        crate::named_params::floats(module, |param| {
            let (device, dtype) = param.placement();
            entries.push(ParamEntry {
                id: param.id(),
                dims: param.dims(),
                device,
                dtype,
                trainable: param.require_grad(),
                value: param.value_handle(),
            });
        });
        let index = entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
        Self {
            entries,
            index,
            replaced: HashMap::new(),
        }
    }

    /// Every parameter, in visiting order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// The parameter `id`, when the model has it.
    pub fn get(&self, id: ParamId) -> Option<&ParamEntry> {
        self.index.get(&id).map(|&i| &self.entries[i])
    }

    /// `(id, number of elements)` of every trainable parameter, in visiting order.
    pub fn trainable(&self) -> Vec<(ParamId, usize)> {
        self.entries
            .iter()
            .filter(|e| e.trainable)
            .map(|e| (e.id, e.num_elements()))
            .collect()
    }

    /// Gives parameter `id` the value `flat` in the shape `dims`; a value that `trains` tracks a gradient on an
    /// autodiff device.
    pub fn replace(&mut self, id: ParamId, flat: Tensor<1>, dims: Vec<usize>, trains: bool) {
        let replacement = Replacement {
            value: flat,
            dims,
            trains,
        };
        self.replaced.insert(id, replacement);
    }

    /// `module` with the replaced parameters' new values, keeping ids and gradient settings. The table's own
    /// handles on the values are dropped first, so that a replaced value's memory is freed as it is written.
    ///
    /// # Errors
    /// A replacement whose shape has another number of dimensions than its parameter.
    pub fn apply<M: Module>(self, module: M) -> Result<M> {
        struct Write {
            replaced: HashMap<ParamId, Replacement>,
            error: Option<Error>,
        }
        impl ModuleMapper for Write {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(new) = self.replaced.remove(&param.id) else {
                    return param;
                };
                let Ok(dims) = <[usize; D]>::try_from(new.dims.as_slice()) else {
                    self.error.get_or_insert_with(|| {
                        Error::InvalidArgument(format!(
                            "parameter {}: a strategy gave it the shape {:?}, of another rank than {D}",
                            param.id, new.dims
                        ))
                    });
                    return param;
                };
                if self.error.is_some() {
                    return param;
                }
                param.map(|old| {
                    drop(old);
                    let value = new.value.reshape(dims);
                    if new.trains && value.device().is_autodiff() {
                        // A new leaf, whatever graph the value came from.
                        let value = if value.is_tracked() {
                            value.detach()
                        } else {
                            value
                        };
                        value.require_grad()
                    } else {
                        value
                    }
                })
            }
        }
        let Self {
            entries, replaced, ..
        } = self;
        // The entries hold handles on the model's values: gone before the values are replaced.
        drop(entries);
        if replaced.is_empty() {
            return Ok(module);
        }
        let mut write = Write {
            replaced,
            error: None,
        };
        let module = module.map(&mut write);
        match write.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    fn net() -> Net {
        let device = crate::backend::default_device().unwrap().autodiff();
        Net {
            a: LinearConfig::new(3, 2).init(&device),
            b: LinearConfig::new(2, 1).with_bias(false).init(&device),
        }
    }

    fn values(tensor: Tensor<1>) -> Vec<f32> {
        tensor.into_data().try_into_vec::<f32>().unwrap()
    }

    #[test]
    fn a_table_lists_the_parameters_and_writes_back_only_the_replaced_ones() {
        let net = net();
        let mut table = ParamTable::of(&net);
        let ids: Vec<ParamId> = table.entries().iter().map(|e| e.id).collect();
        assert_eq!(
            ids,
            vec![
                net.a.weight.id,
                net.a.bias.as_ref().unwrap().id,
                net.b.weight.id
            ]
        );
        assert_eq!(
            table.trainable(),
            vec![(ids[0], 6), (ids[1], 2), (ids[2], 2)]
        );
        let a_weight = values(net.a.weight.val().reshape([6]));
        assert_eq!(values(table.get(ids[0]).unwrap().value()), a_weight);

        let device = table.get(ids[2]).unwrap().device.clone();
        let new = Tensor::<1>::from_floats([5.0, 7.0], &device);
        table.replace(ids[2], new, vec![2, 1], true);
        let empty = Tensor::<1>::zeros([0], &device);
        table.replace(ids[1], empty, vec![0], false);
        let out = table.apply(net).unwrap();

        assert_eq!(values(out.a.weight.val().reshape([6])), a_weight);
        assert_eq!(out.b.weight.val().dims(), [2, 1]);
        assert_eq!(values(out.b.weight.val().reshape([2])), vec![5.0, 7.0]);
        assert!(out.b.weight.val().is_require_grad());
        // The placeholder keeps its id and holds nothing.
        let bias = out.a.bias.as_ref().unwrap();
        assert_eq!(bias.id, ids[1]);
        assert_eq!(bias.val().dims(), [0]);
        let again = ParamTable::of(&out);
        assert!(again.get(ids[1]).unwrap().is_placeholder());
    }

    #[test]
    fn a_replacement_of_another_rank_is_an_error_naming_the_parameter() {
        let net = net();
        let id = net.b.weight.id;
        let mut table = ParamTable::of(&net);
        let device = table.get(id).unwrap().device.clone();
        table.replace(id, Tensor::<1>::zeros([2], &device), vec![2], true);
        let err = table.apply(net).unwrap_err().to_string();
        assert!(
            err.contains(&id.to_string()) && err.contains("[2]"),
            "{err}"
        );
    }
}
