#!/usr/bin/env bash
# The demonstration of block-wise FULL_SHARD: under a per-process memory limit (prlimit --as, address space),
# NO_SHARD and FULL_SHARD with the whole model gathered fail with an out-of-memory error on 4 MPI ranks, block-wise
# FULL_SHARD trains the same 232 M-parameter transformer to the end, and its weights equal those of NO_SHARD on one
# process without the limit. Each of these is checked: the script exits non-zero, saying which, when one does not
# hold (a mode that should fail and trains, or fails for another reason than memory; weights that differ).
#
#   cargo build --release --features mpi --example transformer_lm
#   scripts/memory-limit-demo.sh [limit in MiB, default 1750] [steps, default 3] [bound on |Δw|, default 1e-5]
set -euo pipefail
cd "$(dirname "$0")/.."
limit_mib=${1:-1750}
steps=${2:-3}
bound=${3:-1e-5}
bin=${LM_BIN:-target/release/examples/transformer_lm}
[ -x "$bin" ] || { echo "no $bin: build it first (see the top of this script)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
model=(--layers 24 --d-model 896 --heads 14 --seq 32 --batch 4 --steps "$steps" --skip-state-bytes)
limit=$((limit_mib * 1024 * 1024))
export OMPI_MCA_rmaps_base_oversubscribe=1
fail() { echo "FAILED: $*" >&2; exit 1; }

# Runs 4 limited ranks with `--sharding $1 ...`, each mode writing files of its own; the log is $out/<tag>.log.
limited() {
  local tag=$1; shift
  mpirun --allow-run-as-root --oversubscribe -np 4 prlimit --as="$limit" "$bin" "${model[@]}" "$@" \
    --weights "$out/$tag.bin" --save-model "$out/$tag-saved" >"$out/$tag.log" 2>&1
}
ran_out_of_memory() { grep -qE "memory allocation of [0-9]+ bytes failed|out of memory|ran out of memory" "$out/$1.log"; }

echo "== 4 ranks, each limited to $limit_mib MiB of address space"
for mode in no-shard whole; do
  case $mode in
    no-shard) flags=(--sharding NO_SHARD) ;;
    whole) flags=(--sharding FULL_SHARD --whole) ;;
  esac
  printf -- '-- %s: ' "${flags[*]}"
  if limited "$mode" "${flags[@]}"; then
    tail -n 3 "$out/$mode.log"
    fail "${flags[*]} trained under the limit: the limit is too high to show anything (lower it)"
  fi
  ran_out_of_memory "$mode" || { tail -n 20 "$out/$mode.log"; fail "${flags[*]} failed, but not for memory"; }
  echo "failed: $(grep -m1 -oE "memory allocation of [0-9]+ bytes failed|[^:]*out of memory[^.]*" "$out/$mode.log")"
done
printf -- '-- --sharding FULL_SHARD (block-wise): '
limited blockwise --sharding FULL_SHARD || { tail -n 20 "$out/blockwise.log"; fail "block-wise FULL_SHARD did not train under the limit"; }
grep -q "final_loss=" "$out/blockwise.log" || fail "block-wise FULL_SHARD printed no final_loss"
echo "trained to the end; $(grep -m1 -o 'saved .*' "$out/blockwise.log" || echo 'saved')"

echo "== NO_SHARD, one process, no limit"
"$bin" "${model[@]}" --sharding NO_SHARD --weights "$out/reference.bin" >"$out/reference.log" 2>&1 \
  || { tail -n 20 "$out/reference.log"; fail "the unlimited reference run failed"; }
grep final_loss= "$out/reference.log"
python3 - "$out/blockwise.bin" "$out/reference.bin" "$bound" <<'PY'
import array, math, sys
a, b = (array.array("f", open(p, "rb").read()) for p in sys.argv[1:3])
bound = float(sys.argv[3])
if len(a) != len(b) or len(a) == 0:
    sys.exit(f"FAILED: {len(a)} weights against {len(b)}")
diff = max(abs(x - y) for x, y in zip(a, b))
print(f"block-wise FULL_SHARD (4 limited ranks) vs NO_SHARD (1 process): {len(a)} weights, max |diff| = {diff:.3e}")
if not math.isfinite(diff) or diff > bound:
    sys.exit(f"FAILED: max |diff| {diff:.3e} is over the bound {bound:.1e}")
PY
echo "== every check held"
