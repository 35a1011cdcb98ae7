"""Sparse gradients across 2 gloo processes: DDP's own sparse reducer against the template's (DDP built without the
tables, `distributed/sparse.py` averaging them after the backward), on the recommender (examples/recommender.py
--sparse: four embedding tables and one dense weight, plain SGD).

Timing: both models in the same two processes, from the same weights, alternating rounds of `--steps-per-round`
training steps each (the slower rank's time counts); the medians over rounds of each and of their ratio.
`--stress N`: N fresh 2-process jobs of each kind, `--stress-steps` steps each (with `--tables` extra tables, more
buckets in flight), and how many of each ended in an abort (glibc's "malloc(): unaligned tcache chunk detected",
SIGABRT): DDP's sparse path corrupts the heap now and then in torch 2.14.1; the template's never did. The last line
is one JSON object.

    python bench/sparse_reduction.py [--rounds 15] [--steps-per-round 20] [--stress 0] [--stress-steps 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KINDS = ("DDP's sparse reducer", "the template's")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(kind: str, rank: int, world_size: int, extra_tables: int):
    """The recommender's model with sparse tables (plus `extra_tables`), wrapped as `kind` reduces it: (the model to
    call, the template's SparseGradients or None, the optimizer)."""
    from ddp_tricks import cli
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.distributed.sparse import SparseGradients
    from ddp_tricks.distributed.wrap import wrap

    flags, task_class = cli.parse(["--task", "examples/recommender.py:Ratings", "--sparse"])
    task = task_class(flags)
    task.datasets()
    torch.manual_seed(0)
    model = Extra(task.model(), extra_tables)
    tables = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    names = [f"{name}.weight" for name in tables]
    here = Dist(rank, world_size, rank, torch.device("cpu"), "gloo")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if kind == KINDS[0]:
        return torch.nn.parallel.DistributedDataParallel(model), None, optimizer, task
    sparse = SparseGradients(model, names, world_size)
    return wrap(model, here, apart=names), sparse, optimizer, task


class Extra(torch.nn.Module):
    """The recommender's model, and `count` more sparse tables looked up by item (each adds a little)."""

    def __init__(self, model: torch.nn.Module, count: int):
        super().__init__()
        self.model = model
        self.more = torch.nn.ModuleList(torch.nn.Embedding(400, 6, sparse=True) for _ in range(count))

    def forward(self, pairs):
        out = self.model(pairs)
        for table in self.more:
            out = out + 0.01 * table(pairs[:, 1]).sum(1)
        return out


def train_steps(model, sparse, optimizer, task, batches) -> None:
    for inputs, targets in batches:
        task.loss(model(inputs), targets).backward()
        if sparse is not None:
            sparse.reduce()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def batches_of(task, rank: int, count: int, size: int, seed: int):
    train, _ = task.datasets()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    picks = [torch.randint(0, len(train), (size,), generator=g) for _ in range(count)]
    return [(train.inputs[i], train.targets[i]) for i in picks]


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    kinds = {kind: build(kind, rank, world_size, args.tables) for kind in KINDS}
    times = {kind: [] for kind in KINDS}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for kind, (model, sparse, optimizer, task) in kinds.items():
            batches = batches_of(task, rank, args.steps_per_round, args.batch_size, round_)
            dist.barrier()
            start = time.perf_counter()
            train_steps(model, sparse, optimizer, task, batches)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_:
                times[kind].append(elapsed.item() / args.steps_per_round)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def stress_main(args) -> None:
    """One job of `args.only` (run as `--only KIND` in 2 processes by --stress): steps, then a clean exit."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, sparse, optimizer, task = build(KINDS[args.only], rank, world_size, args.tables)
    for start in range(0, args.stress_steps, 100):
        batches = batches_of(task, rank, min(100, args.stress_steps - start), 16, start)
        train_steps(model, sparse, optimizer, task, batches)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def stress(args) -> dict[str, int]:
    aborted = {}
    for only, kind in enumerate(KINDS):
        aborted[kind] = 0
        for _ in range(args.stress):
            steps, tables = str(args.stress_steps), str(args.tables)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                       "--only", str(only), "--stress-steps", steps, "--tables", tables]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            said = result.stdout + result.stderr
            if result.returncode != 0:
                aborted[kind] += "malloc()" in said or f"exitcode: -{int(signal.SIGABRT)}" in said
                lines = [line for line in said.splitlines() if "malloc()" in line or "exitcode" in line] or [""]
                print(f"{kind}: exit {result.returncode}: {lines[0].strip()[:160]}", flush=True)
    return aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="each rank's samples in a step")
    parser.add_argument("--tables", type=int, default=0, help="extra sparse tables beside the recommender's four")
    parser.add_argument("--stress", type=int, default=0, help="fresh jobs of each kind, counting aborts")
    parser.add_argument("--stress-steps", type=int, default=1500)
    parser.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is not None:
        return stress_main(args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    result = {kind: statistics.median(values) * 1e3 for kind, values in times.items()}
    ratios = [b / a for a, b in zip(*times.values())]
    print(f"2 gloo processes, the recommender --sparse (+{args.tables} tables), {args.batch_size} samples a rank:")
    for kind, ms in result.items():
        print(f"  {kind:22s} {ms:7.3f} ms/step")
    print(f"  the template's / DDP's: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds)")
    out = {"ms_per_step": result, "ratio": statistics.median(ratios)}
    if args.stress:
        out["aborted"] = stress(args)
        out["jobs_each"] = args.stress
        print(f"  aborted, of {args.stress} jobs of {args.stress_steps} steps each: {out['aborted']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
