#!/usr/bin/env python3
"""Checks runs of the sharded_training example on in-process ranks sharing one device (a GPU, or wgpu on Vulkan's
software driver): the first run through host memory (`ACCELERATE_GRADIENT_TRANSPORT=host`), every later one
through the shared device path. Runs are separated by lines `---`.

Each later run's ranks must name the shared device path (`strategy="... device exchange ..."`) and pass 0 values
through host memory in their steps (`host_values=0`), the host run more than 0; every final loss must be within
BOUND (relative, default 1e-5) of the host run's. Prints the figures as `key=value;` pairs (the GPU kit's
figures); exits 1 when a check fails, saying which.

Usage: scripts/gpu/check-shared-device.py LOG [BOUND]

On a GPU with Burn's autotuning each run (a process) may pick other kernels, whose rounding differs: the kit passes
1e-3 there. Without autotuning (wgpu-bare on CI) and on Flex the paths agree to the bit.
"""

import re
import sys


def main() -> int:
    bound = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-5
    runs = [r for r in open(sys.argv[1]).read().split("---\n") if r.strip()]
    losses = [re.search(r"^final_loss=(\S+)", r, re.M) for r in runs]
    names = [re.findall(r'strategy="([^"]*)"', r) for r in runs]
    values = [[int(v) for v in re.findall(r"host_values=(\d+)", r)] for r in runs]
    problems = []
    if len(runs) < 2:
        problems.append(f"{len(runs)} run(s), expected the host run and at least one more")
    missing = [i for i, loss in enumerate(losses) if loss is None]
    if missing:
        problems.append(f"runs {missing} printed no final_loss")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    losses = [float(loss.group(1)) for loss in losses]
    host = losses[0]
    worst = max(abs(loss - host) / max(abs(host), 1e-12) for loss in losses[1:])
    device_values = sum(sum(v) for v in values[1:])
    host_values = sum(values[0])
    print(
        f"host_final_loss={host};max_rel_diff={worst:.2e};runs={len(runs)};"
        f"host_values_host_run={host_values};host_values_device_runs={device_values}",
        end="",
    )
    if not names[0] or any("host" not in n for n in names[0]):
        problems.append(f"the first run is not through host memory: {names[0]}")
    for i, run_names in enumerate(names[1:], start=1):
        if not run_names or any("device exchange" not in n for n in run_names):
            problems.append(f"run {i} is not on the shared device path: {run_names}")
    if any(len(v) != len(n) for v, n in zip(values, names)):
        problems.append("a rank printed no host_values")
    if device_values != 0:
        problems.append(f"the device runs passed {device_values} values through host memory")
    if host_values == 0:
        problems.append("the host run passed no value through host memory (the count is not counting)")
    if worst > bound:
        problems.append(f"a final loss differs from the host run's by {worst:.2e} (relative; bound {bound:g})")
    for problem in problems:
        print(f"\nshared device: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
