//! A pipeline stage's messages to its neighbours: activations forward with a header (shape and element type),
//! their gradients back; a send waits to go out with the next receive when that comes from the same neighbour.

use std::time::Instant;

use burn::tensor::{DType, Device, Tensor};

use crate::distributed::tensor_comm::Incoming;
use crate::error::{Error, Result};
use crate::pipeline_parallel::Stages;
use crate::pipeline_parallel::{SpanKind, TraceSpan};

/// The element types an activation can cross stages in, as a header's last value.
const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// A header's last value when the sending stage has no activation to send (a pass failed).
const FAILED: f32 = -1.0;

/// One rank's messages to its neighbouring stages, sent with its next receive.
pub(super) struct Mailbox<'a> {
    pub stages: &'a Stages,
    pub pending: Vec<(usize, Tensor<1>)>,
    pub device: Device,
    pub started: Instant,
    pub spans: Vec<TraceSpan>,
}

impl<'a> Mailbox<'a> {
    /// The mailbox of a stage of `stages` whose model (this stage's part gathered, `whole`) lives where its first
    /// parameter does; its spans are timed from `started`.
    ///
    /// # Errors
    /// The model holds no parameter (`operation` names the call).
    pub fn new<M: burn::module::Module>(
        stages: &'a Stages,
        whole: &M,
        started: Instant,
        operation: &str,
    ) -> Result<Self> {
        let device = whole.devices().into_iter().next().ok_or_else(|| {
            Error::InvalidArgument(format!("{operation}: the model holds no parameter"))
        })?;
        Ok(Self {
            stages,
            pending: Vec::new(),
            device,
            started,
            spans: Vec::new(),
        })
    }

    /// Queues `flat` for stage `peer`.
    pub fn send(&mut self, peer: usize, flat: Tensor<1>) {
        self.pending.push((peer, flat));
    }

    /// Sends what waits and receives `incoming`, timing the wait as a transfer of micro-batch `micro_batch`.
    pub fn exchange(
        &mut self,
        incoming: Vec<Incoming>,
        micro_batch: usize,
    ) -> Result<Vec<Tensor<1>>> {
        let start = Instant::now();
        let sends = std::mem::take(&mut self.pending);
        let waited_for = incoming.first().map(|r| r.peer);
        let received = self
            .stages
            .comm
            .send_recv(sends, incoming, "pipeline send/recv")
            .and_then(|pending| pending.wait())
            .map_err(|e| match e {
                // Which stage waited, for what: a timeout or a failed peer names the pipeline's side of it.
                Error::Comm(error) => Error::Comm(crate::distributed::comm::CommError::During {
                    context: match waited_for {
                        Some(peer) => format!(
                            "{}, micro-batch {micro_batch}, waiting for stage {peer}",
                            self.stages.transfer
                        ),
                        None => format!("{}, micro-batch {micro_batch}", self.stages.transfer),
                    },
                    error: Box::new(error),
                }),
                other => other,
            })?;
        self.spans.push(TraceSpan {
            kind: SpanKind::Transfer,
            micro_batch,
            start_us: micros(start - self.started),
            duration_us: micros(start.elapsed()),
        });
        Ok(received)
    }

    /// Sends `y` (an activation) to stage `peer`: a header (its shape and element type), then its values.
    pub fn send_activation<const D: usize>(&mut self, peer: usize, y: &Tensor<D>) -> Result<()> {
        let dtype = y.dtype();
        let code = DTYPES.iter().position(|d| *d == dtype).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "backward_batch: a block's output in {dtype:?} cannot cross pipeline stages (f32, f16, bf16 or f64)"
            ))
        })?;
        let header: Vec<f32> = y
            .dims()
            .iter()
            .map(|&d| d as f32)
            .chain([code as f32])
            .collect();
        let header = Tensor::<1>::from_floats(header.as_slice(), &self.device);
        let n = y.shape().num_elements();
        self.send(peer, header);
        self.send(peer, y.clone().detach().reshape([n]));
        Ok(())
    }

    /// Tells stage `peer` that this stage has no activation for it (a pass failed here or before it): a header
    /// marked failed, and no values. The peer then stops computing the step and sends no gradient for it.
    pub fn send_failed<const D: usize>(&mut self, peer: usize) {
        let header: Vec<f32> = std::iter::repeat_n(0.0, D).chain([FAILED]).collect();
        let header = Tensor::<1>::from_floats(header.as_slice(), &self.device);
        self.send(peer, header);
    }

    /// Receives an activation from stage `peer` (see [`send_activation`](Self::send_activation)); `None` when
    /// the peer sent word that it has none ([`send_failed`](Self::send_failed)).
    pub fn receive_activation<const D: usize>(
        &mut self,
        peer: usize,
        i: usize,
    ) -> Result<Option<Tensor<D>>> {
        let header = self.exchange(
            vec![Incoming {
                peer,
                len: D + 1,
                device: self.device.clone(),
                dtype: DType::F32,
            }],
            i,
        )?;
        let header = header[0]
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| {
                Error::other(format!(
                    "backward_batch: reading an activation's header: {e:?}"
                ))
            })?;
        if header[D] == FAILED {
            return Ok(None);
        }
        let mut dims = [0usize; D];
        for (d, v) in dims.iter_mut().zip(&header) {
            *d = *v as usize;
        }
        let dtype = DTYPES[(header[D] as usize).min(DTYPES.len() - 1)];
        let len = dims.iter().product();
        let values = self.exchange(
            vec![Incoming {
                peer,
                len,
                device: self.device.clone(),
                dtype,
            }],
            i,
        )?;
        Ok(Some(values[0].clone().reshape(dims)))
    }
}

pub(super) fn micros(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
