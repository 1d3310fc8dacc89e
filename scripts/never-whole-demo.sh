#!/usr/bin/env bash
# The demonstration that FULL_SHARD trains a model larger than one rank's memory: every rank is limited
# (`prlimit --as`, address space) to less than the model's f32 parameters alone, just above what its share
# needs. NO_SHARD fails there; block-wise FULL_SHARD initialises the model from a seed without it ever being whole
# on a rank, trains it on RANKS MPI ranks, saves the training state (each rank its slices), is killed (SIGKILL),
# resumes on RESUME_RANKS ranks and trains to the end; its weights then equal those of NO_SHARD on one process
# without a limit within BOUND. Each of these is checked: the script exits non-zero, saying which, when one does
# not hold.
#
#   cargo build --release --features mpi --example transformer_lm
#   scripts/never-whole-demo.sh                       # 680 M parameters (2.7 GB of f32), 8 ranks then 6
#   LAYERS=4 D_MODEL=256 HEADS=4 RANKS=4 RESUME_RANKS=3 LIMIT_MIB=... scripts/never-whole-demo.sh   # reduced
#
# Settings (environment): LAYERS, D_MODEL, HEADS, SEQ, BATCH (global, divisible by both rank counts), STEPS,
# SAVE_AT, RANKS, RESUME_RANKS, LIMIT_MIB (per rank, training; default: measured from a run of the same model
# without a limit, plus LIMIT_SLACK_MIB), SAVE_LIMIT_MIB (per rank, training and saving; default LIMIT_MIB's),
# RESUME_LIMIT_MIB (per rank on RESUME_RANKS ranks, each holding a larger share; default measured the same way),
# BOUND.
set -euo pipefail
cd "$(dirname "$0")/.."
layers=${LAYERS:-24} d_model=${D_MODEL:-1536} heads=${HEADS:-16} seq=${SEQ:-8} batch=${BATCH:-24}
steps=${STEPS:-3} save_at=${SAVE_AT:-2} ranks=${RANKS:-8} resume_ranks=${RESUME_RANKS:-6}
bound=${BOUND:-1e-5} slack=${LIMIT_SLACK_MIB:-300}
python=${PYTHON:-python3}
bin=${LM_BIN:-target/release/examples/transformer_lm}
[ -x "$bin" ] || { echo "no $bin: build it first (see the top of this script)" >&2; exit 2; }
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${OUT:-}" ] || trap 'rm -rf "$out"' EXIT
model=(--layers "$layers" --d-model "$d_model" --heads "$heads" --seq "$seq" --batch "$batch" --skip-state-bytes)
export OMPI_MCA_rmaps_base_oversubscribe=1
fail() { echo "FAILED: $*" >&2; exit 1; }
mpi() { local np=$1; shift; mpirun --allow-run-as-root --oversubscribe -np "$np" "$@"; }
field() { grep -oE "$1=[0-9]+" "$2" | cut -d= -f2 | sort -n | tail -1; }
# Open MPI reports an allocation that fails inside a collective under the limit as MPI_ERR_NO_MEM or, in some
# versions, as an internal error of the collective.
ran_out_of_memory() { grep -qE "memory allocation of [0-9]+ bytes failed|out of memory|ran out of memory|Cannot allocate memory|MPI_ERR_NO_MEM|MPI_ERR_INTERN: internal error" "$1"; }

# What the model's f32 parameters alone take, and what each rank needs for its share: the peak address space of an
# unlimited block-wise run of two steps (the second holds the optimizer state) on RANKS ranks before it saves the
# state, and of a resume from that save on RESUME_RANKS ranks, each plus the slack. Training and saving must fit
# below the f32 parameters under one limit; the resume on fewer ranks (a larger share each) under its own, below
# them too.
mpi "$ranks" "$bin" "${model[@]}" --sharding FULL_SHARD --steps 2 --state "$out/measure-state" --save-at 2 \
  >"$out/measure.log" 2>&1 || { tail -n 20 "$out/measure.log"; fail "the unlimited measuring run failed"; }
params=$(grep -oE " params=[0-9]+" "$out/measure.log" | head -1 | cut -d= -f2)
whole_mib=$((params * 4 / 1048576))
train_limit_mib=${LIMIT_MIB:-$(($(field before_save_peak_vm "$out/measure.log") / 1048576 + slack))}
save_limit_mib=${SAVE_LIMIT_MIB:-$train_limit_mib}
mpi "$resume_ranks" "$bin" "${model[@]}" --sharding FULL_SHARD --steps "$steps" --state "$out/measure-state" --resume \
  --weights "$out/measure-weights.bin" >"$out/measure-resume.log" 2>&1 \
  || { tail -n 20 "$out/measure-resume.log"; fail "the unlimited measuring run on $resume_ranks ranks failed"; }
resume_limit_mib=${RESUME_LIMIT_MIB:-$(($(field peak_vm "$out/measure-resume.log") / 1048576 + slack))}
rm -rf "$out/measure-state" "$out/measure-weights.bin"
echo "== $params parameters: $whole_mib MiB of f32; each of $ranks ranks limited to $train_limit_mib MiB to train, $save_limit_mib MiB to train and save; each of $resume_ranks ranks to $resume_limit_mib MiB to resume"
# A reduced run (REDUCED=1, the test's) keeps the checks below but not this one: a process's fixed address space
# (libraries, threads' stacks, MPI's segments) is larger than a small model.
if [ "${REDUCED:-0}" != 1 ]; then
  [ "$train_limit_mib" -lt "$whole_mib" ] || fail "the training limit ($train_limit_mib MiB) does not lie below the f32 parameters ($whole_mib MiB): a larger model shows more"
  [ "$resume_limit_mib" -lt "$whole_mib" ] || fail "the resume limit ($resume_limit_mib MiB) does not lie below the f32 parameters ($whole_mib MiB)"
fi
limited() {
  local np=$1 mib=$2; shift 2
  mpi "$np" prlimit --as=$((mib * 1048576)) "$bin" "${model[@]}" --steps "$steps" "$@"
}

printf -- "-- NO_SHARD, %s limited ranks: " "$ranks"
if limited "$ranks" "$train_limit_mib" --sharding NO_SHARD >"$out/no-shard.log" 2>&1; then
  fail "NO_SHARD trained under the limit"
fi
# Open MPI can lose a dying rank's message on its way to mpirun (`ORTE_ERROR_LOG: Data unpack would read past end
# of buffer ... show_help.c`, seen once in a cold CI run): then the limited run goes once more, and must fail again.
if ! ran_out_of_memory "$out/no-shard.log" && grep -q 'ORTE_ERROR_LOG' "$out/no-shard.log"; then
  if limited "$ranks" "$train_limit_mib" --sharding NO_SHARD >"$out/no-shard.log" 2>&1; then
    fail "NO_SHARD trained under the limit"
  fi
fi
ran_out_of_memory "$out/no-shard.log" || { tail -n 20 "$out/no-shard.log"; fail "NO_SHARD failed, but not for memory"; }
echo "failed: $(grep -m1 -oE "memory allocation of [0-9]+ bytes failed|[^:]*out of memory[^.]*|Cannot allocate memory" "$out/no-shard.log")"

printf -- "-- FULL_SHARD (block-wise), %s ranks limited to %s MiB, %s steps: " "$ranks" "$train_limit_mib" "$steps"
limited "$ranks" "$train_limit_mib" --sharding FULL_SHARD --weights "$out/trained.bin" >"$out/trained.log" 2>&1 \
  || { tail -n 20 "$out/trained.log"; fail "block-wise FULL_SHARD did not train under the limit"; }
echo "$(grep -m1 -oE 'final_loss=[0-9.]+' "$out/trained.log"), peak RSS $(($(field peak_rss "$out/trained.log") / 1048576)) MiB a rank at most"

printf -- "-- FULL_SHARD (block-wise), %s limited ranks, saved after step %s and killed: " "$ranks" "$save_at"
rm -rf "$out/state"
limited "$ranks" "$save_limit_mib" --sharding FULL_SHARD --state "$out/state" --save-at "$save_at" --kill-after-save \
  >"$out/first.log" 2>&1 && fail "the ranks were not killed after the save"
grep -q "saved the state after step $save_at" "$out/first.log" || { tail -n 20 "$out/first.log"; fail "no state saved"; }
[ -f "$out/state/checkpoint.json" ] || fail "the state has no manifest"
echo "saved ($(du -sh "$out/state" | cut -f1)), killed"

printf -- "-- FULL_SHARD (block-wise), %s limited ranks, resumed to step %s: " "$resume_ranks" "$steps"
limited "$resume_ranks" "$resume_limit_mib" --sharding FULL_SHARD --state "$out/state" --resume \
  --weights "$out/sharded.bin" >"$out/resumed.log" 2>&1 || { tail -n 20 "$out/resumed.log"; fail "the resume failed"; }
grep -q "resumed after step $save_at on $resume_ranks ranks" "$out/resumed.log" || fail "did not resume after step $save_at"
echo "$(grep -m1 -oE 'final_loss=[0-9.]+' "$out/resumed.log"), peak RSS $(($(field peak_rss "$out/resumed.log") / 1048576)) MiB a rank at most"

echo "== NO_SHARD, one process, no limit"
"$bin" "${model[@]}" --steps "$steps" --sharding NO_SHARD --weights "$out/reference.bin" >"$out/reference.log" 2>&1 \
  || { tail -n 20 "$out/reference.log"; fail "the unlimited reference run failed"; }
grep -m1 -oE 'final_loss=[0-9.]+' "$out/reference.log"
for run in trained sharded; do
"$python" - "$out/$run.bin" "$out/reference.bin" "$bound" "$run" <<'PY'
import sys
try:
    import numpy as np
    a, b = (np.fromfile(p, dtype="<f4") for p in sys.argv[1:3])
    n, diff = len(a), (float(np.max(np.abs(a - b))) if len(a) == len(b) and len(a) else float("nan"))
    ok = len(a) == len(b) and len(a) > 0
except ImportError:
    import array
    a, b = (array.array("f", open(p, "rb").read()) for p in sys.argv[1:3])
    n, ok = len(a), len(a) == len(b) and len(a) > 0
    diff = max(abs(x - y) for x, y in zip(a, b)) if ok else float("nan")
bound = float(sys.argv[3])
if not ok:
    sys.exit("FAILED: the weight files differ in length")
what = {"trained": "FULL_SHARD (limited)", "sharded": "FULL_SHARD (limited, killed, resumed on other ranks)"}[sys.argv[4]]
print(f"{what} vs NO_SHARD (1 process): {n} weights, max |diff| = {diff:.3e}")
if not diff <= bound:
    sys.exit(f"FAILED: max |diff| {diff:.3e} is over the bound {bound:.1e}")
PY
done
echo "== every check held"
