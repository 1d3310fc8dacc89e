//! The call headers every collective starts with: what a rank is about to do, packed into a few words that
//! every rank gathers, so that ranks calling different collectives fail together instead of hanging.

use super::*;

/// What a rank is about to do. Every collective starts with a fixed-size, timed all-gather of these headers, so
/// headers always match each other in MPI's eyes whatever the ranks do next: ranks that called different
/// collectives, or an all-reduce of different lengths, all get the same error at once instead of a hang, mixed data
/// or a blocking call that waits for a rank doing something else. The headers also carry the all-gather lengths
/// and the broadcast length, so those collectives need no exchange of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    Barrier,
    AllReduce {
        kind: u64,
        op: u64,
        len: u64,
    },
    AllGather {
        len: u64,
    },
    Broadcast {
        root: u64,
        len: u64,
    },
    /// `kind_op` is `kind * 4 + op`; `parts` a fingerprint of the per-rank counts, which must agree.
    ReduceScatter {
        kind_op: u64,
        len: u64,
        parts: u64,
    },
    /// `len` is this rank's part; `parts` a fingerprint of the per-rank counts, which must agree.
    AllGatherParts {
        kind: u64,
        len: u64,
        parts: u64,
    },
    /// `kind_op` is `kind * 4 + op`, as for the reduce-scatter.
    Reduce {
        kind_op: u64,
        len: u64,
        root: u64,
    },
    BroadcastBuffer {
        kind: u64,
        len: u64,
        root: u64,
    },
}

pub(super) const CALL_WORDS: usize = 4;
pub(super) const KINDS: [&str; 3] = ["f32", "f64", "i64"];
pub(super) const OPS: [&str; 3] = ["sum", "max", "min"];

impl Call {
    pub(super) fn encode(self) -> [u64; CALL_WORDS] {
        match self {
            Call::Barrier => [1, 0, 0, 0],
            Call::AllReduce { kind, op, len } => [2, kind, op, len],
            Call::AllGather { len } => [3, 0, 0, len],
            Call::Broadcast { root, len } => [4, root, 0, len],
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => [5, kind_op, len, parts],
            Call::AllGatherParts { kind, len, parts } => [6, kind, len, parts],
            Call::Reduce { kind_op, len, root } => [7, kind_op, len, root],
            Call::BroadcastBuffer { kind, len, root } => [8, kind, len, root],
        }
    }

    pub(super) fn decode(words: &[u64]) -> Option<Self> {
        match *words {
            [1, _, _, _] => Some(Call::Barrier),
            [2, kind, op, len] if (kind as usize) < KINDS.len() && (op as usize) < OPS.len() => {
                Some(Call::AllReduce { kind, op, len })
            }
            [3, _, _, len] => Some(Call::AllGather { len }),
            [4, root, _, len] => Some(Call::Broadcast { root, len }),
            [5, kind_op, len, parts]
                if ((kind_op / 4) as usize) < KINDS.len()
                    && ((kind_op % 4) as usize) < OPS.len() =>
            {
                Some(Call::ReduceScatter {
                    kind_op,
                    len,
                    parts,
                })
            }
            [6, kind, len, parts] if (kind as usize) < KINDS.len() => {
                Some(Call::AllGatherParts { kind, len, parts })
            }
            [7, kind_op, len, root]
                if ((kind_op / 4) as usize) < KINDS.len()
                    && ((kind_op % 4) as usize) < OPS.len() =>
            {
                Some(Call::Reduce { kind_op, len, root })
            }
            [8, kind, len, root] if (kind as usize) < KINDS.len() => {
                Some(Call::BroadcastBuffer { kind, len, root })
            }
            _ => None,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Call::Barrier => "barrier",
            Call::AllReduce { .. } => "all_reduce",
            Call::AllGather { .. } => "all_gather",
            Call::Broadcast { .. } => "broadcast",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::AllGatherParts { .. } => "all_gather_parts",
            Call::Reduce { .. } => "reduce",
            Call::BroadcastBuffer { .. } => "broadcast_buffer",
        }
    }

    pub(super) fn describe(self) -> String {
        match self {
            Call::Barrier => "barrier".into(),
            Call::AllReduce { kind, op, len } => format!(
                "all_reduce ({}) of {len} x {}",
                OPS[op as usize], KINDS[kind as usize]
            ),
            Call::AllGather { len } => format!("all_gather of {len} bytes"),
            Call::Broadcast { root, .. } => format!("broadcast from rank {root}"),
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => format!(
                "reduce_scatter ({}) of {len} x {} into parts {parts:#x}",
                OPS[(kind_op % 4) as usize],
                KINDS[(kind_op / 4) as usize]
            ),
            Call::AllGatherParts { kind, len, parts } => format!(
                "all_gather_parts of {len} x {} into parts {parts:#x}",
                KINDS[kind as usize]
            ),
            Call::Reduce { kind_op, len, root } => format!(
                "reduce ({}) of {len} x {} to rank {root}",
                OPS[(kind_op % 4) as usize],
                KINDS[(kind_op / 4) as usize]
            ),
            Call::BroadcastBuffer { kind, len, root } => format!(
                "broadcast_buffer of {len} x {} from rank {root}",
                KINDS[kind as usize]
            ),
        }
    }

    /// The call as the one mismatch check compares it: the same collective, and for an all-reduce the same
    /// element kind, operation and length, for a broadcast the same root (only the root's length counts).
    pub(super) fn signature(self) -> CallSignature {
        let must_agree = match self {
            Call::Barrier | Call::AllGather { .. } => String::new(),
            Call::AllReduce { kind, op, len } => format!("{kind} {op} {len}"),
            Call::Broadcast { root, .. } => root.to_string(),
            Call::ReduceScatter {
                kind_op,
                len,
                parts,
            } => format!("{kind_op} {len} {parts}"),
            // Each rank's own length is checked against the counts once the headers are in.
            Call::AllGatherParts { kind, parts, .. } => format!("{kind} {parts}"),
            Call::Reduce { kind_op, len, root } => format!("{kind_op} {len} {root}"),
            Call::BroadcastBuffer { kind, len, root } => format!("{kind} {len} {root}"),
        };
        CallSignature {
            collective: self.name().into(),
            must_agree,
            described: self.describe(),
        }
    }
}

/// MPI's operation for `op` (a mean is a sum, divided afterwards) and its code in the call headers.
pub(super) fn system_op(op: ReduceOp) -> (SystemOperation, u64) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => (SystemOperation::sum(), 0),
        ReduceOp::Max => (SystemOperation::max(), 1),
        ReduceOp::Min => (SystemOperation::min(), 2),
    }
}

/// A fingerprint of a reduce-scatter's counts (FNV-1a), compared across ranks in the call headers.
pub(super) fn fingerprint(counts: &[usize]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for byte in counts.iter().flat_map(|c| (*c as u64).to_le_bytes()) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}
