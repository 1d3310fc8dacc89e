"""Training throughput on the CPU, burn-accelerate against PyTorch + Hugging Face Accelerate, two processes each.

Alternates `burn-accelerate launch --num-processes 2 <step_phases bench> --bench` (one thread per process, as the
launcher sets it) with `torchrun --nproc_per_node 2 benches/vs_pytorch/torch_step.py` (one thread per process, as
torchrun sets it; AdamW `fused=True`, PyTorch's fastest AdamW on this kind of machine), on the same workload (see
torch_step.py), and prints each pair and the median and range of ours / PyTorch's samples per second.

Run it with the Python that has torch and accelerate (a venv: Debian refuses system-wide pip installs):
    python3 -m venv /tmp/torch-venv && /tmp/torch-venv/bin/pip install torch accelerate
    cargo build --release -p burn-accelerate-cli --features mpi
    cargo bench --no-run -p burn-accelerate-examples --features mpi --bench step_phases   # prints the binary
    /tmp/torch-venv/bin/python benches/vs_pytorch/compare.py --ours target/release/deps/step_phases-<hash> \\
        [--pairs 8] [--adamw fused|foreach|plain]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys


def figure(output: str, name: str) -> float:
    match = re.search(rf"(?:^|\s){name}=([0-9.]+)", output, re.M)
    if not match:
        raise SystemExit(f"no {name}= in:\n{output}")
    return float(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", required=True, help="the step_phases bench binary, built with --features mpi")
    parser.add_argument("--cli", default="target/release/burn-accelerate")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--adamw", default="fused", choices=["fused", "foreach", "plain"])
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1")
    ours_cmd = [args.cli, "launch", "--num-processes", "2", args.ours, "--bench"]
    torch_cmd = [torchrun, "--nproc_per_node", "2", os.path.join(here, "torch_step.py"), "--adamw", args.adamw]

    def run(cmd: list[str]) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    ratios = []
    for pair in range(args.pairs):
        first_ours = pair % 2 == 0
        outputs = {}
        for side in (["ours", "torch"] if first_ours else ["torch", "ours"]):
            outputs[side] = run(ours_cmd if side == "ours" else torch_cmd)
        ours = figure(outputs["ours"], "samples_per_s")
        torch = figure(outputs["torch"], "torch_samples_per_s")
        ratios.append(ours / torch)
        print(f"pair {pair + 1}: ours {ours:.0f} samples/s, pytorch {torch:.0f} samples/s, ratio {ours / torch:.3f}",
              flush=True)
    print(f"vs_pytorch_ratio={statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
          f"{len(ratios)} pairs, AdamW {args.adamw})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
