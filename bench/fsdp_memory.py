"""Memory and speed of `--strategy fsdp` against `ddp`, measured in one run: for a model of a few million
parameters at world sizes 1, 2 and 3, each rank's bytes of parameters + gradients + optimizer state (what the rank
holds after a step) and the median time of a training step (forward, backward, reduction, optimizer), DDP and FSDP2
side by side. The last line is one JSON object.

    python bench/fsdp_memory.py [--optimizer lamb|adamw|lars] [--width 1024] [--steps 12] [--device cpu|cuda]

On CPU the ranks are gloo processes on this machine; with --device cuda, one process per GPU on nccl (rank r on
cuda:r), so a world size larger than the visible GPUs is skipped, and said. A rank that dies ends the run within
about a second, with its exit code, rather than leaving the others waiting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_module
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ddp_tricks.distributed import fsdp
from ddp_tricks.optim import build as optimizers
from ddp_tricks.shards import local


def model_of(width: int) -> nn.Module:
    """Four blocks of two linear layers and a LayerNorm: 8 x width^2 parameters and change (8.4 M at 1024)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.LayerNorm(width))
              for _ in range(4)]  # fmt: skip
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (a shard's local slice where sharded)."""

    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    slow = getattr(optimizer, "slow", [])
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(v) for v in state) + sum(size(s) for s in slow),
    }


def device_for(rank: int, device: str) -> torch.device:
    """Rank r's device: cuda:r (main runs only the world sizes the visible GPUs allow), or the CPU."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = device_for(rank, args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    result = {}
    for strategy in ("ddp", "fsdp"):
        model = model_of(args.width).to(device)
        if strategy == "fsdp":  # sharded as run.py shards it: each block, then the root
            model = wrapped = fsdp.shard(model, list(model))
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        optimizer = optimizers.build(model, args.optimizer, lr=1e-3, weight_decay=0.01)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=generator).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
        times = []
        for step in range(args.steps + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            nn.functional.cross_entropy(wrapped(x), y).backward()
            optimizer.step()
            if step == args.steps + 1:
                memory = held_bytes(model, optimizer)  # gradients still held: what a step needs at its peak
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - start)
        result[strategy] = {"bytes": memory, "step_seconds": statistics.median(times)}
        del wrapped, model, optimizer
    if rank == 0:
        queue.put(json.dumps(result))
    dist.destroy_process_group()


def world_sizes(requested: list[int], device: str, gpus: int) -> tuple[list[int], list[int]]:
    """The world sizes this machine can run (each rank its own GPU on cuda: at most `gpus`) and those it skips."""
    if device != "cuda":
        return list(requested), []
    return [w for w in requested if w <= gpus], [w for w in requested if w > gpus]


def run_world(world_size: int, args, target=None, timeout: float = 900.0, poll: float = 0.2) -> dict:
    """`target(rank, world_size, port, args, queue)` (the benchmark's worker) in `world_size` processes; rank 0's
    result. A rank that exits without it ends the wait at once: the others are killed and the error names it."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target or worker, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return json.loads(queue.get(timeout=poll))
            except queue_module.Empty:
                pass
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:  # the others would wait for it in a collective until their process group's timeout
                rank, code = failed[0]
                before = "reporting" if rank == 0 else "rank 0 reported"
                raise RuntimeError(
                    f"world size {world_size}: rank {rank} exited with code {code} before {before} (its error is "
                    "printed above)"
                )
            if all(p.exitcode == 0 for p in procs) and queue.empty():
                raise RuntimeError(f"world size {world_size}: every rank exited, and rank 0 reported nothing")
            if time.monotonic() > deadline:
                raise RuntimeError(f"world size {world_size}: no result after {timeout:.0f} s")
    except BaseException:  # the ranks still running wait for one that will not come: none is waited for
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)  # after a result, the ranks are ending by themselves
            if p.is_alive():
                p.kill()
                p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("lamb", "adamw", "lars", "sgd"), default="lamb")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        sys.exit("error: --device cuda, but torch sees no CUDA device; run on --device cpu")
    worlds, skipped = world_sizes(args.world_sizes, args.device, gpus)
    if skipped:
        print(f"world size(s) {', '.join(map(str, skipped))} skipped: each rank needs a GPU of its own, and "
              f"{gpus} are visible")  # fmt: skip
    rows = {}
    for world_size in worlds:
        try:
            rows[world_size] = run_world(world_size, args)
        except RuntimeError as error:
            sys.exit(f"error: {error}")
    params = sum(p.numel() for p in model_of(args.width).parameters())
    print(f"torch {torch.__version__}, {args.device}, {args.optimizer}, {params / 1e6:.2f} M parameters, batch "
          f"{args.batch} per rank, median of {args.steps} steps")  # fmt: skip
    header = "world | DDP MiB per rank (param+grad+optim) | FSDP MiB per rank | FSDP / DDP bytes | 1 / world"
    print(f"{header} | FSDP / DDP step time")
    summary = {}
    for world_size, r in rows.items():
        ddp, fsdp = (sum(r[s]["bytes"].values()) for s in ("ddp", "fsdp"))
        ratio, time_ratio = fsdp / ddp, r["fsdp"]["step_seconds"] / r["ddp"]["step_seconds"]
        print(f"{world_size:5d} | {ddp / 2**20:34.1f} | {fsdp / 2**20:16.1f} | {ratio:16.3f} | {1 / world_size:9.3f} "
              f"| {time_ratio:20.2f}")  # fmt: skip
        summary[world_size] = {
            "ddp_bytes": ddp,
            "fsdp_bytes": fsdp,
            "bytes_ratio": round(ratio, 4),
            "step_time_ratio": round(time_ratio, 3),
            "ddp_step_s": r["ddp"]["step_seconds"],
            "fsdp_step_s": r["fsdp"]["step_seconds"],
        }
    print(json.dumps({"optimizer": args.optimizer, "parameters": params, "device": args.device, "worlds": summary}))


if __name__ == "__main__":
    main()
