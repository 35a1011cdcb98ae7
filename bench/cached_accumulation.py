"""What cached (GradCache) accumulation costs per step: the SimCLR example (examples/contrastive.py) stepping with
`--accum-steps N` micro-batches the plain way (loop.py: one forward and backward each) and the cached way
(training/cached.py: a forward of each without a graph, the loss over all of them, then each forward again with a
graph and its backward), interleaved in one run after a warm-up; also the whole batch in one forward (what both
stand for). Ratios to plain accumulation. Memory: the bytes one forward saves for its backward (the activations a
backward holds; measured with saved-tensor hooks, so on the CPU too), and on CUDA each way's peak memory. The last
line is one JSON object.

    python bench/cached_accumulation.py [--micro-batch 64] [--accum-steps 4] [--width 32] [--repeats 15]
    python bench/cached_accumulation.py --device cuda --micro-batch 512 --width 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddp_tricks import cli
from ddp_tricks.plan import Step
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training import cached, loop
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training
from lars import LARS

WAYS = {"plain": loop.plain_accumulation, "cached": cached.cached_accumulation, "one_batch": loop.plain_accumulation}


def training(task, device: torch.device, accumulation) -> Training:
    torch.manual_seed(0)
    model = task.model().to(device)
    optimizer = LARS(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    schedule = Schedule(WarmupDecay(optimizer, 0, 0))
    t = Training(model, optimizer, schedule, task, ["top1", "probe"], Precision("off", device), device)
    t.accumulation = accumulation
    return t


class SavedBytes:
    """The bytes each forward of `model` saves for backward, by saved-tensor hooks around every forward."""

    def __init__(self, model: torch.nn.Module):
        self.per_forward: list[int] = []
        self._now = 0
        self._hooks = None
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._finish)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._now += tensor.numel() * tensor.element_size()
        return tensor

    def _start(self, *_):
        self._now = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def _finish(self, *_):
        self._hooks.__exit__(None, None, None)
        self.per_forward.append(self._now)


def step_time(t: Training, step: Step, batches: list, device: torch.device) -> float:
    """One optimizer step's wall time (its gradient the way `t.accumulation` makes it, then LARS)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in t.accumulation(t, step, iter(batches), None):
        pass
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=32, help="the example encoder's width")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    flags, task_class = cli.parse(["--task", "examples/contrastive.py:SimCLR", "--width", str(args.width)])
    task = task_class(flags)
    train, _ = task.datasets()
    whole = args.micro_batch * args.accum_steps
    inputs, targets = train.__getitems__(list(range(whole)))  # fresh random views, once: no data loading timed
    inputs, targets = inputs.to(device), targets.to(device)
    micro = list(zip(inputs.split(args.micro_batch), targets.split(args.micro_batch)))
    runs = {
        "plain": (Step([[0] * args.micro_batch] * args.accum_steps, whole, whole), micro),
        "cached": (Step([[0] * args.micro_batch] * args.accum_steps, whole, whole), micro),
        "one_batch": (Step([[0] * whole], whole, whole), [(inputs, targets)]),
    }
    trainings = {name: training(task, device, WAYS[name]) for name in runs}
    saved = {name: SavedBytes(t.model) for name, t in trainings.items()}
    times = {name: [] for name in runs}
    peak = {}
    for repeat in range(args.repeats + 2):  # the first two rounds warm up
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))  # interleaved, alternating order
        for name in order:
            step, batches = runs[name]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            elapsed = step_time(trainings[name], step, batches, device)
            if device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
            if repeat >= 2:
                times[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "device": str(device),
        "micro_batch": args.micro_batch,
        "accum_steps": args.accum_steps,
        "width": args.width,
        "repeats": args.repeats,
        "median_step_ms": {name: round(1000 * value, 2) for name, value in median.items()},
        "cached_over_plain": round(median["cached"] / median["plain"], 3),
        "one_batch_over_plain": round(median["one_batch"] / median["plain"], 3),
    }
    result["saved_for_backward_mib"] = {name: round(max(s.per_forward) / 2**20, 2) for name, s in saved.items()}
    if peak:
        result["peak_mib"] = {name: round(value, 1) for name, value in peak.items()}
    for name, value in median.items():
        print(
            f"{name:>9}: {1000 * value:8.2f} ms per step ({value / median['plain']:.3f}x plain), "
            f"{result['saved_for_backward_mib'][name]:.2f} MiB saved for backward by one forward"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
