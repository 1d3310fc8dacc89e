//! How each sequence is cut over a context group ([`ContextSplit`]): into `2 × cp` equal chunks, rank `r`
//! holding chunks `r` and `2 × cp − 1 − r` (torchtitan's head-tail balancer) or, unbalanced, chunks `2r` and
//! `2r + 1`.

use burn::tensor::{Int, Tensor, TensorData};

use crate::error::{Error, Result};

/// This rank's slice of every sequence under context parallelism: which positions it holds, and the tensors
/// cut to them. With `cp_size` 1 it holds every position.
///
/// ```
/// use burn_accelerate::context_parallel::ContextSplit;
///
/// // 8 positions over 2 ranks, head-tail: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
/// let split = ContextSplit::new(8, 0, 2, true)?;
/// assert_eq!(split.positions(), &[0, 1, 6, 7]);
/// assert_eq!(ContextSplit::new(8, 1, 2, true)?.positions(), &[2, 3, 4, 5]);
/// // Contiguous: rank 1 holds the second half.
/// assert_eq!(ContextSplit::new(8, 1, 2, false)?.positions(), &[4, 5, 6, 7]);
/// assert!(ContextSplit::new(6, 0, 2, true).is_err());
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSplit {
    seq: usize,
    rank: usize,
    size: usize,
    balanced: bool,
}

impl ContextSplit {
    /// Rank `rank` of `size` context ranks over sequences of `seq` positions, head-tail `balanced` or contiguous.
    ///
    /// # Errors
    /// A `seq` that `2 × size` does not divide (each rank holds two equal chunks); a rank outside the group.
    pub fn new(seq: usize, rank: usize, size: usize, balanced: bool) -> Result<Self> {
        let size = size.max(1);
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "context parallelism: rank {rank} of a context group of {size}"
            )));
        }
        if size > 1 && (seq == 0 || !seq.is_multiple_of(2 * size)) {
            return Err(Error::InvalidArgument(format!(
                "context parallelism: a sequence of {seq} positions does not cut into 2 × cp_size = {} equal \
                 chunks (each rank holds two, for the causal load balance): use sequences whose length is a \
                 multiple of {} (pad them), or a cp_size that fits",
                2 * size,
                2 * size
            )));
        }
        Ok(Self {
            seq,
            rank,
            size,
            balanced,
        })
    }

    /// Every position of a sequence of `seq`, on one rank.
    pub fn whole(seq: usize) -> Self {
        Self {
            seq,
            rank: 0,
            size: 1,
            balanced: true,
        }
    }

    /// The whole sequence's length.
    pub fn seq_len(&self) -> usize {
        self.seq
    }

    /// The positions this rank holds.
    pub fn local_len(&self) -> usize {
        self.seq / self.size
    }

    /// This rank's index in its context group and the group's size.
    pub fn rank_and_size(&self) -> (usize, usize) {
        (self.rank, self.size)
    }

    /// Whether the chunks are head-tail balanced.
    pub fn balanced(&self) -> bool {
        self.balanced
    }

    /// The length of one chunk (a rank holds two; one rank alone, the whole sequence as one).
    pub(crate) fn chunk_len(&self) -> usize {
        match self.size {
            1 => self.seq,
            n => self.seq / (2 * n),
        }
    }

    /// The chunks rank `rank` holds, in its order (one rank alone: the one chunk of the whole sequence).
    pub(crate) fn chunks_of(&self, rank: usize) -> Vec<usize> {
        match (self.size, self.balanced) {
            (1, _) => vec![0],
            (n, true) => vec![rank, 2 * n - 1 - rank],
            (_, false) => vec![2 * rank, 2 * rank + 1],
        }
    }

    /// The positions rank `rank` of the group holds, in its order.
    pub(crate) fn positions_of(&self, rank: usize) -> Vec<usize> {
        let c = self.chunk_len();
        self.chunks_of(rank)
            .into_iter()
            .flat_map(|chunk| chunk * c..(chunk + 1) * c)
            .collect()
    }

    /// The positions this rank holds, in its order: what its slice of a sequence's tokens, targets and position
    /// ids are.
    pub fn positions(&self) -> Vec<usize> {
        self.positions_of(self.rank)
    }

    /// This rank's position ids, `[local_len]`, for a model's position embeddings.
    pub fn position_ids(&self, device: &burn::tensor::Device) -> Tensor<1, Int> {
        let ids: Vec<i64> = self.positions().into_iter().map(|p| p as i64).collect();
        Tensor::from_data(TensorData::new(ids, [self.local_len()]), device)
    }

    /// This rank's slice of `t` along `dim`, the sequence's dimension (`[batch, seq]` tokens: 1): its chunks, in
    /// its order. With one rank, `t` itself.
    ///
    /// # Errors
    /// A dimension past `t`'s, or one whose length is not the sequence's.
    pub fn part<const D: usize, K: burn::tensor::kind::Basic>(
        &self,
        t: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>> {
        let dims = t.dims();
        match dims.get(dim) {
            Some(&len) if len == self.seq => {}
            other => {
                return Err(Error::InvalidArgument(format!(
                    "context parallelism: cutting a tensor of shape {dims:?} along dimension {dim}, whose length \
                     {} is not the sequence's {}: pass the sequence's dimension",
                    other.map_or_else(|| "(none)".to_string(), |l| l.to_string()),
                    self.seq
                )));
            }
        }
        if self.size == 1 {
            return Ok(t);
        }
        let c = self.chunk_len();
        let parts = self
            .chunks_of(self.rank)
            .into_iter()
            .map(|chunk| t.clone().narrow(dim, chunk * c, c))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    /// The attention score elements rank `rank` computes per head and sequence under a causal mask when the
    /// blocks it hides entirely are skipped, as the ring does: for each of its chunks, `chunk_len²` for every chunk
    /// at or before it.
    pub fn causal_block_elements(&self, rank: usize) -> u64 {
        let c = self.chunk_len() as u64;
        self.chunks_of(rank)
            .into_iter()
            .map(|chunk| (chunk as u64 + 1) * c * c)
            .sum()
    }
}
