"""What a gathered metric costs in evaluation (#38): the recommender's evaluation (examples/recommender.py) on 2 gloo
processes, with its AUC states (score(): the sums and every prediction and label gathered from every rank, the AUC
computed from them) and without (loss() and metric_sums(): RMSE and MAE from sums alone), alternating in one run,
the same weights, the validation set repeated `--repeat` times. Each round times one evaluation of each kind (the
ranks start together, the slower rank's time counts); the result is the median over rounds of each kind and of
their ratio. The last line is one JSON object.

    python bench/eval_gather.py [--rounds 15] [--repeat 1] [--val-batch-size 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from ddp_tricks import InMemoryDataset, cli
    from ddp_tricks.data import loaders
    from ddp_tricks.schedules.curves import WarmupDecay
    from ddp_tricks.schedules.schedule import Schedule
    from ddp_tricks.training import loop, seam
    from ddp_tricks.training.precision import Precision
    from ddp_tricks.training.state import Training

    flags, task_class = cli.parse(["--task", "examples/recommender.py:Ratings"])
    task = task_class(flags)
    _, val = task.datasets()
    val = InMemoryDataset(val.inputs.repeat(args.repeat, 1), val.targets.repeat(args.repeat))
    torch.manual_seed(0)
    model = task.model()
    cpu = torch.device("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kinds = {}
    for kind, scoring in (("sums only", None), ("with the AUC", seam.check_scoring(task, model, val))):
        schedule, sums = Schedule(WarmupDecay(optimizer, 0, 0)), ["sq_error", "abs_error"]
        kinds[kind] = Training(model, optimizer, schedule, task, sums, Precision("off", cpu), cpu, scoring=scoring,
                               rank=rank, world_size=world_size)  # fmt: skip
    loader = loaders.val_loader(val, args.val_batch_size, rank, world_size, cpu)
    times = {kind: [] for kind in kinds}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for kind, t in kinds.items():
            dist.barrier()
            start = time.perf_counter()
            loop.evaluate(t, loader)
            seconds = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if round_:
                times[kind].append(float(seconds))
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=1, help="the validation set this many times over")
    parser.add_argument("--val-batch-size", type=int, default=1024)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=1800)
    for p in procs:
        p.join()
    plain, gathered = times["sums only"], times["with the AUC"]
    ratios = [b / a for a, b in zip(plain, gathered)]
    result = {
        "validation ratings": 2590 * args.repeat,
        "val_batch_size": args.val_batch_size,
        "rounds": args.rounds,
        "sums only, ms (median)": round(1000 * statistics.median(plain), 2),
        "with the AUC, ms (median)": round(1000 * statistics.median(gathered), 2),
        "ratio (median of rounds)": round(statistics.median(ratios), 3),
        "ratio range": [round(min(ratios), 3), round(max(ratios), 3)],
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
