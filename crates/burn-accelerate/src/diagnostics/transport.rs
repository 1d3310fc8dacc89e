//! `burn-accelerate test`'s check of the device transport this run would choose: the transport's own checks
//! against an independent reference (`distributed::tensor_comm::on_device`), and, above the facade, the sharded
//! strategies trained on one rank through the device library and every strategy trained on ranks sharing a device
//! over a communicator that refuses host buffers ([`host_free`](super::host_free)).

use std::sync::Arc;

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::AdamConfig;
use burn::tensor::{DType, Device, Tensor};

use super::fixed_linear;
use crate::accelerator::AcceleratorBuilder;
use crate::config::ShardingStrategy;
use crate::distributed::ProcessGroup;
use crate::distributed::strategy::{Sharded, Strategy};
use crate::distributed::tensor_comm::on_device::{
    DtypeCheck, EngineFactory, Exchanges, OnDevice, TransportCheck, TransportChoice,
    TransportFacts, TransportKind, check_collectives, check_transport, choose, compare, facts_for,
    nccl_engines, select_transport, start_device,
};
use crate::error::Result;

/// The check's model: two linear layers with fixed weights.
#[derive(Module, Debug)]
struct CheckNet {
    a: Linear,
    b: Linear,
}

/// Trains [`CheckNet`] for 3 Adam steps on fixed data, on the one rank `builder` makes: its weights after.
fn train_check_net(builder: AcceleratorBuilder) -> Result<Vec<f32>> {
    let weights = builder.launch(1, |acc| {
        let device = acc.device().clone();
        let net = CheckNet {
            a: fixed_linear(12, 10, 0.3, &device),
            b: fixed_linear(10, 3, 1.7, &device),
        };
        let mut net = acc.prepare_model(net)?;
        let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 1e-2);
        for step in 0..3 {
            let values: Vec<f32> = (0..8 * 12)
                .map(|i| ((i * 5 + step * 3) as f32 * 0.21).cos())
                .collect();
            let x = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([8, 12]);
            let whole = acc.unshard(&net)?;
            let loss = whole
                .b
                .forward(whole.a.forward(x).tanh())
                .powi_scalar(2)
                .mean();
            acc.backward(loss, &whole)?;
            net = optimizer.try_step(net)?;
        }
        let whole = acc.unshard(&net)?;
        let mut weights = Vec::new();
        for weight in [whole.a.weight.val(), whole.b.weight.val()] {
            weights.extend(weight.into_data().try_to_vec::<f32>().map_err(|e| {
                crate::error::Error::InvalidArgument(format!("the check's weights: {e:?}"))
            })?);
        }
        Ok(weights)
    })?;
    weights.into_iter().next().ok_or_else(|| {
        crate::error::Error::InvalidArgument("the check's rank returned nothing".into())
    })
}

/// Trains [`CheckNet`] on one rank on `device` under `SHARD_GRAD_OP`, `FULL_SHARD` and `HYBRID_SHARD` (shard
/// groups of one: both sub-groups split from the engine's connection), every exchange through an engine `engines`
/// makes, in small buckets, and alone on the device; `(strategy, check)` of the weights, within 1e-5 of their
/// scale (one rank's collectives are copies: only a transport that garbles or drops values differs).
pub(crate) fn check_training_on_one_rank(
    device: &Device,
    timeout: std::time::Duration,
    engines: EngineFactory,
) -> Result<Vec<(&'static str, DtypeCheck)>> {
    let base = || {
        AcceleratorBuilder::default()
            .device(device.clone().without_autodiff())
            .collective_timeout(timeout)
    };
    let alone: Vec<f64> = train_check_net(base())?
        .into_iter()
        .map(f64::from)
        .collect();
    let bound = 1e-5 * alone.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1.0);
    [
        ("SHARD_GRAD_OP training", ShardingStrategy::ShardGradOp),
        ("FULL_SHARD training", ShardingStrategy::FullShard),
        ("HYBRID_SHARD training", ShardingStrategy::HybridShard),
    ]
    .into_iter()
    .map(|(name, mode)| {
        let engines = engines.clone();
        let builder = base().sharding(mode).strategy(Arc::new(move |group| {
            let comm = OnDevice::checked(engines(group)?, group);
            // 256-byte buckets: several exchanges a step.
            let strategy: Arc<dyn Strategy> = if mode.is_hybrid() {
                Arc::new(Sharded::hybrid(
                    group.clone(),
                    comm,
                    crate::distributed::mesh::hybrid_groups(group, 1)?,
                    mode,
                    256,
                )?)
            } else {
                Arc::new(Sharded::new(group.clone(), comm, mode, 256))
            };
            Ok(strategy)
        }));
        let got = train_check_net(builder)?;
        Ok((name, compare(&got, &alone, bound, DType::F32)))
    })
    .collect()
}

/// The device transport this run would choose, checked against the reference ([`check_transport`]); `None`
/// when the run's gradients go through host memory anyway.
pub(crate) fn check_against_reference(
    group: &Arc<ProcessGroup>,
    preference: crate::config::GradientTransport,
    timeout: std::time::Duration,
) -> Result<Option<TransportCheck>> {
    let (transport, choice) = if group.num_processes() == 1 {
        // One rank needs no transport, but on CUDA a one-rank NCCL communicator still shows NCCL works here.
        let facts = TransportFacts {
            world: 2,
            local_world: 1,
            in_process: false,
            ..facts_for(group, Exchanges::Shards)?
        };
        match choose(preference, &facts) {
            Ok(choice) if choice.kind == TransportKind::Nccl => {
                let transport = start_device(TransportKind::Nccl, group, timeout)?;
                let choice = TransportChoice {
                    reason: "a one-rank NCCL communicator".into(),
                    ..choice
                };
                (transport, choice)
            }
            _ => return Ok(None),
        }
    } else {
        select_transport(group, preference, timeout, Exchanges::Gradients)?
    };
    if !choice.kind.on_device() {
        return Ok(None);
    }
    let dtypes = check_transport(group, transport.as_ref())?;
    // Sharded training's and pipelines' calls on the transport they take: the same one, except where Burn's
    // collective (all-reduce only) serves data parallelism and NCCL the rest.
    let (others, named) = if choice.kind == TransportKind::BurnCollective {
        let (others, other) = select_transport(group, preference, timeout, Exchanges::Shards)?;
        (others, format!("{choice}; other calls: {other}"))
    } else {
        (transport, choice.to_string())
    };
    // On one rank, the sharded strategies trained through fresh one-rank connections of the same library.
    let training = if group.num_processes() == 1 {
        check_training_on_one_rank(group.device(), timeout, nccl_engines(timeout)?)?
    } else {
        Vec::new()
    };
    let collectives = check_collectives(group, others.as_ref())?;
    // Ranks sharing a device: every strategy trained over a communicator that refuses host buffers, once, by
    // the main process (the other ranks go on to their next exchange and wait for it there).
    let trainings = if choice.kind == TransportKind::SharedDevice && group.is_main_process() {
        super::host_free::check_strategies_without_host_buffers(
            group.device(),
            timeout,
            preference,
        )?
    } else {
        Vec::new()
    };
    let control_bytes = trainings.iter().map(|(n, _, c)| (*n, *c)).collect();
    let without_host_buffers = trainings
        .into_iter()
        .map(|(n, check, _)| (n, check))
        .collect();
    Ok(Some(TransportCheck {
        transport: named,
        dtypes,
        collectives,
        training,
        without_host_buffers,
        control_bytes,
        control_budget: super::host_free::CHECK_BUDGET.bytes,
    }))
}
