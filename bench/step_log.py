"""What per-step rows cost: run.py's loop (train_one_epoch) with a row every 10 steps (training/step_log.py: the row's
one all-gather and host read, which carries the non-finite check and the empty steps' count) against --log-interval 0
(no row, no read), measured interleaved in one run after warm-up, in one process and in two (DDP on gloo). The last
line is one JSON object.

    python bench/step_log.py [--batch-size 32] [--repeats 7] [--interval 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ddp_tricks import models
from ddp_tricks import plan as planning
from ddp_tricks.data import images as image_data
from ddp_tricks.data import loaders
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training.loop import start_epoch, train_one_epoch
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training
from ddp_tricks.training.step_log import StepLog

CPU = torch.device("cpu")


class Classify:
    better = {"acc": "max"}

    def loss(self, outputs, targets):
        return nn.functional.cross_entropy(outputs, targets)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(1) == targets).sum()}


def measure(rank: int, world_size: int, args, port: int, results) -> None:
    """Epochs of the digits, alternating a row every `interval` steps and none; the seconds per step of each."""
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, _ = image_data.digits()
    model = models.build("toy", 1, 10)
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = Schedule(WarmupDecay(optimizer, 0, 0))
    t = Training(model, optimizer, schedule, Classify(), ["acc"], Precision("off", CPU), CPU, rank=rank,
                 world_size=world_size)  # fmt: skip
    the_plan = planning.make(num_train=len(train_set), world_size=world_size, micro_batch=args.batch_size,
                             accum_steps=1, epochs=1, seed=0, base_lr=0.05, lr_scaling="keep", base_batch=32,
                             warmup_epochs=0)  # fmt: skip
    loader = loaders.train_loader(train_set, rank, CPU, seed=0)
    logs = {"rows": StepLog.of(t, interval=args.interval), "none": StepLog.of(t, interval=0)}
    seconds = {name: [] for name in logs}
    epoch = 0
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, log in logs.items() if repeat % 2 else reversed(logs.items()):
            epoch += 1
            t.progress.completed_epochs, t.progress.step_in_epoch = epoch - 1, 0  # each its own whole epoch
            steps = the_plan.epoch(epoch, rank)
            first = start_epoch(t, epoch, loader, steps, 0)
            start = time.perf_counter()
            with log.epoch(epoch, len(steps), first, t.progress.global_step):
                train_one_epoch(t, steps, loader, first, log)
            if repeat:
                seconds[name].append((time.perf_counter() - start) / len(steps))
    if rank == 0:
        results.put(seconds)
    if world_size > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world_size: int, args) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    if world_size == 1:
        measure(0, 1, args, 0, results)
    else:
        mp.start_processes(measure, (world_size, args, free_port(), results), nprocs=world_size, start_method="spawn")
    seconds = results.get()
    rows, none = statistics.median(seconds["rows"]), statistics.median(seconds["none"])
    return {"processes": world_size, "step_ms_rows": rows * 1e3, "step_ms_none": none * 1e3, "ratio": rows / none}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--interval", type=int, default=10)
    args = parser.parse_args()
    found = [run(world_size, args) for world_size in (1, 2)]
    for result in found:
        print(
            f"{result['processes']} process(es): a row every {args.interval} steps "
            f"{result['step_ms_rows']:.2f} ms/step, none {result['step_ms_none']:.2f} ms/step: "
            f"ratio {result['ratio']:.4f}"
        )
    print(json.dumps({"interval": args.interval, "results": found}))


if __name__ == "__main__":
    main()
