#!/usr/bin/env bash
# Checks the output of `burn-accelerate test --num-processes N` on in-process ranks sharing one device (a GPU, or
# wgpu on Vulkan's software driver): the main process must have trained every strategy over a communicator that
# refuses every buffer through host memory, and printed its weights' difference from the host path's (a line
# `GPU: ...: STRATEGY with no buffer through host memory: max |weights - the host path's| = ..., control_bytes=N
# (budget B)` each, with N within B: the control bytes (agreements, ids) its ranks passed through host memory; the
# command itself fails when a training passed a buffer through host memory, its control past the budget, or ended
# beyond the bound).
#
# Usage: scripts/gpu/check-no-host-buffers.sh LOG
# Prints each strategy's line; exits 1 naming the first strategy missing.
set -euo pipefail
log="${1:?usage: check-no-host-buffers.sh LOG}"
for strategy in NO_SHARD SHARD_GRAD_OP FULL_SHARD 'FULL_SHARD block-wise' HYBRID_SHARD _HYBRID_SHARD_ZERO2; do
  line=$(grep -F ": $strategy with no buffer through host memory: max |weights - the host path's|" "$log" | head -n1 || true)
  if [ -z "$line" ]; then
    echo "$strategy was not trained with no buffer through host memory" >&2
    exit 1
  fi
  control=$(printf '%s\n' "$line" | sed -nE 's/.*control_bytes=([0-9]+) \(budget ([0-9]+)\).*/\1 \2/p')
  if [ -z "$control" ] || [ "${control% *}" -gt "${control#* }" ]; then
    echo "$strategy: its control bytes through host memory are missing or past the budget: $line" >&2
    exit 1
  fi
  printf '%s\n' "$line"
done
