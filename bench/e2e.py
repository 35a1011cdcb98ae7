"""run.py's own training loop (engine.train_one_epoch) against a minimal bare loop doing the same work: same
model, data, batch, optimizer and AMP setting, measured interleaved in one run after warm-up. Also the data
path alone (loader iteration without the model). The last line is one JSON object.

    python bench/e2e.py [--model toy] [--batch-size 32] [--amp off|bf16|fp16] [--optimizer sgd|lars] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import config  # noqa: E402
import data  # noqa: E402
import image_data  # noqa: E402
import models  # noqa: E402
import plan  # noqa: E402
import schedulers  # noqa: E402
from engine import Training, train_one_epoch  # noqa: E402
from lars import LARS  # noqa: E402
from precision import DTYPES, Precision  # noqa: E402


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "lars":
        return LARS(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)


def build(args, device):
    torch.manual_seed(0)
    model = models.build(args.model, 1, 10).to(device)
    optimizer = make_optimizer(args.optimizer, model, 0.01)
    return model, optimizer


def bare_epoch(model, optimizer, loader, device, amp_dtype, scaler) -> None:
    """The loop a user would write by hand: forward, backward, step; nothing else."""
    model.train()
    criterion = nn.CrossEntropyLoss()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(inputs).float(), targets)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off")
    parser.add_argument("--optimizer", choices=("sgd", "lars"), default="sgd")
    parser.add_argument("--repeats", type=int, default=7, help="epochs timed for each loop (median)")
    parser.add_argument("--copies", type=int, default=4, help="the digits training set repeated, for longer epochs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    train_set, _ = image_data.digits()
    train_set = data.InMemoryDataset(
        train_set.inputs.repeat(args.copies, 1, 1, 1), train_set.targets.repeat(args.copies)
    )
    the_plan = plan.make(num_train=len(train_set), world_size=1, micro_batch=args.batch_size, accum_steps=1,
                         epochs=1, seed=0, base_lr=0.01, lr_scaling="keep", base_batch=args.batch_size,
                         warmup_epochs=0)  # fmt: skip
    loader = data.train_loader(train_set, 0, device, seed=0)
    amp_dtype = DTYPES[args.amp]
    flags, task_class = config.parse(["--model", args.model])  # the built-in task: its loss and accuracy

    model_t, opt_t = build(args, device)
    training = Training(model_t, opt_t, schedulers.Schedule(schedulers.WarmupDecay(opt_t, 0, 0)), task_class(flags),
                        ["acc"], Precision(args.amp, device), device)  # fmt: skip
    model_b, opt_b = build(args, device)
    scaler_b = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    steps = []

    def template():
        train_one_epoch(training, steps, loader, log_interval=20)

    def bare():
        bare_epoch(model_b, opt_b, loader, device, amp_dtype, scaler_b)

    def data_only():
        for inputs, targets in loader:
            inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    timings = {"template": [], "bare": [], "data": []}
    order = [("template", template), ("bare", bare), ("data", data_only)]
    for run in range(args.repeats + 1):  # the first round warms up; the order alternates so neither loop gains
        for name, fn in order if run % 2 else order[::-1]:
            steps[:] = the_plan.epoch(run, 0)  # DistributedSampler's order for this epoch, as run.py draws it
            loader.batch_sampler.start(steps)
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if run:
                timings[name].append(time.perf_counter() - start)
    samples = len(train_set)
    template_s, bare_s, data_s = (statistics.median(timings[k]) for k in ("template", "bare", "data"))
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, model {args.model}, "
          f"batch {args.batch_size}, amp {args.amp}, optimizer {args.optimizer}, {samples} samples per epoch, "
          f"median of {args.repeats} epochs")  # fmt: skip
    print(f"  bare loop      {samples / bare_s:9.0f} samples/s  ({bare_s:.3f} s/epoch)")
    print(f"  template loop  {samples / template_s:9.0f} samples/s  ({template_s:.3f} s/epoch)")
    print(f"  data path only {samples / data_s:9.0f} samples/s  ({data_s:.3f} s/epoch)")
    print(f"  template / bare time per step: {template_s / bare_s:.3f}")
    print(
        json.dumps(
            {
                "template_vs_bare": round(template_s / bare_s, 3),
                "template_samples_per_s": round(samples / template_s),
                "bare_samples_per_s": round(samples / bare_s),
                "data_epoch_seconds": round(data_s, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
