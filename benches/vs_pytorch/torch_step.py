"""The `step_phases` bench's workload through PyTorch + Hugging Face Accelerate, one process per rank.

An MLP 256 -> 1024 -> 1024 -> 10 with ReLU, cross-entropy, AdamW at lr 1e-3, batch 128 per rank, synthetic data
made up front and handed out by Accelerate's prepared DataLoader; 5 warm-up steps, then `--steps` timed steps.
Rank 0 prints `torch_samples_per_s` (every rank's samples over the wall time of the timed steps).

Run under torchrun (which sets one thread per process when it starts several):
    torchrun --nproc_per_node 2 benches/vs_pytorch/torch_step.py [--steps 40] [--adamw foreach|fused|plain]
"""

import argparse
import sys
import time

FEATURES, WIDTH, CLASSES, BATCH, WARM_UP = 256, 1024, 10, 128, 5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--adamw", default="foreach", choices=["foreach", "fused", "plain"])
    args = parser.parse_args()
    try:
        import torch
        from accelerate import Accelerator
    except ImportError as error:
        print(f"skipped: {error}", file=sys.stderr)
        return 3

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "plain": {"foreach": False}}[args.adamw]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
    n = (WARM_UP + args.steps) * BATCH * accelerator.num_processes
    x = torch.rand(n, FEATURES) - 0.5
    y = torch.randint(0, CLASSES, (n,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = None
    steps = 0
    for step, (xb, yb) in enumerate(loader):
        if step == WARM_UP:
            accelerator.wait_for_everyone()
            start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        if step >= WARM_UP:
            steps += 1
    accelerator.wait_for_everyone()
    elapsed = time.perf_counter() - start
    if accelerator.is_main_process:
        samples = steps * BATCH * accelerator.num_processes
        print(f"torch_threads={torch.get_num_threads()} adamw={args.adamw} steps={steps}")
        print(f"torch_samples_per_s={samples / elapsed:.0f}", flush=True)
    # Tear the process group down before exit: torchrun's gloo group otherwise aborts the exiting process.
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
