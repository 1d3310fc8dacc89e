#!/usr/bin/env bash
# The demonstration of block-wise FULL_SHARD: under a per-process memory limit (prlimit --as, address space),
# NO_SHARD and FULL_SHARD with the whole model gathered fail with an out-of-memory error on 4 MPI ranks, block-wise
# FULL_SHARD trains the same 232 M-parameter transformer to the end, and its weights equal those of NO_SHARD on one
# process without the limit.
#
#   cargo build --release --features mpi --example transformer_lm
#   scripts/memory-limit-demo.sh [limit in MiB, default 1750] [steps, default 3]
set -uo pipefail
cd "$(dirname "$0")/.."
limit_mib=${1:-1750}
steps=${2:-3}
bin=${LM_BIN:-target/release/examples/transformer_lm}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
model=(--layers 24 --d-model 896 --heads 14 --seq 32 --batch 4 --steps "$steps" --skip-state-bytes)
limit=$((limit_mib * 1024 * 1024))
export OMPI_MCA_rmaps_base_oversubscribe=1
limited() {
  mpirun --allow-run-as-root --oversubscribe -np 4 prlimit --as="$limit" "$bin" "${model[@]}" "$@" >"$out/log" 2>&1
  local rc=$?
  grep -m1 -E "memory allocation of [0-9]+ bytes failed|final_loss=" "$out/log" || tail -n 3 "$out/log"
  return $rc
}
echo "== 4 ranks, each limited to $limit_mib MiB of address space"
for mode in "NO_SHARD" "FULL_SHARD --whole" "FULL_SHARD"; do
  printf -- '-- %s: ' "$mode"
  # shellcheck disable=SC2086
  if limited --sharding $mode --weights "$out/limited.bin" --save-model "$out/saved"; then
    echo "   trained to the end; saved: $(grep -o 'saved .*' "$out/log")"
  else
    echo "   failed"
  fi
done
echo "== NO_SHARD, one process, no limit"
"$bin" "${model[@]}" --sharding NO_SHARD --weights "$out/reference.bin" | grep final_loss=
python3 - "$out/limited.bin" "$out/reference.bin" <<'PY'
import array, sys
a, b = (array.array("f", open(p, "rb").read()) for p in sys.argv[1:])
assert len(a) == len(b), (len(a), len(b))
print(f"block-wise FULL_SHARD (4 limited ranks) vs NO_SHARD (1 process): {len(a)} weights, max |diff| = "
      f"{max(abs(x - y) for x, y in zip(a, b)):.3e}")
PY
