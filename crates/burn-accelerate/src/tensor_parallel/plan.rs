//! [`TensorParallelPlan`]: how a model's modules are split over the tensor-parallel ranks, by module path or by
//! module type (torchtitan's `parallelize_module(model, mesh["tp"], plan)`, transformers' `tp_plan`), resolved
//! against the model before its first step.

use std::collections::BTreeMap;
use std::fmt;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

use super::modules::heads_of;
use crate::error::{Error, Result};

/// How a plan splits one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// A [`ParallelLinear`](super::ParallelLinear) by output features (dim 1 of Burn's `[in, out]` weight):
    /// torchtitan's `ColwiseParallel`.
    Columns,
    /// A [`ParallelLinear`](super::ParallelLinear) by input features (dim 0): `RowwiseParallel`.
    Rows,
    /// A [`ParallelEmbedding`](super::ParallelEmbedding) by vocabulary rows.
    Vocabulary,
    /// Whole on every rank.
    Replicated,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Columns => "columns",
            Split::Rows => "rows",
            Split::Vocabulary => "vocabulary",
            Split::Replicated => "replicated",
        })
    }
}

/// A tensor-parallel plan: rules naming module paths (dot-separated as in a checkpoint, `*` for any one segment:
/// `layers.*.mha.query`) and how each is split, over the defaults by module type that
/// [`megatron`](Self::megatron) turns on. Applied by
/// [`Accelerator::prepare_tensor_parallel`](crate::Accelerator::prepare_tensor_parallel); the loop is the same with
/// `tp_size` 1 or more.
///
/// ```
/// use burn_accelerate::tensor_parallel::{Split, TensorParallelPlan};
///
/// // Every ParallelTransformerLayer, ParallelAttention and ParallelFeedForward the Megatron way, every
/// // ParallelEmbedding by vocabulary, and the head kept whole.
/// let plan = TensorParallelPlan::megatron().split("head", Split::Replicated);
/// assert_eq!(plan.rules().len(), 1);
/// ```
#[derive(Debug, Clone, Default)]
pub struct TensorParallelPlan {
    rules: Vec<(String, Split)>,
    by_type: bool,
}

/// One float parameter of a model as a plan sees it.
#[derive(Debug, Clone)]
struct Seen {
    /// The path of the module it belongs to (`layers.0.mha.query`).
    module: String,
    /// That module's type (`ParallelLinear`).
    kind: String,
    /// The field of the module's parent that holds it (`query`), and the parent's type (`ParallelAttention`).
    parent: Option<(String, String)>,
    /// The parameter's own field (`weight`, `bias`).
    field: String,
    dims: Vec<usize>,
    id: burn::module::ParamId,
}

/// What a plan resolved for one model: for each float parameter in visiting order, the dimension it is split
/// along (`None`: whole on every rank).
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub dims: Vec<Option<usize>>,
    /// `(split, whole)` element counts, for the start-up line.
    pub elements: (usize, usize),
}

impl TensorParallelPlan {
    /// A plan without rules: every module whole (add rules with [`split`](Self::split)).
    pub fn new() -> Self {
        Self::default()
    }

    /// The Megatron plan by module type: in every [`ParallelAttention`](super::ParallelAttention) the query, key
    /// and value projections by columns (each rank its heads) and the output projection by rows; in every
    /// [`ParallelFeedForward`](super::ParallelFeedForward) `linear_inner` by columns and `linear_outer` by rows
    /// (so every [`ParallelTransformerLayer`](super::ParallelTransformerLayer)); every
    /// [`ParallelEmbedding`](super::ParallelEmbedding) by vocabulary. Rules added after override it.
    pub fn megatron() -> Self {
        Self {
            rules: Vec::new(),
            by_type: true,
        }
    }

    /// Splits the modules `pattern` names as `how` (a later rule wins over an earlier one for the same module).
    pub fn split(mut self, pattern: impl Into<String>, how: Split) -> Self {
        self.rules.push((pattern.into(), how));
        self
    }

    /// The rules by path, in order.
    pub fn rules(&self) -> &[(String, Split)] {
        &self.rules
    }

    /// What the plan makes of `model` over `tp` ranks.
    ///
    /// # Errors
    /// A rule that names no module; a rule on a module the plan cannot split (Burn's own `Linear` or `Embedding`,
    /// a container); a split that `tp` does not divide (features, vocabulary rows, attention heads); an attention
    /// or feed-forward network split on one side only. Each names the module, its sizes and the fix.
    pub(crate) fn resolve<M: Module>(&self, model: &M, tp: usize) -> Result<Resolved> {
        let (seen, modules) = walk(model);
        for (pattern, how) in &self.rules {
            let hits: Vec<(&String, &String)> = modules
                .iter()
                .filter(|(path, _)| matches(pattern, path))
                .collect();
            if hits.is_empty() {
                let some: Vec<&str> = modules
                    .keys()
                    .filter(|p| !p.is_empty())
                    .take(12)
                    .map(String::as_str)
                    .collect();
                return Err(Error::InvalidArgument(format!(
                    "tensor-parallel plan: the rule `{pattern}` ({how}) names no module of the model; its modules \
                     include {}; write the path as a checkpoint names it, `*` for one segment",
                    some.join(", ")
                )));
            }
            for (path, kind) in hits {
                let fits = match how {
                    Split::Replicated => true,
                    Split::Columns | Split::Rows => kind == "ParallelLinear",
                    Split::Vocabulary => kind == "ParallelEmbedding",
                };
                if !fits {
                    let instead = match (kind.as_str(), how) {
                        ("Linear", Split::Columns | Split::Rows) => {
                            "use burn_accelerate::tensor_parallel::ParallelLinear there (`ParallelLinear::from(linear)`, \
                             the same record): Burn's Linear has no place for the all-reduce a split needs"
                                .to_string()
                        }
                        ("Embedding", Split::Vocabulary) => {
                            "use burn_accelerate::tensor_parallel::ParallelEmbedding there (`ParallelEmbedding::from(embedding)`, \
                             the same record)"
                                .to_string()
                        }
                        _ => format!(
                            "{how} splits a {} only; name the layers inside it (`{path}.<field>`), or use \
                             TensorParallelPlan::megatron() for the crate's transformer modules",
                            if *how == Split::Vocabulary { "ParallelEmbedding" } else { "ParallelLinear" }
                        ),
                    };
                    return Err(Error::InvalidArgument(format!(
                        "tensor-parallel plan: `{path}` is a {kind}, which the rule `{pattern}` cannot split by \
                         {how}: {instead}"
                    )));
                }
            }
        }
        let split_of = |s: &Seen| -> Split {
            let mut how = if !self.by_type {
                Split::Replicated
            } else {
                match (s.kind.as_str(), s.parent.as_ref()) {
                    ("ParallelEmbedding", _) => Split::Vocabulary,
                    ("ParallelLinear", Some((field, parent))) => {
                        match (parent.as_str(), field.as_str()) {
                            ("ParallelAttention", "query" | "key" | "value") => Split::Columns,
                            ("ParallelAttention", "output") => Split::Rows,
                            ("ParallelFeedForward", "linear_inner") => Split::Columns,
                            ("ParallelFeedForward", "linear_outer") => Split::Rows,
                            _ => Split::Replicated,
                        }
                    }
                    _ => Split::Replicated,
                }
            };
            for (pattern, rule) in &self.rules {
                if matches(pattern, &s.module) {
                    how = *rule;
                }
            }
            how
        };
        let mut dims = Vec::with_capacity(seen.len());
        let mut by_module: BTreeMap<String, Split> = BTreeMap::new();
        let mut elements = (0, 0);
        for s in &seen {
            let how = split_of(s);
            by_module.insert(s.module.clone(), how);
            let n: usize = s.dims.iter().product();
            elements.1 += n;
            let dim = match (how, s.field.as_str()) {
                (Split::Columns, "weight") => Some(1),
                (Split::Columns, "bias") => Some(0),
                (Split::Rows, "weight") | (Split::Vocabulary, "weight") => Some(0),
                _ => None,
            };
            if let Some(d) = dim {
                let size = s.dims[d];
                if tp > 1 && !size.is_multiple_of(tp) {
                    let what = match how {
                        Split::Columns => "output features",
                        Split::Rows => "input features",
                        _ => "vocabulary rows",
                    };
                    return Err(Error::InvalidArgument(format!(
                        "tensor-parallel plan: `{}.{}` {:?} is split by {how} over tp_size {tp}, which does not \
                         divide its {size} {what}: set tp_size to a divisor of {size}, or keep `{}` whole \
                         (Split::Replicated)",
                        s.module, s.field, s.dims, s.module
                    )));
                }
                elements.0 += n;
                if how == Split::Columns
                    && s.field == "weight"
                    && let Some(heads) = heads_of(s.id)
                    && tp > 1
                    && !heads.is_multiple_of(tp)
                {
                    let attention = s.module.rsplit_once('.').map_or("", |(a, _)| a);
                    return Err(Error::InvalidArgument(format!(
                        "tensor-parallel plan: the attention `{attention}` has {heads} heads, which tp_size {tp} \
                         does not divide (each rank computes whole heads): set tp_size to a divisor of {heads}, \
                         or keep `{attention}` whole (Split::Replicated on its query, key, value and output)"
                    )));
                }
            }
            dims.push(dim);
        }
        check_pairs(&seen, &by_module)?;
        Ok(Resolved { dims, elements })
    }
}

/// An attention split on some projections only, or a feed-forward network on one side only, cannot run.
fn check_pairs(seen: &[Seen], by_module: &BTreeMap<String, Split>) -> Result<()> {
    let mut parents: BTreeMap<String, &str> = BTreeMap::new();
    for s in seen {
        if let Some((field, parent)) = &s.parent
            && s.kind == "ParallelLinear"
        {
            let path = s
                .module
                .strip_suffix(&format!(".{field}"))
                .unwrap_or("")
                .to_string();
            parents.insert(path, parent.as_str());
        }
    }
    for (path, kind) in parents {
        let of = |field: &str| {
            by_module
                .get(&join(&path, field))
                .copied()
                .unwrap_or(Split::Replicated)
        };
        let (columns, rows): (Vec<&str>, Vec<&str>) = match kind {
            "ParallelAttention" => (vec!["query", "key", "value"], vec!["output"]),
            "ParallelFeedForward" => (vec!["linear_inner"], vec!["linear_outer"]),
            _ => continue,
        };
        let all_whole = columns
            .iter()
            .chain(&rows)
            .all(|f| of(f) == Split::Replicated);
        let megatron = columns.iter().all(|f| of(f) == Split::Columns)
            && rows.iter().all(|f| of(f) == Split::Rows);
        if !all_whole && !megatron {
            return Err(Error::InvalidArgument(format!(
                "tensor-parallel plan: the {kind} `{path}` is split on some of its layers only ({}): split {} by \
                 columns and {} by rows, or keep all of them whole",
                columns
                    .iter()
                    .chain(&rows)
                    .map(|f| format!("{f}: {}", of(f)))
                    .collect::<Vec<_>>()
                    .join(", "),
                columns.join(", "),
                rows.join(", ")
            )));
        }
    }
    Ok(())
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Whether `pattern` (`*` for any one segment) names `path`.
fn matches(pattern: &str, path: &str) -> bool {
    let (p, q): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), path.split('.').collect());
    p.len() == q.len() && p.iter().zip(&q).all(|(a, b)| *a == "*" || a == b)
}

/// Every float parameter of `model` with its module's path and type, and every module's path and type.
fn walk<M: Module>(model: &M) -> (Vec<Seen>, BTreeMap<String, String>) {
    struct Walk {
        stack: Vec<(String, String)>,
        seen: Vec<Seen>,
        modules: BTreeMap<String, String>,
    }
    fn kind(container: &str) -> String {
        container
            .rsplit(':')
            .next()
            .unwrap_or(container)
            .to_string()
    }
    impl ModuleVisitor for Walk {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack
                .push((name.to_string(), container_type.to_string()));
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let n = self.stack.len();
            if n == 0 {
                return;
            }
            let names: Vec<&str> = self.stack.iter().map(|(n, _)| n.as_str()).collect();
            for i in 0..n {
                self.modules
                    .entry(names[..i].join("."))
                    .or_insert_with(|| kind(&self.stack[i].1));
            }
            let parent = (n >= 2).then(|| (names[n - 2].to_string(), kind(&self.stack[n - 2].1)));
            self.seen.push(Seen {
                module: names[..n - 1].join("."),
                kind: kind(&self.stack[n - 1].1),
                parent,
                field: names[n - 1].to_string(),
                dims: param.lazy_shape().to_vec(),
                id: param.id,
            });
        }
    }
    let mut walk = Walk {
        stack: Vec::new(),
        seen: Vec::new(),
        modules: BTreeMap::new(),
    };
    model.visit(&mut walk);
    (walk.seen, walk.modules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_names_whole_segments() {
        assert!(matches("layers.*.mha.query", "layers.3.mha.query"));
        assert!(!matches("layers.*.mha", "layers.3.mha.query"));
        assert!(!matches("layers.*.mha.query", "layer.3.mha.query"));
        assert!(matches("head", "head"));
    }
}
