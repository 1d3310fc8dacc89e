//! `gather`: the parameters other ranks own, fetched into a sharded rank's model (large ones broadcast in
//! place from their owner, the others all-gathered in rounds), for `unshard` and `SHARD_GRAD_OP`'s share after
//! the step.

use super::*;

/// The shape a gathered parameter takes: the one remembered for it (a placeholder's is empty), else `old`'s.
fn whole_dims<const D: usize>(remembered: Option<Vec<usize>>, old: &Tensor<D>) -> [usize; D] {
    remembered
        .and_then(|d| d.try_into().ok())
        .unwrap_or_else(|| old.dims())
}

/// A gathered parameter's value, tracked on an autodiff device: every gathered parameter trains (a placeholder
/// tracks no gradient of its own).
fn trainable<const D: usize>(value: Tensor<D>) -> Tensor<D> {
    if value.device().is_autodiff() {
        value.require_grad()
    } else {
        value
    }
}

/// `module` with every trainable parameter owned by another rank replaced by that rank's value (all-gathered
/// in rounds), in its whole shape, keeping ids and gradient settings; the parameters in `kept` are left as
/// they are (placeholders stay placeholders).
pub(super) fn gather<M: Module>(
    sharded: &Sharded,
    mut module: M,
    kept: &HashSet<ParamId>,
) -> Result<M> {
    /// Large parameters, each broadcast from its owner into this rank's own buffer (its stale value's, when it
    /// holds one), in visiting order: no buffer is allocated or copied for a parameter the module alone holds.
    struct Broadcast<'a> {
        group: &'a ProcessGroup,
        large: &'a HashMap<ParamId, (usize, usize)>,
        dims: &'a HashMap<ParamId, Vec<usize>>,
        error: Option<Error>,
    }
    impl ModuleMapper for Broadcast<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&(owner, n)) = self.large.get(&param.id) else {
                return param;
            };
            if self.error.is_some() {
                return param;
            }
            let dims = self.dims.get(&param.id).cloned();
            param.map(|old| {
                let (device, dtype) = (old.device(), old.dtype());
                let dims = whole_dims(dims, &old);
                let host = if old.shape().num_elements() == n {
                    to_host(old.reshape([n]), "parameter broadcast")
                } else {
                    // A placeholder (FULL_SHARD): nothing to reuse.
                    Ok(vec![0.0; n])
                };
                let received = host.and_then(|host| {
                    let comm = Sharded::checked(
                        self.group,
                        "sharded parameter broadcast from its owner",
                        &[n, owner],
                    )?;
                    match comm.broadcast_buffer(ReduceBuffer::F32(host), owner)? {
                        ReduceBuffer::F32(values) => {
                            from_host(values, (&device, dtype), "parameter broadcast")
                        }
                        other => Err(Error::InvalidArgument(format!(
                            "parameter broadcast: the engine returned {} values",
                            other.kind()
                        ))),
                    }
                });
                match received {
                    Ok(flat) => trainable(flat.reshape(dims)),
                    Err(e) => {
                        self.error = Some(e);
                        Tensor::zeros(dims, (&device, dtype))
                    }
                }
            })
        }
    }
    /// This rank's own parameters, flat.
    struct Own<'a> {
        mine: &'a HashMap<ParamId, usize>,
        values: HashMap<ParamId, Tensor<1>>,
    }
    impl ModuleVisitor for Own<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.mine.contains_key(&param.id) {
                let value = param.val();
                let n = value.shape().num_elements();
                self.values.insert(param.id, value.reshape([n]));
            }
        }
    }
    /// Sets the gathered values.
    struct Set<'a> {
        values: HashMap<ParamId, Vec<f32>>,
        dims: &'a HashMap<ParamId, Vec<usize>>,
        error: Option<Error>,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(values) = self.values.remove(&param.id) else {
                return param;
            };
            if self.error.is_some() {
                return param;
            }
            let dims = self.dims.get(&param.id).cloned();
            param.map(|old| {
                let (device, dtype) = (old.device(), old.dtype());
                let dims = whole_dims(dims, &old);
                drop(old);
                match from_host(values, (&device, dtype), "parameter all-gather") {
                    Ok(flat) => trainable(flat.reshape(dims)),
                    Err(e) => {
                        self.error = Some(e);
                        Tensor::zeros(dims, (&device, dtype))
                    }
                }
            })
        }
    }
    let (me, world) = (sharded.shard_rank(), sharded.world());
    sharded.check_world("hybrid sharded parameter gather", world)?;
    if world < 2 {
        return Ok(module);
    }
    let mut params = whole_params(sharded, &module);
    params.retain(|(id, _)| !kept.contains(id));
    let owners = sharded.owners(&params);
    let dims: HashMap<ParamId, Vec<usize>> = {
        let known = sharded.known();
        let mut dims = param_dims(&module);
        for (id, d) in dims.iter_mut() {
            if let Some(k) = known.get(id) {
                *d = k.dims.clone();
            }
        }
        dims
    };
    let large: HashMap<ParamId, (usize, usize)> = sharded
        .large(&params)
        .into_iter()
        .map(|i| (params[i].0, (owners[i], params[i].1)))
        .collect();
    let mut broadcast = Broadcast {
        group: &sharded.group,
        large: &large,
        dims: &dims,
        error: None,
    };
    module = module.map(&mut broadcast);
    if let Some(e) = broadcast.error {
        return Err(e);
    }
    let mine: HashMap<ParamId, usize> = params
        .iter()
        .zip(&owners)
        .filter(|((id, _), o)| **o == me && !large.contains_key(id))
        .map(|((id, n), _)| (*id, *n))
        .collect();
    let mut own = Own {
        mine: &mine,
        values: HashMap::new(),
    };
    module.visit(&mut own);
    for round in sharded.rounds(&params, &owners) {
        let counts: Vec<usize> = round
            .iter()
            .map(|group| group.iter().map(|i| params[*i].1).sum())
            .collect();
        let mut part = Vec::new();
        for &i in &round[me] {
            let flat = own.values.remove(&params[i].0).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "parameter all-gather: this rank's parameter {} is missing from the model",
                    params[i].0
                ))
            })?;
            if part.is_empty() {
                part = to_host(flat, "parameter all-gather")?;
            } else {
                part.extend(to_host(flat, "parameter all-gather")?);
            }
        }
        let comm = Sharded::checked(&sharded.group, "sharded parameter all-gather", &counts)?;
        let all = comm.all_gather_parts(ReduceBuffer::F32(part), &counts)?;
        let ReduceBuffer::F32(all) = all else {
            return Err(Error::InvalidArgument(format!(
                "parameter all-gather: the engine returned {} values",
                all.kind()
            )));
        };
        let mut values = HashMap::new();
        let alone = round.iter().map(Vec::len).sum::<usize>() == 1;
        match round.iter().position(|g| !g.is_empty()) {
            // One parameter: the gathered buffer is its value (nothing to do on its owner).
            Some(q) if alone => {
                if q != me {
                    values.insert(params[round[q][0]].0, all);
                }
            }
            _ => {
                let mut start = 0;
                for (q, group) in round.iter().enumerate() {
                    for &i in group {
                        let (id, n) = params[i];
                        if q != me {
                            values.insert(id, all[start..start + n].to_vec());
                        }
                        start += n;
                    }
                }
            }
        }
        let mut set = Set {
            values,
            dims: &dims,
            error: None,
        };
        module = module.map(&mut set);
        if let Some(e) = set.error {
            return Err(e);
        }
    }
    Ok(module)
}
