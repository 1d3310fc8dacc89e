"""Training throughput of the GPU kit's wide MLP through PyTorch + Hugging Face Accelerate, in samples per second.

The same model, shapes, loss and optimizer as burn-accelerate's `throughput` bench
(benches/throughput.rs): features -> width -> width -> features with ReLU between, mean
squared error against sin(x), Adam with lr 1e-4, one batch made once on the device, warm-up steps, then rounds
of `steps` steps each ending by reading the loss; the median round gives `torch_samples_per_s`.

Usage: python3 scripts/gpu/torch_throughput.py [--precision no|bf16|fp16] [--features 1024] [--width 4096]
       [--batch 512] [--steps 50] [--rounds 5]
"""

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    try:
        import torch
        from accelerate import Accelerator
    except ImportError as error:
        print(f"skipped: {error}", file=sys.stderr)
        return 3

    accelerator = Accelerator(mixed_precision=args.precision)
    device = accelerator.device
    torch.manual_seed(0)
    dims = [args.features, args.width, args.width, args.features]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(args.batch, args.features, device=device)
    y = torch.sin(x)

    def run(steps: int) -> tuple[float, float]:
        start = time.perf_counter()
        loss = None
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with accelerator.autocast():
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            accelerator.backward(loss)
            optimizer.step()
        last = loss.item()  # waits for the device
        return time.perf_counter() - start, last

    run(min(args.steps, 10))
    times, last = [], float("nan")
    for _ in range(args.rounds):
        elapsed, last = run(args.steps)
        times.append(elapsed)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model=wide-mlp features={args.features} width={args.width} params={params} batch={args.batch} "
        f"steps={args.steps} rounds={args.rounds} precision={args.precision} device={device} "
        f"torch={torch.__version__}"
    )
    if device.type == "cuda":
        print(f"gpu={torch.cuda.get_device_name(device)}")
    print(f"torch_samples_per_s={args.steps * args.batch / statistics.median(times):.1f}")
    print(f"final_loss={last:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
