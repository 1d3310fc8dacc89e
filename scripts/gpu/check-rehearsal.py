#!/usr/bin/env python3
"""Checks a GPU kit report from a machine without a GPU (the rehearsal): every CPU-side step passed, every GPU
step was skipped saying "no GPU: <reason>", none failed, and the whole run took
less than two minutes.

Usage: scripts/gpu/check-rehearsal.py target/gpu-report/gpu-report.json
"""

import json
import sys

CPU_STEPS = {"unpack", "env", "test-cpu", "quicktour-cpu"}


def main() -> int:
    report = json.load(open(sys.argv[1]))
    problems = []
    names = {s["step"] for s in report["steps"]}
    for missing in sorted(CPU_STEPS - names):
        problems.append(f"the CPU step {missing} did not run")
    for step in report["steps"]:
        name, kind, status, detail = step["step"], step["kind"], step["status"], step["detail"]
        if kind == "cpu" and status != "pass":
            problems.append(f"{name}: {status} ({detail}) {step['log_tail'][-400:]}")
        if kind in ("gpu", "vulkan", "multi-gpu"):
            if status != "skip" or not detail.startswith("no GPU: "):
                problems.append(f"{name}: expected 'no GPU: <reason>', got {status}: {detail}")
        if status == "fail":
            problems.append(f"{name} failed: {detail}")
    if report["seconds"] >= 120:
        problems.append(f"the rehearsal took {report['seconds']} s (at most 120)")
    gpu_steps = sum(1 for s in report["steps"] if s["kind"] in ("gpu", "vulkan", "multi-gpu"))
    if report.get("verdict") != "pass":
        problems.append(f"the report's verdict is {report.get('verdict')}")
    if gpu_steps < 10:
        problems.append(f"only {gpu_steps} GPU steps were reported")
    for problem in problems:
        print(f"rehearsal: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"rehearsal ok: {len(CPU_STEPS)} CPU steps passed, {gpu_steps} GPU steps said 'no GPU', "
          f"{report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
