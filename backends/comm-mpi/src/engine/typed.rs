//! The typed collectives behind the communicator's calls: reduce-scatter, all-gather of parts, rooted reduce
//! and broadcast, each started non-blocking and polled against the timeout.

use super::*;

impl MpiComm {
    /// Reduce-scatter of one element type: each rank's part is padded to the largest part, so that MPI's
    /// `MPI_Reduce_scatter_block` (equal blocks) serves uneven parts too; the padding is cut off again.
    pub(super) fn reduce_scatter_typed<T>(
        &self,
        spare: &mut Vec<T>,
        data: Vec<T>,
        counts: &[usize],
        kind: u64,
        op: ReduceOp,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let (system, op_code) = system_op(op);
        let part = burn_accelerate_comm::part_of(counts, self.rank, self.size, data.len());
        let (seq, _) = self.agree(Call::ReduceScatter {
            kind_op: kind * 4 + op_code,
            len: data.len() as u64,
            parts: fingerprint(counts),
        })?;
        // Every rank passed the same length and counts (the headers agree), so the split is valid on every
        // rank or on none.
        let part = part?;
        let block = counts.iter().copied().max().unwrap_or(0);
        if block == 0 {
            return Ok(Vec::new());
        }
        let send = if counts.iter().all(|c| *c == block) {
            // Equal parts: the buffer is already laid out in blocks.
            data
        } else {
            let mut send = vec![T::default(); block * self.size];
            let mut start = 0;
            for (r, count) in counts.iter().enumerate() {
                send[r * block..r * block + count].clone_from_slice(&data[start..start + count]);
                start += count;
            }
            send
        };
        // The previous call's send buffer receives this one's part: a steady stream of equal reduce-scatters
        // allocates (and faults in) nothing.
        // (Its old values are overwritten by MPI: only its length matters.)
        let mut recv = std::mem::take(spare);
        if recv.capacity() > block + block / 8 {
            // A much larger spare would stay allocated behind this part for as long as the caller keeps it (a
            // rank's slice of a gradient kept whole-sized): a buffer of its own instead.
            recv = Vec::new();
        }
        recv.resize(block, T::default());
        let (send, mut recv) = if send.len() * std::mem::size_of::<T>() < BLOCKING_MIN_BYTES {
            self.run(
                "reduce_scatter",
                seq,
                (send, recv),
                |world, (send, recv)| {
                    world.immediate_reduce_scatter_block_into(
                        StaticScope,
                        &send[..],
                        &mut recv[..],
                        system,
                    )
                },
            )?
        } else {
            // Large buffers take MPI's blocking call, as all-reduces do, once the headers showed every rank in
            // this very reduce-scatter.
            let mut recv = recv;
            self.world
                .reduce_scatter_block_into(&send[..], &mut recv[..], system);
            (send, recv)
        };
        *spare = send;
        recv.truncate(part.len());
        Ok(recv)
    }
}

impl MpiComm {
    /// All-gather of one element type's parts (`MPI_Allgatherv`).
    pub(super) fn all_gather_parts_typed<T>(
        &self,
        data: Vec<T>,
        counts: &[usize],
        kind: u64,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let total = burn_accelerate_comm::gathered_len(counts, self.rank, self.size, data.len());
        let (seq, calls) = self.agree(Call::AllGatherParts {
            kind,
            len: data.len() as u64,
            parts: fingerprint(counts),
        })?;
        // The headers agree on the counts; each rank's own length is in its header, so every rank finds the
        // same rank whose part does not fit.
        for (r, call) in calls.iter().enumerate() {
            if let Call::AllGatherParts { len, .. } = call
                && Some(&(*len as usize)) != counts.get(r)
            {
                return Err(CommError::IncompatibleInputs {
                    operation: "all_gather_parts".into(),
                    reason: format!(
                        "rank {r} passed {len} elements where the counts {counts:?} say otherwise"
                    ),
                });
            }
        }
        total?;
        let counts: Vec<u64> = counts.iter().map(|c| *c as u64).collect();
        self.gather_varcount("all_gather_parts", seq, data, &counts)
    }

    /// The all-gather of collective `seq` once its headers agreed: every rank's `data` (`counts[r]` elements
    /// for rank `r`) concatenated in rank order (`MPI_Allgatherv`; MPI's blocking call from 256 KiB, as the
    /// all-reduce).
    pub(super) fn gather_varcount<T>(
        &self,
        operation: &str,
        seq: u64,
        data: Vec<T>,
        counts: &[u64],
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            // Nothing to move (MPI refuses a zero-sized varcount gather with MPI_ERR_ARG).
            return Ok(Vec::new());
        }
        if total > i32::MAX as u64 {
            return Err(engine_error(
                operation,
                "more than 2^31 elements gathered in one call; split the data",
            ));
        }
        let counts: Vec<i32> = counts.iter().map(|c| *c as i32).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |acc, c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let recv = vec![T::default(); total as usize];
        if total as usize * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            // Large buffers take MPI's blocking call once the headers showed every rank in this very
            // all-gather.
            let mut recv = recv;
            let mut partition = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
            self.world
                .all_gather_varcount_into(&data[..], &mut partition);
            return Ok(recv);
        }
        type Part<T> = PartitionMut<'static, [T], &'static [i32], &'static [i32]>;
        let mut partition: *mut Part<T> = std::ptr::null_mut();
        let (_, recv, _, _) = self.run(
            operation,
            seq,
            (data, recv, counts, displs),
            |world, (send, recv, counts, displs)| {
                partition = Box::into_raw(Box::new(PartitionMut::new(
                    &mut recv[..],
                    &counts[..],
                    &displs[..],
                )));
                // SAFETY: freed below only once the request has completed.
                world.immediate_all_gather_varcount_into(StaticScope, &send[..], unsafe {
                    &mut *partition
                })
            },
        )?;
        // SAFETY: the request completed; nothing refers to the partition any more.
        drop(unsafe { Box::from_raw(partition) });
        Ok(recv)
    }
}

impl MpiComm {
    /// Reduce of one element type to `root`: the root receives into the previous call's send buffer, as the
    /// all-reduce does.
    pub(super) fn reduce_to_root_typed<T>(
        &self,
        spare: &mut Vec<T>,
        data: Vec<T>,
        (kind, op, root): (u64, ReduceOp, usize),
    ) -> CommResult<Option<Vec<T>>>
    where
        T: mpi::datatype::Equivalence + Default + Clone + 'static,
    {
        burn_accelerate_comm::check_root_public("reduce", root, self.size)?;
        let (system, op_code) = system_op(op);
        let (seq, _) = self.agree(Call::Reduce {
            kind_op: kind * 4 + op_code,
            len: data.len() as u64,
            root: root as u64,
        })?;
        if data.is_empty() {
            return Ok((self.rank == root).then_some(data));
        }
        let target = self.world.process_at_rank(root as i32);
        if self.rank != root {
            if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
                target.reduce_into(&data[..], system);
            } else {
                self.run("reduce", seq, data, |_, send| {
                    target.immediate_reduce_into(StaticScope, &send[..], system)
                })?;
            }
            return Ok(None);
        }
        let mut recv = std::mem::take(spare);
        recv.resize(data.len(), T::default());
        let (send, recv) = if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            // As the all-reduce: MPI's blocking call once the headers showed every rank in this very reduce.
            let mut recv = recv;
            target.reduce_into_root(&data[..], &mut recv[..], system);
            (data, recv)
        } else {
            self.run("reduce", seq, (data, recv), |_, (send, recv)| {
                target.immediate_reduce_into_root(StaticScope, &send[..], &mut recv[..], system)
            })?
        };
        *spare = send;
        Ok(Some(recv))
    }

    /// Broadcast of one element type from `root`, into every rank's own buffer.
    pub(super) fn broadcast_typed<T>(
        &self,
        mut data: Vec<T>,
        kind: u64,
        root: usize,
    ) -> CommResult<Vec<T>>
    where
        T: mpi::datatype::Equivalence + 'static,
    {
        burn_accelerate_comm::check_root_public("broadcast_buffer", root, self.size)?;
        let (seq, _) = self.agree(Call::BroadcastBuffer {
            kind,
            len: data.len() as u64,
            root: root as u64,
        })?;
        if data.is_empty() {
            return Ok(data);
        }
        let from = self.world.process_at_rank(root as i32);
        if data.len() * std::mem::size_of::<T>() >= BLOCKING_MIN_BYTES {
            from.broadcast_into(&mut data[..]);
            return Ok(data);
        }
        self.run("broadcast_buffer", seq, data, |_, buffer| {
            from.immediate_broadcast_into(StaticScope, &mut buffer[..])
        })
    }
}
