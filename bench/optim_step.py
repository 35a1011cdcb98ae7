"""Median optimizer.step() time on the real parameter shapes of torchvision's resnet50 and resnet18, random
gradients, printed as ratios to torch SGD measured in the same run; the last line is one JSON object.

    python bench/optim_step.py [--threads 1] [--repeats 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lars import LARS, LARSWrapper  # noqa: E402
from lookahead import Lookahead  # noqa: E402

LR, MOMENTUM, WD = 0.1, 0.9, 1e-4


def optimizers(device: torch.device) -> dict:
    makers = {
        "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
        "sgd_per_tensor": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=False),
        "lars": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD),
        "lars_foreach": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
        "lars_per_tensor": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=False),
        "larswrapper_sgd": lambda ps: LARSWrapper(torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)),
        "larswrapper_adam": lambda ps: LARSWrapper(torch.optim.Adam(ps, lr=1e-3, weight_decay=WD)),
        "lookahead_sgd": lambda ps: Lookahead(torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)),
        "lookahead_lars": lambda ps: Lookahead(LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)),
    }
    try:
        from timm.optim import Lars as TimmLars

        makers["timm_lars"] = lambda ps: TimmLars(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    except ImportError:
        print("(timm not installed: pip install -r requirements-bench.txt to time its Lars too)")
    try:
        from pytorch_optimizer import LARS as PoLARS

        makers["pytorch_optimizer_lars"] = lambda ps: PoLARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    except ImportError:
        print("(pytorch-optimizer not installed: pip install -r requirements-bench.txt to time its LARS too)")
    return makers


def median_step_seconds(make, shapes, device, repeats: int, warmup: int = 5) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = make(params)
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: 2 threads are too noisy to rank)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    summary = {}
    print(f"torch {torch.__version__}, device {device}, {args.threads} thread(s), median of {args.repeats} steps")
    for model_name in ("resnet50", "resnet18"):
        shapes = [p.shape for p in getattr(torchvision.models, model_name)().parameters()]
        times = {
            name: median_step_seconds(make, shapes, device, args.repeats) for name, make in optimizers(device).items()
        }
        sgd = min(times["sgd_foreach"], times["sgd_per_tensor"])
        print(f"\n{model_name} ({len(shapes)} tensors): ratio to the faster torch SGD ({sgd * 1e3:.2f} ms)")
        for name, seconds in times.items():
            print(f"  {name:24s} {seconds * 1e3:8.2f} ms  {seconds / sgd:5.2f}x")
            summary[f"{name}_vs_sgd_{model_name}"] = round(seconds / sgd, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
