//! One walk over a module's parameters, each with its dotted name (`encoder.layers.0.weight`, as Burn's records
//! and safetensors files name it) and, for a float parameter, a view that does not depend on its rank: id, shape,
//! placement, gradient setting and value, flat. The readers of a module's parameters (their ids, the trainable
//! ones, the first one, a strategy's parameter table, a checkpoint's wanted names, drawing lazy ones) go through
//! it instead of a visitor each; what needs a parameter's typed tensor (a gradient of its rank, a band of a weight
//! file) keeps a visitor of its own.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, DType, Device, Int, Tensor};

/// A float parameter of any rank.
pub(crate) trait FloatParam {
    /// Its id.
    fn id(&self) -> ParamId;

    /// Whether it tracks a gradient.
    fn require_grad(&self) -> bool;

    /// Its shape, without drawing it.
    fn dims(&self) -> Vec<usize>;

    /// How many elements it holds, without drawing it.
    fn num_elements(&self) -> usize;

    /// Its device and element type, without drawing it (a lazy parameter's are the device's float settings).
    fn placement(&self) -> (Device, DType);

    /// A handle on its value, flat, read (and drawn, if lazy) only when called; it holds the parameter, not a
    /// copy of its values.
    fn value_handle(&self) -> Box<dyn Fn() -> Tensor<1>>;

    /// Draws its value now, if it is still lazy.
    fn draw(&self);

    /// Whether its value is drawn (materialised) already, not lazy.
    fn is_drawn(&self) -> bool;
}

impl<const D: usize> FloatParam for Param<Tensor<D>> {
    fn id(&self) -> ParamId {
        self.id
    }

    fn require_grad(&self) -> bool {
        self.is_require_grad()
    }

    fn dims(&self) -> Vec<usize> {
        self.lazy_shape().dims::<D>().to_vec()
    }

    fn num_elements(&self) -> usize {
        self.lazy_shape().num_elements()
    }

    fn placement(&self) -> (Device, DType) {
        if Param::is_initialized(self) {
            let value = self.val();
            (value.device(), value.dtype())
        } else {
            let device = self.lazy_device();
            let dtype = DType::from(device.settings().float_dtype);
            (device, dtype)
        }
    }

    fn value_handle(&self) -> Box<dyn Fn() -> Tensor<1>> {
        let held = self.clone();
        Box::new(move || {
            let value = held.val();
            let n = value.shape().num_elements();
            value.reshape([n])
        })
    }

    fn draw(&self) {
        if !Param::is_initialized(self) {
            let _ = self.base();
        }
    }

    fn is_drawn(&self) -> bool {
        Param::is_initialized(self)
    }
}

/// What kind of parameter the walk met.
pub(crate) enum Kind<'a> {
    /// A float parameter.
    Float(&'a dyn FloatParam),
    /// An integer parameter.
    Int,
    /// A boolean parameter.
    Bool,
}

/// One parameter as the walk meets it.
pub(crate) struct NamedParam<'a> {
    /// The names of the modules that hold it, outermost first, then its own field name.
    pub path: &'a [String],
    /// What it is.
    pub kind: Kind<'a>,
}

impl NamedParam<'_> {
    /// Its dotted name.
    pub fn name(&self) -> String {
        self.path.join(".")
    }
}

/// Calls `f` with every parameter of `module` (float, int and bool), in visiting order.
pub(crate) fn walk<M: Module>(module: &M, f: impl FnMut(&NamedParam<'_>)) {
    visit(module, true, f);
}

/// The walk, naming the parameters when `named` (a walk that needs no names allocates nothing: the step reads
/// a model's ids this way several times).
fn visit<M: Module>(module: &M, named: bool, f: impl FnMut(&NamedParam<'_>)) {
    struct Walk<F> {
        path: Vec<String>,
        named: bool,
        f: F,
    }
    impl<F: FnMut(&NamedParam<'_>)> Walk<F> {
        fn meet(&mut self, kind: Kind<'_>) {
            (self.f)(&NamedParam {
                path: &self.path,
                kind,
            });
        }
    }
    impl<F: FnMut(&NamedParam<'_>)> ModuleVisitor for Walk<F> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            if self.named {
                self.path.push(name.to_string());
            }
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            if self.named {
                self.path.pop();
            }
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.meet(Kind::Float(param));
        }
        fn visit_int<const D: usize>(&mut self, _param: &Param<Tensor<D, Int>>) {
            self.meet(Kind::Int);
        }
        fn visit_bool<const D: usize>(&mut self, _param: &Param<Tensor<D, Bool>>) {
            self.meet(Kind::Bool);
        }
    }
    module.visit(&mut Walk {
        path: Vec::new(),
        named,
        f,
    });
}

/// Calls `f` with every float parameter of `module`, in visiting order (unnamed).
pub(crate) fn floats<M: Module>(module: &M, mut f: impl FnMut(&dyn FloatParam)) {
    visit(module, false, |p| {
        if let Kind::Float(param) = p.kind {
            f(param);
        }
    });
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    #[derive(Module, Debug)]
    struct Net {
        layers: Vec<Linear>,
        head: Linear,
    }

    #[test]
    fn every_parameter_is_met_once_in_order_with_its_record_name() {
        let device = Device::default();
        let net = Net {
            layers: vec![
                LinearConfig::new(2, 3).init(&device),
                LinearConfig::new(3, 3).init(&device),
            ],
            head: LinearConfig::new(3, 1).with_bias(false).init(&device),
        };
        let mut met = Vec::new();
        walk(&net, |p| {
            if let Kind::Float(param) = p.kind {
                met.push((p.name(), param.dims(), param.require_grad()));
            }
        });
        let names: Vec<&str> = met.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.0.bias",
                "layers.1.weight",
                "layers.1.bias",
                "head.weight"
            ]
        );
        assert_eq!(met[0].1, vec![2, 3]);
        assert_eq!(met[4].1, vec![3, 1]);
        let mut ids = Vec::new();
        floats(&net, |p| ids.push(p.id()));
        assert_eq!(ids[0], net.layers[0].weight.id);
        assert_eq!(ids.len(), 5);
        // A handle reads the value flat, without copying it into the walk.
        let mut first = None;
        floats(&net, |p| {
            first.get_or_insert_with(|| p.value_handle());
        });
        assert_eq!(first.unwrap()().dims(), [6]);
    }
}
