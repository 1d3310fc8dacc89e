#!/usr/bin/env bash
# The demonstration that context parallelism's ring trains sequences longer than one process can: at a length SEQ
# each of CP MPI ranks (ring attention, head-tail balanced) is limited (`prlimit --as`, address space) to just above
# what it needs, measured; one process at SEQ fails there, the CP ranks train it.
#
# And what each layer keeps, per position, measured: a step's peak above what the process holds at rest, at LAYERS
# and at 2 × LAYERS layers, differs by what LAYERS layers keep (the gradients, the embeddings and the one layer in
# its backward pass at a time cancel). For one process at SEQ/8 and SEQ/4 that is `α·s + β·s²` a layer (`β·s²` its
# attention's scores, which it cannot hold at SEQ); a ring rank's should be `α·s/CP` and no scores, since it
# computes a chunk by a chunk at a time. Checked: a ring rank's bytes per position a layer at SEQ within BOUND × of
# `α / CP` (printed too at SEQ/2, where which moment of the step is the peak can differ between the two depths).
# The script exits non-zero, saying which check failed.
#
#   cargo build --release --features mpi --example transformer_lm
#   scripts/long-context-demo.sh                   # 4096 positions over 4 ranks
#   SEQ=8192 LAYERS=4 scripts/long-context-demo.sh
#
# Settings (environment): LAYERS, D_MODEL, HEADS, SEQ (divisible by 16 × CP), CP, STEPS, BOUND (default 1.15),
# LIMIT_SLACK_MIB (default 64).
set -euo pipefail
cd "$(dirname "$0")/.."
layers=${LAYERS:-2} d_model=${D_MODEL:-64} heads=${HEADS:-4} seq=${SEQ:-4096} cp=${CP:-4} steps=${STEPS:-2}
bound=${BOUND:-1.15} slack=${LIMIT_SLACK_MIB:-64}
bin=${LM_BIN:-target/release/examples/transformer_lm}
[ -x "$bin" ] || { echo "no $bin: build it first (see the top of this script)" >&2; exit 2; }
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${OUT:-}" ] || trap 'rm -rf "$out"' EXIT
model=(--d-model "$d_model" --heads "$heads" --batch 1 --sgd --lr 0.01 --steps "$steps" --skip-state-bytes)
export OMPI_MCA_rmaps_base_oversubscribe=1
fail() { echo "FAILED: $*" >&2; exit 1; }
mpi() { local np=$1; shift; mpirun --allow-run-as-root --oversubscribe -np "$np" "$@"; }
field() { grep -oE "$1=[0-9]+" "$2" | cut -d= -f2 | sort -n | tail -1; }
ran_out_of_memory() { grep -qE "memory allocation of [0-9]+ bytes failed|out of memory|ran out of memory|Cannot allocate memory|MPI_ERR_NO_MEM" "$1"; }

# One process at SEQ/8 and SEQ/4, a ring of CP ranks at SEQ/2 and SEQ, each at LAYERS and 2 × LAYERS layers,
# without a limit: each step's peak above what is held at rest (for the ring, the most of any rank).
peak() { field step_peak_bytes "$1"; }
for depth in "$layers" $((2 * layers)); do
  for div in 8 4; do
    "$bin" "${model[@]}" --layers "$depth" --seq $((seq / div)) >"$out/one-$depth-$div.log" 2>&1 \
      || { tail -n 20 "$out/one-$depth-$div.log"; fail "one process at $((seq / div)) positions failed"; }
  done
  for div in 2 1; do
    mpi "$cp" "$bin" "${model[@]}" --layers "$depth" --seq $((seq / div)) --cp-size "$cp" --cp-mode ring \
      >"$out/ring-$depth-$div.log" 2>&1 \
      || { tail -n 20 "$out/ring-$depth-$div.log"; fail "the unlimited ring run at $((seq / div)) positions failed"; }
  done
done
limit_mib=$(($(field peak_vm "$out/ring-$layers-1.log") / 1048576 + slack))
two=$((2 * layers))
python3 - "$seq" "$cp" "$layers" "$bound" \
  "$(peak "$out/one-$layers-8.log")" "$(peak "$out/one-$two-8.log")" "$(peak "$out/one-$layers-4.log")" \
  "$(peak "$out/one-$two-4.log")" "$(peak "$out/ring-$layers-2.log")" "$(peak "$out/ring-$two-2.log")" \
  "$(peak "$out/ring-$layers-1.log")" "$(peak "$out/ring-$two-1.log")" <<'PY' \
  || fail "a ring rank's activations per layer are not within its formula"
import sys
L, cp, layers = map(int, sys.argv[1:4])
bound = float(sys.argv[4])
o8, o8x2, o4, o4x2, r2, r2x2, r1, r1x2 = map(float, sys.argv[5:13])
# What `layers` layers keep: one process at s = L/8 and L/4, then alpha and beta per layer.
k8, k4 = (o8x2 - o8) / layers, (o4x2 - o4) / layers
s8, s4 = L / 8, L / 4
beta = (k4 / s4 - k8 / s8) / (s4 - s8)
alpha = k8 / s8 - beta * s8
formula = alpha / cp
# A ring rank's, per position of the whole sequence, at L/2 and at L.
per2, per1 = (r2x2 - r2) / layers / (L / 2), (r1x2 - r1) / layers / L
print(f"== one process, a layer: {alpha:.0f} B per position + {beta:.2f} B per position² (its scores: "
      f"{beta * L * L / 2**20:.0f} MiB a layer at {L} positions)")
print(f"-- ring, {cp} ranks, a layer: {per2:.0f} B per position at {L // 2} positions, {per1:.0f} at {L}; formula "
      f"alpha / cp = {formula:.0f} (ratio {per1 / formula:.3f}; bound {bound})")
sys.exit(0 if 1 / bound <= per1 / formula <= bound else 1)
PY

# One process at SEQ under the CP ranks' limit fails; the CP ranks under it train.
printf -- "-- one process at %s positions, limited to %s MiB: " "$seq" "$limit_mib"
if prlimit --as=$((limit_mib * 1048576)) "$bin" "${model[@]}" --layers "$layers" --seq "$seq" >"$out/one-limited.log" 2>&1; then
  fail "one process trained $seq positions under the limit"
fi
ran_out_of_memory "$out/one-limited.log" || { tail -n 20 "$out/one-limited.log"; fail "one process failed, but not for memory"; }
echo "failed: $(grep -m1 -oE "memory allocation of [0-9]+ bytes failed|[^:]*out of memory[^.]*|Cannot allocate memory" "$out/one-limited.log")"
printf -- "-- ring, %s ranks at %s positions, each limited to %s MiB: " "$cp" "$seq" "$limit_mib"
mpi "$cp" prlimit --as=$((limit_mib * 1048576)) "$bin" "${model[@]}" --layers "$layers" --seq "$seq" --cp-size "$cp" --cp-mode ring \
  >"$out/ring-limited.log" 2>&1 || { tail -n 20 "$out/ring-limited.log"; fail "the ring did not train under the limit"; }
grep -q "final_loss=" "$out/ring-limited.log" || fail "the ring did not finish its $steps steps"
echo "trained, $(grep -m1 -oE 'final_loss=[0-9.]+' "$out/ring-limited.log")"
echo "== every check held"
