"""Real multi-process runs for tests: gloo ranks spawned on 127.0.0.1 with a free port, bounded in time,
and run.py launched under torchrun as a user would."""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, pg_timeout, environ, cwd):
    os.environ.clear()  # the test's environment and folder now, not the fork server's when it started
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        # Plain pickle bytes: tensors by value, not as shared-memory handles that die with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks are forked from a fork server that imported torch once (per pytest worker), not started afresh: a fresh
# interpreter spends ~3 s of CPU importing torch and its compiler stack before a rank does anything. The server
# only imports (no CUDA, no process group, no tensor work), so every rank is still a new process with its own gloo
# group.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "multiproc"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 120, reporting=None, pg_timeout: float = 60):
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; return the results of the ranks in
    `reporting` (default: all), by rank. Every wait is bounded: a hang fails the test."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    reporting = list(range(world_size)) if reporting is None else list(reporting)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout, dict(os.environ), os.getcwd())
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in reporting:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in reporting]


def _torchrun_command(args: list[str], nproc: int = 2, extra=()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra,
        str(REPO / "run.py"),
        *args,
    ]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, cwd: Path | None = None, extra=()):
    """`torchrun --standalone --nproc_per_node=N run.py ARGS`, as a user types it."""
    cmd = _torchrun_command(args, nproc, extra)
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def preempted(args: list[str], checkpoint: Path, timeout: float = 120, nproc: int = 2, ready=None) -> tuple[str, str]:
    """`torchrun` run.py ARGS on `nproc` ranks, SIGTERM to the launcher (which forwards it to every worker) as soon
    as `checkpoint` exists (or `ready()` is true); the launcher's (stdout, stderr). Both waits are bounded."""
    proc = subprocess.Popen(
        _torchrun_command(args, nproc), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ready = ready or checkpoint.exists
    deadline = time.time() + timeout
    while not ready() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    return proc.communicate(timeout=timeout)


def full_state(path: Path) -> dict:
    """A checkpoint's whole state as tools/export.py reads it (a sharded one's slices joined)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export", REPO / "tools" / "export.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    return export.full_state(path)


def python_run(args: list[str], timeout: float = 240, cwd: Path | None = None):
    """`python run.py ARGS` in one process."""
    cmd = [sys.executable, str(REPO / "run.py"), *args]
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def legacy_launch(args: list[str], cwd: Path | None = None, timeout: float = 240):
    """`python -m torch.distributed.launch --nproc_per_node=2 --master_port=PORT run.py ARGS` (passes --local-rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "run.py"), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
