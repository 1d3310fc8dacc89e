#!/usr/bin/env bash
# Runs every GPU check of the packed kit (scripts/gpu/pack.sh) in one call, and writes a report.
#
#   scripts/gpu/run.sh [KIT_DIR]        # default target/gpu-kit; the report goes to $OUT (default target/gpu-report)
#
# KIT_STEPS (names separated by spaces) runs only those steps, for a short rerun of new checks.
# KIT_OPTIONAL (names) lists steps the verdict may do without on a GPU machine that lacks their tool (e.g.
# quicktour-vulkan where the image has no Vulkan driver); otherwise such a skip fails the verdict.
#
# Every step runs under its own timeout (a hang costs one step, not the call), and the whole run keeps to
# RUN_BUDGET_S seconds (default 360; with the unpack, under 7 minutes): steps that no longer fit are reported as
# not run. Steps come in order of what they teach. The report ($OUT/gpu-report.md and $OUT/gpu-report.json,
# rewritten after every step, so a run cut short still leaves one) has each step's result, its figures and, on
# failure, its log tail; all logs go to $OUT/gpu-logs.tar.gz.
#
# Without a GPU (no NVIDIA driver) every GPU step reports "no GPU: <reason>" and the CPU-side steps still run:
# that is the rehearsal this project's CI runs.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$(cd "${1:-$root/target/gpu-kit}" 2>/dev/null && pwd)" || { echo "run: no kit at ${1:-target/gpu-kit}: run scripts/gpu/pack.sh" >&2; exit 2; }
out="${OUT:-$root/target/gpu-report}"
budget="${RUN_BUDGET_S:-360}"
work="${KIT_WORK:-/tmp/burn-accelerate-gpu-kit}"
mkdir -p "$out" "$work/bin" "$work/lib" "$work/logs"
start=$(date +%s)
results="$work/results.jsonl"
: >"$results"
python="$(command -v python3 || command -v python || true)"

say() { printf 'run: %s\n' "$*" >&2; }
elapsed() { echo $(($(date +%s) - start)); }

# One result line: step, status (pass, fail, skip, or figure: a measurement with no threshold, neither a pass nor a
# failure), seconds, figures (key=value;...), detail, log file. The step's kind (cpu, gpu, vulkan, multi-gpu: needs
# more GPUs than one machine of the kind lent, derived) is $kind_now.
kind_now=cpu
record() {
  "$python" - "$results" "$kind_now" "$@" <<'PY'
import json, sys
path, kind, step, status, seconds, figures, detail, log = sys.argv[1:9]
tail = ""
if status == "fail" and log:
    try:
        tail = "".join(open(log, errors="replace").readlines()[-40:])
    except OSError:
        pass
figs = dict(f.split("=", 1) for f in figures.split(";") if "=" in f)
with open(path, "a") as f:
    f.write(json.dumps({"step": step, "kind": kind, "status": status, "seconds": int(seconds), "figures": figs,
                        "detail": detail, "log_tail": tail}) + "\n")
PY
  report
}

report() {
  KIT_SCRIPTS="$root/scripts/gpu" "$python" - "$results" "$out" "$gpu_note" "$(elapsed)" "$kit/MANIFEST" <<'PY'
import json, os, sys
results, out, gpu, seconds, manifest = sys.argv[1:6]
steps = [json.loads(l) for l in open(results) if l.strip()]
try:
    manifest = open(manifest).read().strip()
except OSError:
    manifest = "(no MANIFEST)"
counts = {s: sum(1 for x in steps if x["status"] == s) for s in ("pass", "fail", "skip", "figure")}
# On a machine with a GPU, a GPU step that did not run (the budget spent, a check skipped) is not a pass, nor is a
# step skipped for a tool the machine lacks (a Vulkan driver), unless KIT_OPTIONAL names it (kit_checks.verdict).
on_gpu = not gpu.startswith("none")
sys.path.insert(0, os.environ["KIT_SCRIPTS"])
from kit_checks import verdict as judge
verdict, unrun = judge(steps, on_gpu, set(os.environ.get("KIT_OPTIONAL", "").split()))
json.dump({"gpu": gpu, "seconds": int(seconds), "counts": counts, "unrun_gpu_steps": unrun, "verdict": verdict,
           "manifest": manifest, "steps": steps}, open(f"{out}/gpu-report.json", "w"), indent=2)
lines = ["# GPU kit report", "", f"- GPU: {gpu}", f"- wall time: {seconds} s",
         f"- steps: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped, "
         f"{counts['figure']} measured (no threshold)",
         f"- verdict: {verdict}" + (f" (steps that did not run on this GPU machine: {', '.join(unrun)}; KIT_OPTIONAL "
                                    "lists steps the verdict may do without)" if unrun else ""),
         "",
         "| step | kind | result | s | figures | detail |", "|---|---|---|---|---|---|"]
for s in steps:
    figs = ", ".join(f"{k}={v}" for k, v in s["figures"].items())
    lines.append(f"| {s['step']} | {s['kind']} | {s['status']} | {s['seconds']} | {figs} | {s['detail']} |")
for s in steps:
    if s["log_tail"]:
        lines += ["", f"## {s['step']}: log tail", "", "```", s["log_tail"].rstrip(), "```"]
lines += ["", "## Kit", "", "```", manifest, "```", ""]
open(f"{out}/gpu-report.md", "w").write("\n".join(lines))
PY
}

# Figures from a log: the values of `key=` lines (the last of each), for the keys asked.
figures() {
  local log=$1; shift
  local key value acc=""
  for key in "$@"; do
    value=$(grep -oE "(^|[ ])$key=[^ ]+" "$log" 2>/dev/null | tail -n1 | sed -E "s/^ ?$key=//")
    [ -n "$value" ] && acc="$acc$key=$value;"
  done
  printf '%s' "$acc"
}

# run_step NAME KIND TIMEOUT CHECK COMMAND...: KIND gpu steps are skipped without a GPU (or Vulkan, for vulkan);
# CHECK is a shell function that gets the log and the exit code, prints figures and returns 0 when the step
# passed; $detail may be set by it.
run_step() {
  local name=$1 kind=$2 limit=$3 check=$4; shift 4
  local log="$work/logs/$name.log" rc t0 figs
  kind_now=$kind
  if { [ "$kind" = gpu ] || [ "$kind" = vulkan ]; } && [ -n "$no_gpu" ]; then
    record "$name" skip 0 "" "no GPU: $no_gpu" ""
    return
  fi
  if [ "$kind" = vulkan ] && [ -n "$no_vulkan" ]; then
    record "$name" skip 0 "" "no Vulkan: $no_vulkan" ""
    return
  fi
  if [ -n "${KIT_STEPS:-}" ] && ! printf '%s\n' $KIT_STEPS | grep -qx "$name"; then
    record "$name" skip 0 "" "not asked for (KIT_STEPS)" ""
    return
  fi
  local left=$((budget - $(elapsed)))
  if [ "$left" -lt 15 ]; then
    record "$name" skip 0 "" "not run: the run's budget of ${budget}s is spent" ""
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "$name (at most ${limit}s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  detail=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    figs=""
    detail="timed out after ${limit}s"
    record "$name" fail $(($(date +%s) - t0)) "" "$detail" "$log"
    return
  fi
  # Not in a subshell: the check may set $detail.
  if "$check" "$log" "$rc" >"$work/figures"; then
    figs=$(cat "$work/figures")
    record "$name" pass $(($(date +%s) - t0)) "$figs" "$detail" "$log"
  else
    figs=$(cat "$work/figures")
    [ -n "$detail" ] || detail="exit code $rc"
    record "$name" fail $(($(date +%s) - t0)) "$figs" "$detail" "$log"
  fi
}

# ---------------------------------------------------------------------------------------------------------------
# Unpack, and find what the image has where it keeps it.
[ -n "$python" ] || { echo "run: python3 is needed for the report" >&2; exit 2; }
gpu_note="probing"
no_gpu=""
no_vulkan=""
bin="$work/bin/burn-accelerate-gpu-kit"
unpack() {
  if command -v xz >/dev/null 2>&1; then
    xz -dc "$kit/burn-accelerate-gpu-kit.xz" >"$bin"
  else
    "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$kit/burn-accelerate-gpu-kit.xz" "$bin"
  fi
  chmod +x "$bin"
  for program in burn-accelerate quicktour memory data_parallel sharded_training learner transformer_lm overhead throughput; do
    ln -sf "$bin" "$work/bin/$program"
  done
  cp "$kit"/lib/* "$work/lib/"
  "$work/bin/burn-accelerate" --version
}
check_unpack() { grep -q '^burn-accelerate ' "$1" && [ "$2" -eq 0 ]; }
t0=$(date +%s)
if unpack >"$work/logs/unpack.log" 2>&1 && check_unpack "$work/logs/unpack.log" 0; then
  unpack_status=pass
else
  unpack_status=fail
fi
export PATH="$work/bin:$PATH"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg-runtime-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

# The GPU: the driver answers nvidia-smi.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  no_gpu="nvidia-smi not found (no NVIDIA driver on this machine)"
elif ! nvidia-smi -L >"$work/logs/nvidia-smi.log" 2>&1; then
  no_gpu="nvidia-smi failed: $(head -n1 "$work/logs/nvidia-smi.log")"
fi
if [ -z "$no_gpu" ]; then
  gpu_note="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n1)"
else
  gpu_note="none ($no_gpu)"
fi

# The first file under Python's site-packages (where PyPI's nvidia-* wheels put CUDA's libraries: nvidia/<name>/
# for CUDA 12, nvidia/cu13/ for CUDA 13) whose path ends with $1.
in_site_packages() {
  "$python" - "$1" <<'PY' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", sys.argv[1]), recursive=True))
    if hits:
        print(hits[0])
        break
PY
}

# libdevice (Burn's CUDA compiler links it for math functions): CUDA_PATH, the usual toolkit folders, PyPI's.
find_cuda_root() {
  local c
  for c in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12* /opt/cuda \
    /usr/lib/nvidia-cuda-toolkit; do
    [ -n "$c" ] && [ -f "$c/nvvm/libdevice/libdevice.10.bc" ] && { echo "$c"; return; }
  done
  c=$(in_site_packages 'nvvm/libdevice/libdevice.10.bc')
  [ -n "$c" ] && { dirname "$(dirname "$(dirname "$c")")"; return; }
  [ -n "$no_gpu" ] && return
  c=$(timeout 20 find / -xdev -name libdevice.10.bc -path '*nvvm/libdevice*' 2>/dev/null | head -n1)
  [ -n "$c" ] && dirname "$(dirname "$(dirname "$c")")"
}
cuda_root="$(find_cuda_root)"
[ -n "$cuda_root" ] && export CUDA_PATH="$cuda_root"

# NCCL: cudarc opens libnccl.so; PyPI's wheel ships only libnccl.so.2, so a link goes into the kit's lib folder.
find_nccl() {
  local c
  c=$(in_site_packages 'lib/libnccl.so.2')
  [ -n "$c" ] && { echo "$c"; return; }
  c=$(ldconfig -p 2>/dev/null | grep -oE '/[^ ]*libnccl\.so\.2$' | head -n1)
  [ -n "$c" ] && { echo "$c"; return; }
  [ -n "$no_gpu" ] && return
  timeout 20 find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -n1
}
nccl="$(find_nccl)"
[ -n "$nccl" ] && ln -sf "$nccl" "$work/lib/libnccl.so"

# Vulkan: the kit's loader, and the NVIDIA driver's ICD (written here when the image has the driver's Vulkan
# library but no ICD file).
icd=""
for c in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd*.json /usr/share/vulkan/icd.d/nvidia_icd*.json \
  /etc/vulkan/icd.d/nvidia_icd*.json; do
  [ -f "$c" ] && { icd="$c"; break; }
done
if [ -z "$icd" ]; then
  glx=$(ldconfig -p 2>/dev/null | grep -oE '/[^ ]*libGLX_nvidia\.so\.0$' | head -n1)
  [ -z "$glx" ] && [ -z "$no_gpu" ] && glx=$(timeout 20 find / -xdev -name 'libGLX_nvidia.so.0' 2>/dev/null | head -n1)
  if [ -n "$glx" ]; then
    mkdir -p "$work/icd"
    icd="$work/icd/nvidia_icd.json"
    printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" >"$icd"
  fi
fi
if [ -n "$no_gpu" ]; then
  no_vulkan="$no_gpu"
elif [ -z "$icd" ]; then
  no_vulkan="the NVIDIA driver's Vulkan library (libGLX_nvidia.so.0) and ICD file are not in this image"
else
  export VK_ICD_FILENAMES="$icd" VK_DRIVER_FILES="$icd"
fi
export LD_LIBRARY_PATH="$work/lib${nccl:+:$(dirname "$nccl")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

record unpack "$unpack_status" $(($(date +%s) - t0)) \
  "cuda_path=${cuda_root:-none};nccl=${nccl:-none};vulkan_icd=${icd:-none}" \
  "GPU: $gpu_note" "$work/logs/unpack.log"
[ "$unpack_status" = pass ] || { say "the kit did not unpack: see $out/gpu-report.md"; exit 1; }

# ---------------------------------------------------------------------------------------------------------------
# Checks: each prints the step's figures and returns whether it passed.
ok_exit() { [ "$2" -eq 0 ]; }
check_env() {
  detail=$(grep -E '^- (cuda runtime|Gradient transport)' "$1" | tr '\n' ' ' | tr ';|' ',/')
  [ "$2" -eq 0 ] && grep -q '^- Gradient transport:' "$1"
}
check_test() {
  local gpu_lines
  gpu_lines=$(grep -E '^GPU' "$1" | tr '\n' ' ' | tr ';|' ',/')
  detail="$gpu_lines"
  [ "$2" -eq 0 ] && grep -qx 'Test is a success! You are ready for your distributed training!' "$1"
}
# On the GPU, one rank: the one-rank NCCL communicator must have been checked against the f64 reference, every
# call of it (the collectives, a message to itself in one group call, a split communicator), each sharded strategy
# trained through it against the GPU alone, and a half-precision step against f32; a run that checked neither
# (NCCL not found, the GPU checks skipped) checked nothing on the GPU.
check_test_cuda() {
  check_test "$1" "$2" || return 1
  if ! grep -q 'max |device - f64 reference|' "$1"; then
    detail="NCCL was not checked (no one-rank NCCL communicator ran): $detail"
    return 1
  fi
  local call
  for call in 'reduce-scatter (mean)' 'all-gather' 'broadcast' 'reduce (sum)' 'send/recv' \
    'split sub-group all-reduce (sum)'; do
    if ! grep -qF "$call max |device - f64 reference|" "$1"; then
      detail="NCCL's $call was not checked: $detail"
      return 1
    fi
  done
  for call in 'SHARD_GRAD_OP training' 'FULL_SHARD training' 'HYBRID_SHARD training'; do
    if ! grep -qF "$call: max |weights - the device alone's|" "$1"; then
      detail="$call through NCCL was not checked: $detail"
      return 1
    fi
  done
  if ! grep -qE '^GPU: (BF16|F16) step within' "$1"; then
    detail="no half-precision step was checked: $detail"
    return 1
  fi
}
# In-process ranks sharing the GPU: the shared device path (every rank's tensors handed over on the device) must
# have been checked against the f64 reference.
check_test_shared() {
  check_test "$1" "$2" || return 1
  if ! grep -q 'device exchange.*max |device - f64 reference|' "$1"; then
    detail="the shared device path was not checked: $detail"
    return 1
  fi
  # Every strategy trained over a communicator that refuses every buffer through host memory.
  local missing
  if ! missing=$("$root/scripts/gpu/check-no-host-buffers.sh" "$1" 2>&1 >/dev/null); then
    detail="$missing: $detail"
    return 1
  fi
}
check_loss() {
  local f
  f=$(figures "$1" initial_loss final_loss)
  printf '%s' "$f"
  [ "$2" -eq 0 ] && "$python" - "$1" <<'PY'
import math, sys
values = dict(l.strip().split("=", 1) for l in open(sys.argv[1]) if l.startswith(("initial_loss=", "final_loss=")))
final = float(values["final_loss"])
sys.exit(0 if math.isfinite(final) and ("initial_loss" not in values or final < float(values["initial_loss"])) else 1)
PY
}
# A GPU backend draws other initial weights than Flex (Burn's random generators differ by backend), so an f32 run
# on it is compared with the CPU's by how far training brought the loss down: final / initial within $3
# (relative) of the CPU's. Half-precision runs on the same GPU start from the same weights as its f32 run: their
# initial loss must equal it, and the final one be within $3 (relative) of it.
reference_loss=""
reference_initial=""
near() {
  local log=$1 rc=$2 bound=$3 against=$4 final initial ref ref_initial
  check_loss "$log" "$rc" || return 1
  final=$(figures "$log" final_loss | sed -E 's/final_loss=([^;]*);/\1/')
  initial=$(figures "$log" initial_loss | sed -E 's/initial_loss=([^;]*);/\1/')
  if [ "$against" = cpu ]; then
    ref=$reference_loss ref_initial=$reference_initial
  else
    ref=$(figures "$work/logs/$against.log" final_loss | sed -E 's/final_loss=([^;]*);/\1/')
    ref_initial=$(figures "$work/logs/$against.log" initial_loss | sed -E 's/initial_loss=([^;]*);/\1/')
  fi
  [ -n "$ref" ] && [ -n "$ref_initial" ] || { detail="no reference loss from $against"; return 1; }
  "$python" - "$initial" "$final" "$ref_initial" "$ref" "$bound" "$against" <<'PY' >&2
import sys
initial, final, ref_initial, ref, bound = map(float, sys.argv[1:6])
against = sys.argv[6]
if against == "cpu":
    rel = abs(final / initial - ref / ref_initial) / (ref / ref_initial)
    print(f"final/initial loss {final / initial:.5f} against the CPU's {ref / ref_initial:.5f}: relative "
          f"difference {rel:.4f} (bound {bound})")
    sys.exit(0 if rel <= bound else 1)
rel = abs(final - ref) / abs(ref)
print(f"initial loss {initial} against {against}'s {ref_initial}; final {final} against {ref}: relative "
      f"difference {rel:.4f} (bound {bound})")
sys.exit(0 if rel <= bound and initial == ref_initial else 1)
PY
  local status=$?
  printf 'reference_final_loss=%s;' "$ref"
  detail="vs $against final_loss=$ref (initial $ref_initial)"
  return $status
}
near_cpu_f32() { near "$1" "$2" 0.25 cpu; }
near_gpu_f32() { near "$1" "$2" 0.10 quicktour-cuda-f32; }
check_throughput() {
  figures "$1" accelerate_samples_per_s raw_burn_samples_per_s throughput_overhead_ratio final_loss params
  [ "$2" -eq 0 ] && grep -q '^accelerate_samples_per_s=' "$1"
}
check_torch() {
  figures "$1" torch_samples_per_s final_loss gpu
  if [ "$2" -eq 3 ]; then detail="PyTorch or Accelerate missing: $(tail -n1 "$1")"; return 1; fi
  [ "$2" -eq 0 ] && grep -q '^torch_samples_per_s=' "$1"
}
check_overhead() {
  figures "$1" overhead_ratio raw_step_us accelerated_step_us
  [ "$2" -eq 0 ] && grep -q '^overhead_ratio=' "$1"
}
check_oom() {
  local retries
  retries=$(grep -c 'ran out of memory' "$1")
  figures "$1" batch_size final_loss
  printf 'oom_retries=%s;' "$retries"
  local batch
  batch=$(figures "$1" batch_size | sed -E 's/batch_size=([^;]*);/\1/')
  [ "$2" -eq 0 ] && [ "$retries" -ge 1 ] && [ -n "$batch" ] && [ "$batch" -lt "$oom_start" ]
}
# Two runs' `final_loss`/`accuracy` lines (the command prints both runs, separated by ---) must agree within $3
# (relative) where the runs split the batch differently (other summation orders on a GPU); with no bound
# (check_same), the runs must end with the same weights bit for bit: their `weights_digest` lines present and equal
# (scripts/gpu/kit_checks.py, whose self-test CI runs).
check_close() {
  local out status
  out=$("$python" "$root/scripts/gpu/kit_checks.py" same "$1" "${3:-0}")
  status=$?
  printf '%s' "$(printf '%s\n' "$out" | sed -n 1p)"
  detail=$(printf '%s\n' "$out" | sed -n 2p)
  [ "$2" -eq 0 ] && [ "$status" -eq 0 ]
}
check_same() { check_close "$1" "$2" 0; }
check_near_1e3() { check_close "$1" "$2" 1e-3; }
# Every rank of the second run (after ---: in-process stages sharing the GPU) passed no value through host memory.
second_run_on_device() {
  local second nonzero
  second=$(sed -n '/^---$/,$p' "$1")
  nonzero=$(printf '%s\n' "$second" | grep -oE 'host_values=[0-9]+' | grep -vx 'host_values=0' | head -n1)
  if [ -n "$nonzero" ] || ! printf '%s\n' "$second" | grep -q 'host_values=0'; then
    detail="the stages passed values through host memory (${nonzero:-no rank reported host_values})"
    return 1
  fi
}
check_same_on_device() { check_same "$1" "$2" && second_run_on_device "$1"; }
check_near_1e3_on_device() { check_near_1e3 "$1" "$2" && second_run_on_device "$1"; }

# In-process ranks sharing the GPU: NO_SHARD through host memory first, then every strategy through the shared
# device path, checked by scripts/gpu/check-shared-device.py (no value through host memory, the host run's loss).
check_shared_device() {
  [ "$2" -eq 0 ] && "$python" "$root/scripts/gpu/check-shared-device.py" "$1" 1e-3
}

# ---------------------------------------------------------------------------------------------------------------
# Steps, in order of what they teach.
run_step env cpu 60 check_env burn-accelerate env
run_step test-cpu cpu 120 check_test env BURN_DEVICE=flex burn-accelerate test --num-processes 2
run_step quicktour-cpu cpu 120 check_loss env BURN_DEVICE=flex quicktour
reference_loss=$(figures "$work/logs/quicktour-cpu.log" final_loss | sed -E 's/final_loss=([^;]*);/\1/')
reference_initial=$(figures "$work/logs/quicktour-cpu.log" initial_loss | sed -E 's/initial_loss=([^;]*);/\1/')
run_step test-cuda gpu 180 check_test_cuda env BURN_DEVICE=cuda burn-accelerate test --num-processes 1
# NCCL's communicator lifecycle on one rank: a sub-group split from a fresh communicator (the parent polled until
# NCCL has written the child's handle, then the child), its all-reduce, both ended by finalize and destroy; and a
# batch of messages whose second call NCCL refuses: the communicator aborted with its buffers kept, then refused.
check_nccl() {
  detail=$(grep -E '^NCCL ' "$1" | head -n1 | tr ';|' ',/')
  [ "$2" -eq 0 ] && grep -qE "^NCCL $3: rank 0 passed" "$1" && ! grep -qE 'panicked|Segmentation fault' "$1"
}
check_nccl_split() { check_nccl "$1" "$2" split; }
check_nccl_failing_group() { check_nccl "$1" "$2" failing-group; }
run_step nccl-split-cuda gpu 90 check_nccl_split \
  env BURN_DEVICE=cuda burn-accelerate test --num-processes 1 --nccl-lifecycle split
run_step nccl-failing-group-cuda gpu 90 check_nccl_failing_group \
  env BURN_DEVICE=cuda burn-accelerate test --num-processes 1 --nccl-lifecycle failing-group
run_step test-cuda-shared gpu 210 check_test_shared env BURN_DEVICE=cuda burn-accelerate test --num-processes 2
# Every strategy on in-process ranks sharing the one GPU, no parameter or gradient through host memory.
run_step shared-device-cuda gpu 240 check_shared_device sh -c '
  export BURN_DEVICE=cuda
  ACCELERATE_GRADIENT_TRANSPORT=host sharded_training --processes 2 --sharding NO_SHARD || exit 1
  for s in NO_SHARD SHARD_GRAD_OP FULL_SHARD; do echo ---; sharded_training --processes 2 --sharding $s || exit 1; done
  for s in HYBRID_SHARD _HYBRID_SHARD_ZERO2; do
    echo ---; PARALLELISM_CONFIG_DP_SHARD_SIZE=2 sharded_training --processes 4 --sharding $s || exit 1
  done'
run_step quicktour-cuda-f32 gpu 120 near_cpu_f32 env BURN_DEVICE=cuda quicktour
run_step throughput-cuda-f32 gpu 120 check_throughput env BURN_DEVICE=cuda throughput
run_step torch-cuda-f32 gpu 120 check_torch "$python" "$root/scripts/gpu/torch_throughput.py" --precision no
run_step throughput-cuda-bf16 gpu 120 check_throughput env BURN_DEVICE=cuda ACCELERATE_MIXED_PRECISION=bf16 throughput
run_step torch-cuda-bf16 gpu 120 check_torch "$python" "$root/scripts/gpu/torch_throughput.py" --precision bf16
# On an H100 the quicktour MLP's batch is bounded by a kernel launch before memory: cubecl's naive matmul takes
# at most 65535 cubes of 32 rows (2,097,120 rows), and from 2^28 rows the search took over 40 retries of 10%
# each. From 2^21 rows the first try should fail at the launch and a retry fit (not yet run on a GPU).
oom_start=2097152
run_step oom-cuda gpu 150 check_oom env BURN_DEVICE=cuda memory --start "$oom_start" --steps 3
run_step ranks-cuda gpu 180 check_near_1e3 sh -c \
  'BURN_DEVICE=cuda data_parallel --processes 1 --epochs 1 && echo --- && BURN_DEVICE=cuda data_parallel --processes 2 --epochs 1'
run_step shard-grad-op-cuda gpu 180 check_same sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 2 --sharding NO_SHARD && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --sharding SHARD_GRAD_OP'
run_step quicktour-cuda-bf16 gpu 120 near_gpu_f32 env BURN_DEVICE=cuda quicktour --mixed-precision bf16
run_step quicktour-cuda-fp16 gpu 120 near_gpu_f32 env BURN_DEVICE=cuda quicktour --mixed-precision fp16
run_step quicktour-vulkan vulkan 150 near_cpu_f32 env BURN_DEVICE=vulkan quicktour
run_step overhead-cuda gpu 150 check_overhead env BURN_DEVICE=cuda OVERHEAD_ROUNDS=21 overhead
# FULL_SHARD: parameters gathered through the tensor interface before every forward pass (bucketed parts
# concatenated, sliced and cast on the device), dropped after the step. Last of the single-GPU steps, so that it
# never takes the budget of the older ones.
run_step full-shard-cuda gpu 180 check_same sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 2 --sharding NO_SHARD && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --sharding FULL_SHARD'
# Block-wise FULL_SHARD with even dim-0 slices: each layer gathered on the device as the layer before it computes
# (prefetch), its gradients reduce-scattered while the next one computes; the weights of NO_SHARD's block-wise pass.
run_step blockwise-cuda gpu 180 check_same sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 2 --sharding NO_SHARD --blocks && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --sharding FULL_SHARD --blocks'
# FSDP2's mixed-precision policy on the device: block-wise FULL_SHARD in bf16, each layer gathered in bf16
# (fsdp_param_dtype) against gathered in f32 and cast by autocast: the same loss.
run_step blockwise-bf16-cuda gpu 180 check_same sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 2 --sharding FULL_SHARD --blocks --bf16 && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --sharding FULL_SHARD --blocks --bf16 --param-dtype bf16'
# Pipeline parallelism: the layers cut into two in-process stages on one GPU, activations and their gradients
# handed over on the device (the shared device path, not host memory): one micro-batch gives one process's loss
# bit for bit, four give it within float rounding (the micro-batches' gradients summed in another order).
run_step pipeline-cuda gpu 180 check_same_on_device sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 1 --blocks && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --blocks --pp-size 2 --pp-microbatches 1'
run_step pipeline-4mb-cuda gpu 180 check_near_1e3_on_device sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 1 --blocks && echo --- && BURN_DEVICE=cuda sharded_training --processes 2 --blocks --pp-size 2 --pp-microbatches 4'
# Activation checkpointing in the stages on the device: each block recomputed in the backward pass gives the
# loss of the stages keeping their activations, bit for bit (the kit runs without autotuning: the same kernels).
run_step pipeline-ckpt-cuda gpu 180 check_same_on_device sh -c \
  'BURN_DEVICE=cuda sharded_training --processes 2 --blocks --pp-size 2 --pp-microbatches 4 && echo --- && BURN_DEVICE=cuda FSDP_ACTIVATION_CHECKPOINTING=true sharded_training --processes 2 --blocks --pp-size 2 --pp-microbatches 4'
# burn-train's Learner through the Accelerator on the device: one rank, then two in-process ranks under
# block-wise FULL_SHARD with activation checkpointing (each block gathered inside the TrainStep, its gradients
# reduce-scattered, validation on the gathered model): the held-out loss within float rounding.
run_step learner-blockwise-cuda gpu 180 check_near_1e3 sh -c \
  'BURN_DEVICE=cuda learner --processes 1 && echo --- && BURN_DEVICE=cuda learner --processes 2 --sharding FULL_SHARD --block-wise --activation-checkpointing'
# Tensor parallelism on two in-process ranks sharing the GPU: every layer split the Megatron way, the token
# embedding by vocabulary and the head by columns, each region's all-reduce and the head's all-gather handed over
# on the device (no value through host memory); one process's loss within float rounding.
run_step tp2-shared-cuda gpu 180 check_near_1e3_on_device sh -c \
  'BURN_DEVICE=cuda transformer_lm --processes 1 --steps 10 && echo --- && BURN_DEVICE=cuda transformer_lm --processes 2 --tp-size 2 --steps 10'
# Sequence and loss parallelism on the same two ranks: the activations between the regions split along the
# sequence (all-gathered into each region, reduce-scattered out of its row-parallel layers, on the device), the
# head's logits never gathered (the loss's maxima, sums and target logits all-reduced); one process's loss within
# float rounding, no value through host memory.
run_step tp2-sp-shared-cuda gpu 180 check_near_1e3_on_device sh -c \
  'BURN_DEVICE=cuda transformer_lm --processes 1 --steps 10 --loss-parallel && echo --- && BURN_DEVICE=cuda transformer_lm --processes 2 --tp-size 2 --sequence-parallel --loss-parallel --steps 10'
# FSDP2 + TP in a pipeline on eight in-process ranks sharing the GPU (pp 2 × dp_shard 2 × tp 2, torchtitan's 3-D
# mesh): each stage's layers split over its tensor-parallel ranks and sharded over its data-parallel ones, the
# activations sent between the stages, the regions' collectives and the blocks' gathers all on the device (no value
# through host memory); one process's loss within float rounding.
run_step pp2-tp2-fsdp2-shared-cuda gpu 240 check_near_1e3_on_device sh -c \
  'BURN_DEVICE=cuda transformer_lm --processes 1 --steps 10 && echo --- && BURN_DEVICE=cuda transformer_lm --processes 8 --pp-size 2 --tp-size 2 --sharding FULL_SHARD --sequence-parallel --steps 10'
# Context parallelism on two in-process ranks sharing the GPU: each sequence cut head-tail over the two, the ring's
# key/value blocks and their gradients passed between them on the device, the gradients reduced over both (no value
# through host memory); one process's loss within float rounding.
run_step cp2-ring-shared-cuda gpu 180 check_near_1e3_on_device sh -c \
  'BURN_DEVICE=cuda transformer_lm --processes 1 --steps 10 && echo --- && BURN_DEVICE=cuda transformer_lm --processes 2 --cp-size 2 --cp-mode ring --steps 10'
# NCCL between processes needs a launcher: the kit carries no MPI (the GPU image has none, and the binary would
# need its libraries), so the one-rank NCCL communicator of test-cuda is what runs NCCL here.
kind_now=multi-gpu
if [ -n "$no_gpu" ]; then
  record nccl-2-processes skip 0 "" "no GPU: $no_gpu" ""
elif [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
  record nccl-2-processes skip 0 "" \
    "not run: NCCL needs a GPU per process (it refuses two ranks on one device) and this machine has one; test-cuda ran a one-rank NCCL communicator" ""
else
  record nccl-2-processes skip 0 "" \
    "not run: two processes need mpirun, which neither the kit nor the GPU image has; test-cuda ran a one-rank NCCL communicator" ""
fi

kind_now=derived
# Derived figures: burn-accelerate's samples/s over PyTorch + Accelerate's on the same GPU.
ratios=$("$python" - "$results" <<'PY'
import json, sys
steps = {s["step"]: s for s in map(json.loads, open(sys.argv[1]))}
for p in ("f32", "bf16"):
    ours = steps.get(f"throughput-cuda-{p}", {}).get("figures", {}).get("accelerate_samples_per_s")
    torch = steps.get(f"torch-cuda-{p}", {}).get("figures", {}).get("torch_samples_per_s")
    if ours and torch:
        print(f"vs_torch_{p}={float(ours) / float(torch):.3f};", end="")
PY
)
if [ -n "$ratios" ]; then
  record vs-torch figure 0 "$ratios" \
    "a measurement, not a check (no threshold): burn-accelerate samples/s over PyTorch + Accelerate's, same model and GPU" ""
else
  record vs-torch skip 0 "" "needs both throughput runs (burn-accelerate and PyTorch)" ""
fi
tar -czf "$out/gpu-logs.tar.gz" -C "$work" logs 2>/dev/null
report
say "report: $out/gpu-report.md ($(elapsed)s)"
cat "$out/gpu-report.md"
# The verdict: a failed step, or on a GPU a GPU step that did not run.
grep -q '"verdict": "pass"' "$out/gpu-report.json" || exit 1
exit 0
