"""What model EMA (`--model-ema`) costs per step: the template's training step (the loop's accumulation, optimizer
step, then what follows a step: the EMA update, training/ema.py) with and without the EMA, interleaved in one run
after a warm-up, and the EMA update alone; for the built-in task's toy CNN on the digits (a small model, where fixed
costs show) and torchvision's ResNet-18 on 32x32 images (11.7 M parameters, where the pass over the weights shows).
The step's ratio to the one without EMA (from the mean paired difference, the order alternating), and the update's
time alone. The last line is one JSON object.

    python bench/ema.py [--repeats 100] [--threads 1]
    python bench/ema.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddp_tricks import models
from ddp_tricks.plan import Step
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training import loop
from ddp_tricks.training.ema import ModelEma
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

MODELS = {  # name -> (model, input shape (channels, size), batch)
    "toy CNN, digits 8x8, batch 32": (lambda: models.build("toy", 1, 10), (1, 8), 32),
    "ResNet-18, 32x32, batch 16": (lambda: models.build("resnet18", 3, 10), (3, 32), 16),
}


class Classify:
    def loss(self, outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets)


def training(build, device: torch.device) -> Training:
    torch.manual_seed(0)
    model = build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return Training(model, optimizer, Schedule(WarmupDecay(optimizer, 0, 0)), Classify(), [], Precision("off", device),
                    device)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time(t: Training, step: Step, batch, device: torch.device) -> float:
    """One training step as the loop takes it: forward and backward, the optimizer step, then the EMA (if any)."""
    params = [p for p in t.model.parameters() if p.requires_grad]
    sync(device)
    start = time.perf_counter()
    for _ in loop.plain_accumulation(t, step, iter([batch]), None):
        pass
    if loop.optimizer_step(t, params):
        loop.after_optimizer_step(t, 1.0)
    sync(device)
    return time.perf_counter() - start


def update_time(ema: ModelEma, model: torch.nn.Module, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    ema.update(model)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = {}
    for name, (build, (channels, size), batch_size) in MODELS.items():
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(batch_size, channels, size, size, generator=g).to(device),
                 torch.randint(0, 10, (batch_size,), generator=g).to(device))  # fmt: skip
        step = Step([[0] * batch_size], batch_size, batch_size)
        t = training(build, device)  # one model and optimizer: the steps differ only in the EMA
        ema = ModelEma(t.model, 0.999, warmup=True)
        ways = {"without EMA": None, "with EMA": ema}
        times = {way: [] for way in ways}
        updates = []
        for repeat in range(args.repeats + 2):  # the first two rounds warm up
            for way in ways if repeat % 2 == 0 else reversed(list(ways)):  # interleaved, alternating order
                t.ema = ways[way]
                elapsed = step_time(t, step, batch, device)
                if repeat >= 2:
                    times[way].append(elapsed)
            if repeat >= 2:
                updates.append(update_time(ema, t.raw_model, device))
        median = {way: statistics.median(values) for way, values in times.items()}
        # a round's first step runs slower than its second (by ~1 ms for the toy CNN here): the EMA's cost is the
        # mean of the rounds' differences, half of them with the EMA first, half second, trimmed of outliers
        differences = sorted(a - b for a, b in zip(times["with EMA"], times["without EMA"]))
        cut = len(differences) // 10
        extra = statistics.mean(differences[cut : len(differences) - cut])
        params = sum(p.numel() for p in t.model.parameters())
        row = {
            "parameters": params,
            "step_ms": 1000 * median["without EMA"],
            "with_ema_ratio": 1 + extra / median["without EMA"],
            "update_ms": 1000 * statistics.median(updates),
        }
        results[name] = row
        print(
            f"{name} ({params / 1e6:.2f} M parameters): step {row['step_ms']:.2f} ms without EMA, "
            f"x{row['with_ema_ratio']:.3f} with it; the EMA update alone {row['update_ms']:.3f} ms "
            f"({row['update_ms'] / row['step_ms']:.1%} of the step)"
        )
    print(json.dumps({"device": str(device), "threads": args.threads, "torch": torch.__version__} | results))


if __name__ == "__main__":
    main()
