//! Global gradient clipping, as `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` do it.
//!
//! Burn's own `GradientClipping::Norm` clips each tensor by its own norm; users coming from PyTorch expect one
//! norm over all parameters together, which is what these functions compute.

use burn::module::ParamId;
use burn::tensor::{FloatDType, Tensor};

use super::GradientBuffer;
use crate::error::{Error, Result};
use burn_accelerate_comm::ReduceOp;

/// Which norm [`Accelerator::clip_grad_norm_with`](crate::Accelerator::clip_grad_norm_with) measures.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum NormType {
    /// The Euclidean norm (torch's default, `norm_type=2`).
    #[default]
    L2,
    /// The largest absolute value (`norm_type=inf`).
    Inf,
    /// The p-norm for a finite `p > 0`.
    P(f64),
}

impl NormType {
    fn validate(self) -> Result<Self> {
        match self {
            NormType::P(p) if !(p.is_finite() && p > 0.0) => Err(Error::InvalidArgument(format!(
                "clip_grad_norm: norm type p={p} is not a finite number above 0; use NormType::Inf for the max norm"
            ))),
            NormType::P(2.0) => Ok(NormType::L2),
            other => Ok(other),
        }
    }
}

/// The total norm of a model's gradients from the norm of each gradient this rank holds (`norms`, one element
/// each: a sum of `|g|^p`, or a maximum for [`NormType::Inf`]): the strategy's action, which knows whether the
/// other ranks hold other gradients ([`combined_norm`]) or the same ones ([`local_norm`]).
pub(crate) type TotalNorm<'a> = dyn Fn(Vec<Tensor<1>>, NormType) -> Result<f64> + 'a;

/// The total norm when this rank holds every gradient: computed on the device, one read-back.
///
/// # Errors
/// `norms` is empty (no `backward` before the clip); the device failed.
pub(crate) fn local_norm(norms: Vec<Tensor<1>>, norm_type: NormType) -> Result<f64> {
    let Some(device) = norms.first().map(|n| n.device()) else {
        return Err(Error::NoGradients {
            operation: "clip_grad_norm",
        });
    };
    let stacked = Tensor::cat(norms, 0);
    read_norm(
        match norm_type {
            NormType::L2 => stacked.sum().sqrt(),
            NormType::Inf => stacked.max(),
            NormType::P(p) => stacked.sum().powf_scalar(1.0 / p),
        },
        &device,
    )
}

/// The total norm when each rank holds only its own gradients (possibly none): this rank's part, combined with
/// the other ranks' by `combine` (a sum of powers with `Sum`, a maximum with `Max`).
///
/// # Errors
/// The device failed; `combine` failed (a collective).
pub(crate) fn combined_norm(
    norms: Vec<Tensor<1>>,
    norm_type: NormType,
    combine: impl Fn(f64, ReduceOp) -> Result<f64>,
) -> Result<f64> {
    let partial = match norms.first().map(|n| n.device()) {
        None => 0.0,
        Some(device) => {
            let stacked = Tensor::cat(norms, 0);
            read_norm(
                match norm_type {
                    NormType::Inf => stacked.max(),
                    _ => stacked.sum(),
                },
                &device,
            )?
        }
    };
    Ok(match norm_type {
        NormType::L2 => combine(partial, ReduceOp::Sum)?.sqrt(),
        NormType::Inf => combine(partial, ReduceOp::Max)?,
        NormType::P(p) => combine(partial, ReduceOp::Sum)?.powf(1.0 / p),
    })
}

fn read_norm(t: Tensor<1>, device: &burn::tensor::Device) -> Result<f64> {
    t.try_into_scalar::<f32>()
        .map(f64::from)
        .map_err(|e| Error::Execution {
            operation: "clip_grad_norm",
            device: format!("{device:?}"),
            reason: e.to_string(),
        })
}

/// Clips the gradients of `ids` in `buffer` so that their combined norm is at most `max_norm`, and returns the
/// combined norm measured before clipping; `total` combines the norms of the gradients this rank holds (see
/// [`TotalNorm`]).
///
/// Follows torch: `coef = max_norm / (total + 1e-6)`; when `coef < 1` every gradient is multiplied by it. A
/// non-finite total (an overflow) is returned as is and, like torch, scales the gradients by `coef` (zero for
/// an infinite norm, NaN for a NaN one), so check the returned value when that matters.
pub(crate) fn clip_grad_norm(
    buffer: &mut GradientBuffer,
    ids: &[ParamId],
    max_norm: f64,
    norm_type: NormType,
    total: &TotalNorm<'_>,
) -> Result<f64> {
    clip_grad_norm_counting(buffer, (ids, ids), max_norm, norm_type, total)
}

/// [`clip_grad_norm`] of the gradients of `ids` whose norm counts only those of `counted` (a subset of `ids`): a
/// gradient two ranks hold the same copy of (a pipeline's tied embedding and head) counts on one of them, and is
/// clipped on both.
pub(crate) fn clip_grad_norm_counting(
    buffer: &mut GradientBuffer,
    (ids, counted): (&[ParamId], &[ParamId]),
    max_norm: f64,
    norm_type: NormType,
    total: &TotalNorm<'_>,
) -> Result<f64> {
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "clip_grad_norm: max_norm={max_norm} must be a finite number >= 0"
        )));
    }
    let norm_type = norm_type.validate()?;
    let norms: Vec<Tensor<1>> = buffer
        .flat(counted)
        .into_iter()
        .map(|g| {
            let g = g.cast(FloatDType::F32);
            match norm_type {
                NormType::L2 => g.square().sum(),
                NormType::Inf => g.abs().max(),
                NormType::P(p) => g.abs().powf_scalar(p).sum(),
            }
        })
        .collect();
    let total = total(norms, norm_type)?;
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 || coef.is_nan() {
        let coef = coef as f32;
        buffer.map_flat(ids, |g| g.mul_scalar(coef));
    }
    Ok(total)
}

/// Whether any gradient of `ids` holds an inf or a NaN (one read-back for all of them).
pub(crate) fn has_non_finite(buffer: &mut GradientBuffer, ids: &[ParamId]) -> Result<bool> {
    let grads = buffer.flat(ids);
    let Some(first) = grads.first() else {
        return Ok(false);
    };
    let device = first.device();
    let flags: Vec<Tensor<1, burn::tensor::Bool>> = grads
        .into_iter()
        .flat_map(|g| [g.clone().is_nan().any(), g.is_inf().any()])
        .collect();
    Tensor::cat(flags, 0)
        .any()
        .try_into_scalar::<bool>()
        .map_err(|e| Error::Execution {
            operation: "overflow check",
            device: format!("{device:?}"),
            reason: e.to_string(),
        })
}

/// Reads one flag computed from `loss` and every gradient of `ids`, which makes the device finish them all and
/// report a failure (an out-of-memory one, typically) as an error instead of at the optimizer step.
pub(crate) fn check_executed<const D: usize>(
    buffer: &mut GradientBuffer,
    ids: &[ParamId],
    loss: Tensor<D>,
) -> Result<()> {
    let device = loss.device();
    let mut flags: Vec<Tensor<1, burn::tensor::Bool>> = vec![loss.is_nan().any()];
    flags.extend(buffer.flat(ids).into_iter().map(|g| g.is_nan().any()));
    Tensor::cat(flags, 0)
        .any()
        .try_into_scalar::<bool>()
        .map(|_| ())
        .map_err(|e| Error::Execution {
            operation: "check_step",
            device: format!("{device:?}"),
            reason: e.to_string(),
        })
}

/// Clamps every gradient of `ids` in `buffer` into `[-clip_value, clip_value]`. When `buffer` holds none of them,
/// `none_held` says whether that is an error (no `backward` before the clip) or nothing to clamp (a sharded rank
/// holds only its own gradients, and may hold none).
pub(crate) fn clip_grad_value(
    buffer: &mut GradientBuffer,
    ids: &[ParamId],
    clip_value: f64,
    none_held: impl FnOnce(&'static str) -> Result<()>,
) -> Result<()> {
    if !(clip_value.is_finite() && clip_value >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "clip_grad_value: clip_value={clip_value} must be a finite number >= 0"
        )));
    }
    if buffer.flat(ids).is_empty() {
        return none_held("clip_grad_value");
    }
    let c = clip_value as f32;
    buffer.map_flat(ids, |g| g.clamp(-c, c));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// What a strategy whose ranks hold every gradient answers when none is held.
    fn no_grads(operation: &'static str) -> Result<()> {
        Err(Error::NoGradients { operation })
    }

    fn buffer_with(values: &[&[f32]]) -> (GradientBuffer, Vec<ParamId>) {
        let device = Device::default();
        let mut buffer = GradientBuffer::new();
        let mut ids = Vec::new();
        for v in values {
            let id = ParamId::new();
            buffer.add(
                id,
                Tensor::<1>::from_floats(*v, &device).reshape([v.len(), 1]),
            );
            ids.push(id);
        }
        (buffer, ids)
    }

    fn values(buffer: &mut GradientBuffer, ids: &[ParamId]) -> Vec<Vec<f32>> {
        buffer
            .flat(ids)
            .into_iter()
            .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn global_norm_equals_manual_and_scales_all() {
        let grads: &[&[f32]] = &[&[3.0, 0.0], &[0.0, 4.0, 12.0]];
        let (mut buffer, ids) = buffer_with(grads);
        let manual = grads
            .iter()
            .flat_map(|g| g.iter())
            .map(|x| (x * x) as f64)
            .sum::<f64>()
            .sqrt();
        assert_eq!(manual, 13.0);
        let total = clip_grad_norm(&mut buffer, &ids, 1.3, NormType::L2, &local_norm).unwrap();
        assert!((total - manual).abs() < 1e-5, "{total}");
        let coef = (1.3 / (13.0 + 1e-6)) as f32;
        let after = values(&mut buffer, &ids);
        for (g, a) in grads.iter().zip(&after) {
            for (x, y) in g.iter().zip(a) {
                assert!((x * coef - y).abs() < 1e-6, "{x} * {coef} != {y}");
            }
        }
        let new_norm: f32 = after.iter().flatten().map(|x| x * x).sum::<f32>().sqrt();
        assert!((new_norm - 1.3).abs() < 1e-4, "{new_norm}");
    }

    #[test]
    fn no_scaling_below_max_norm() {
        let grads: &[&[f32]] = &[&[0.3], &[0.4]];
        let (mut buffer, ids) = buffer_with(grads);
        let total = clip_grad_norm(&mut buffer, &ids, 1.0, NormType::L2, &local_norm).unwrap();
        assert!((total - 0.5).abs() < 1e-6);
        assert_eq!(values(&mut buffer, &ids), vec![vec![0.3], vec![0.4]]);
    }

    #[test]
    fn inf_and_p_norms() {
        let grads: &[&[f32]] = &[&[1.0, -5.0], &[2.0]];
        let (mut buffer, ids) = buffer_with(grads);
        let total = clip_grad_norm(&mut buffer, &ids, 100.0, NormType::Inf, &local_norm).unwrap();
        assert_eq!(total, 5.0);
        let total =
            clip_grad_norm(&mut buffer, &ids, 100.0, NormType::P(1.0), &local_norm).unwrap();
        assert!((total - 8.0).abs() < 1e-5);
        assert!(clip_grad_norm(&mut buffer, &ids, 1.0, NormType::P(-1.0), &local_norm).is_err());
        assert!(clip_grad_norm(&mut buffer, &ids, f64::NAN, NormType::L2, &local_norm).is_err());
    }

    #[test]
    fn value_clipping_clamps_each_element() {
        let grads: &[&[f32]] = &[&[0.5, -3.0], &[2.0, 0.1]];
        let (mut buffer, ids) = buffer_with(grads);
        clip_grad_value(&mut buffer, &ids, 1.0, no_grads).unwrap();
        assert_eq!(
            values(&mut buffer, &ids),
            vec![vec![0.5, -1.0], vec![1.0, 0.1]]
        );
        assert!(clip_grad_value(&mut buffer, &ids, -1.0, no_grads).is_err());
        assert!(clip_grad_value(&mut GradientBuffer::new(), &ids, 1.0, no_grads).is_err());
        clip_grad_value(&mut GradientBuffer::new(), &ids, 1.0, |_| Ok(())).unwrap();
    }

    #[test]
    fn empty_buffer_is_an_error() {
        let mut buffer = GradientBuffer::new();
        let err = clip_grad_norm(
            &mut buffer,
            &[ParamId::new()],
            1.0,
            NormType::L2,
            &local_norm,
        )
        .unwrap_err();
        assert!(err.to_string().contains("backward"), "{err}");
    }
}
