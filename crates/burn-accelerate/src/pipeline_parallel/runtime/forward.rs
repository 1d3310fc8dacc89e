//! A forward pass for evaluation through the stages (`Accelerator::forward_batch` under a pipeline).

use super::*;

impl StepPipeline {
    /// A forward pass for evaluation on this rank's stage of `stages` (see `Accelerator::forward_batch`): the
    /// micro-batches forward through the stages, the last stage's outputs then handed to every stage.
    pub(crate) fn forward_staged<M, B, const D: usize>(
        &self,
        stages: &Arc<Stages>,
        model: &M,
        batch: B,
        (before, block, after): (
            impl Fn(&M, &B) -> Tensor<D>,
            impl Fn(&M::Block, Tensor<D>) -> Tensor<D>,
            impl Fn(&M, Tensor<D>, &B) -> Tensor<1>,
        ),
    ) -> Result<Tensor<1>>
    where
        M: Blocks,
        B: Split,
    {
        let whole = unshard(self.strategy.as_ref(), model)?;
        let layout = stages.layout;
        let (s, p) = (layout.stage, layout.stages);
        let (m, parts, unsplit) = micro_batches(batch, stages.micro_batches, "forward_batch");
        let range = stages.blocks_of(model)?[s].clone();
        let mut mail = Mailbox::new(stages, &whole, Instant::now(), "forward_batch")?;
        let device = mail.device.clone();
        let mut outputs = Vec::with_capacity(m);
        // A pass that fails stops this stage computing, not its messages (as in `backward_batch`).
        let mut failure: Option<Failure> = unsplit.map(|e| Failure::Here(Caught::Error(e)));
        // By index: a batch that could not be cut has no parts, and its passes still send what their
        // neighbours wait for.
        #[allow(clippy::needless_range_loop)]
        for i in 0..m {
            let input = match s {
                0 => None,
                _ => match mail.receive_activation::<D>(s - 1, i)? {
                    Some(x) => Some(x),
                    None => {
                        failure.get_or_insert(Failure::Upstream);
                        None
                    }
                },
            };
            let forward = || -> Result<Tensor<D>> {
                let mut y = match &input {
                    Some(x) => x.clone(),
                    None => before(&whole, &parts[i]),
                };
                for b in &whole.blocks()[range.clone()] {
                    y = block(b, y);
                }
                Ok(y)
            };
            let y = match failure {
                Some(_) => None,
                None => match guarded(forward) {
                    Ok(y) => Some(y),
                    Err(e) => {
                        failure = Some(Failure::Here(e));
                        None
                    }
                },
            };
            if layout.is_last_stage() {
                if let Some(y) = y {
                    match guarded(|| Ok(after(&whole, y, &parts[i]).detach().cast(DType::F32))) {
                        Ok(values) => outputs.push(values),
                        Err(e) => failure = Some(Failure::Here(e)),
                    }
                }
            } else {
                let sent = match &y {
                    Some(y) => mail.send_activation(s + 1, y),
                    None => Err(Error::other("no activation")),
                };
                if let Err(e) = sent {
                    if y.is_some() {
                        failure.get_or_insert(Failure::Here(Caught::Error(e)));
                    }
                    mail.send_failed::<D>(s + 1);
                }
                mail.exchange(Vec::new(), i)?;
            }
        }
        verdict(stages, failure, "forward_batch")?;
        // The last stage's values, on every stage: their length, then the values.
        let values = match outputs.is_empty() {
            true => Tensor::<1>::zeros([0], (&device, DType::F32)),
            false => Tensor::cat(outputs, 0),
        };
        let len = stages.comm.all_reduce_value(
            values.dims()[0] as f64,
            ReduceOp::Max,
            "pipeline outputs",
        )? as usize;
        let values = match layout.is_last_stage() {
            true => values,
            false => Tensor::zeros([len], (&device, DType::F32)),
        };
        stages
            .comm
            .broadcast(values, p - 1, "pipeline outputs")?
            .wait()
    }
}
