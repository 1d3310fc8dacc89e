#!/usr/bin/env bash
# The demonstration that context parallelism's ring trains sequences longer than one process can: at a length SEQ
# each of CP MPI ranks (ring attention, head-tail balanced) is limited (`prlimit --as`, address space) to just above
# what it needs; one process at SEQ fails there, the CP ranks train it. The activation part of each rank's step
# peak is checked against its formula, fitted from one process at shorter lengths: there a step allocates
# `g + a·s + b·s²` above what it holds at rest (`g` the gradients of what does not depend on the length, `a·s` what
# each position keeps, of which the position embedding's gradient, `4·d_model·s`, whole on every rank; `b·s²` the
# attention's scores). A ring rank at SEQ should need `g + (a − 4·d_model)·SEQ/CP + 4·d_model·SEQ + b·c²`, one
# chunk's scores (`c = SEQ / (2·CP)`) in place of the whole sequence's: its measured step peak within BOUND × of
# that. Each of these is checked: the script exits non-zero, saying which, when one does not hold.
#
#   cargo build --release --features mpi --example transformer_lm
#   scripts/long-context-demo.sh                   # 4096 positions over 4 ranks
#   SEQ=2048 scripts/long-context-demo.sh          # smaller
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
model=(--layers "$layers" --d-model "$d_model" --heads "$heads" --batch 1 --sgd --lr 0.01 --steps "$steps" --skip-state-bytes)
export OMPI_MCA_rmaps_base_oversubscribe=1
fail() { echo "FAILED: $*" >&2; exit 1; }
mpi() { local np=$1; shift; mpirun --allow-run-as-root --oversubscribe -np "$np" "$@"; }
field() { grep -oE "$1=[0-9]+" "$2" | cut -d= -f2 | sort -n | tail -1; }
ran_out_of_memory() { grep -qE "memory allocation of [0-9]+ bytes failed|out of memory|ran out of memory|Cannot allocate memory|MPI_ERR_NO_MEM" "$1"; }

# One process at SEQ/8, SEQ/4 and SEQ/2, without a limit: its step peak at each length, and the fit through them.
for div in 8 4 2; do
  "$bin" "${model[@]}" --seq $((seq / div)) >"$out/one-$div.log" 2>&1 \
    || { tail -n 20 "$out/one-$div.log"; fail "one process at $((seq / div)) positions failed"; }
done
fit=$(python3 - "$seq" "$(field step_peak_bytes "$out/one-8.log")" "$(field step_peak_bytes "$out/one-4.log")" \
  "$(field step_peak_bytes "$out/one-2.log")" <<'PY'
import sys
L, p8, p4, p2 = int(sys.argv[1]), *map(float, sys.argv[2:5])
s8, s4, s2 = L / 8, L / 4, L / 2
# p = g + a s + b s², through three points.
b = ((p2 - p4) / (s2 - s4) - (p4 - p8) / (s4 - s8)) / (s2 - s8)
a = (p4 - p8) / (s4 - s8) - b * (s4 + s8)
g = p8 - a * s8 - b * s8 * s8
print(f"{g:.0f} {a:.3f} {b:.6f}")
PY
)
read -r g a b <<<"$fit"
echo "== one process: step peak = $g + $a·s + $b·s² bytes (fitted at $((seq / 8)), $((seq / 4)), $((seq / 2)) positions)"

# The ring over CP ranks at SEQ, without a limit: what each rank needs.
mpi "$cp" "$bin" "${model[@]}" --seq "$seq" --cp-size "$cp" --cp-mode ring >"$out/ring.log" 2>&1 \
  || { tail -n 20 "$out/ring.log"; fail "the unlimited ring run failed"; }
limit_mib=$(($(field peak_vm "$out/ring.log") / 1048576 + slack))
ring_peak=$(field step_peak_bytes "$out/ring.log")
python3 - "$seq" "$cp" "$d_model" "$g" "$a" "$b" "$ring_peak" "$bound" <<'PY' || fail "the ring's step peak is not within its formula"
import sys
L, cp, d = map(int, sys.argv[1:4])
g, a, b, measured, bound = map(float, sys.argv[4:9])
chunk = L / (2 * cp)
formula = g + (a - 4 * d) * L / cp + 4 * d * L + b * chunk * chunk
one = g + a * L + b * L * L
ratio = measured / formula
print(f"-- ring, {cp} ranks at {L} positions: step peak {measured / 2**20:.1f} MiB a rank at most; formula "
      f"{formula / 2**20:.1f} MiB (ratio {ratio:.3f}); one process would need {one / 2**20:.1f} MiB")
sys.exit(0 if 1 / bound <= ratio <= bound else 1)
PY

# One process at SEQ under the CP ranks' limit fails; the CP ranks under it train.
printf -- "-- one process at %s positions, limited to %s MiB: " "$seq" "$limit_mib"
if prlimit --as=$((limit_mib * 1048576)) "$bin" "${model[@]}" --seq "$seq" >"$out/one-limited.log" 2>&1; then
  fail "one process trained $seq positions under the limit"
fi
ran_out_of_memory "$out/one-limited.log" || { tail -n 20 "$out/one-limited.log"; fail "one process failed, but not for memory"; }
echo "failed: $(grep -m1 -oE "memory allocation of [0-9]+ bytes failed|[^:]*out of memory[^.]*|Cannot allocate memory" "$out/one-limited.log")"
printf -- "-- ring, %s ranks at %s positions, each limited to %s MiB: " "$cp" "$seq" "$limit_mib"
mpi "$cp" prlimit --as=$((limit_mib * 1048576)) "$bin" "${model[@]}" --seq "$seq" --cp-size "$cp" --cp-mode ring \
  >"$out/ring-limited.log" 2>&1 || { tail -n 20 "$out/ring-limited.log"; fail "the ring did not train under the limit"; }
grep -q "final_loss=" "$out/ring-limited.log" || fail "the ring did not finish its $steps steps"
echo "trained, $(grep -m1 -oE 'final_loss=[0-9.]+' "$out/ring-limited.log")"
echo "== every check held"
