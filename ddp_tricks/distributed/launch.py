"""How we were launched (torchrun, torch.distributed.launch, plain python, several nodes), the device and the
backend, and the process group's set-up and tear-down.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_tricks.distributed import preemption, watchdog
from ddp_tricks.errors import UserError


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process through its environment and argv; no process group yet."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or "RANK" in os.environ


@dataclass(frozen=True)
class Dist:
    """This process's place in the job, once the process group (if any) exists."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group
    control_group: object | None = None  # a gloo group for CPU-side agreement (preemption)
    store: object | None = None  # the job's store, under this launch attempt's prefix (preemption's step)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.backend is not None


def detect(local_rank_flag: int | None = None) -> Launch:
    """Rank, world size and local rank from torchrun's variables (or the legacy `--local-rank` flag)."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    if "LOCAL_RANK" in env:
        local_rank = int(env["LOCAL_RANK"])
    elif local_rank_flag is not None:
        local_rank = local_rank_flag
    else:
        local_rank = 0
    return Launch(rank=rank, world_size=world_size, local_rank=local_rank)


def choose_device(device_flag: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there (CUDA_VISIBLE_DEVICES respected by torch), else cpu. A process that sees
    exactly one GPU uses it, whatever its local rank: one GPU per process (SLURM's --gpu-bind, one container per
    GPU) shows each process its own as cuda:0."""
    if device_flag == "cpu" or (device_flag == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    count = torch.cuda.device_count()
    if count == 1:  # several processes of a node on one GPU, by mistake, are found in setup (refuse_shared_gpu)
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise UserError(
            f"local rank {local_rank} has no GPU: only {count} visible; "
            "launch at most that many processes per node or check CUDA_VISIBLE_DEVICES",
            rank_specific=True,
        )
    return torch.device("cuda", local_rank)


def backend_of(backend_flag: str, device_type: str) -> str:
    """--backend, where `auto` is nccl on CUDA devices and gloo on the CPU."""
    return backend_flag if backend_flag != "auto" else ("nccl" if device_type == "cuda" else "gloo")


def device_type(device_flag: str) -> str:
    """The kind of device --device gives (cuda or cpu), before any device is picked."""
    return "cuda" if device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available()) else "cpu"


def setup(
    launch: Launch,
    device_flag: str = "auto",
    backend_flag: str = "auto",
    timeout_s: float = 600,
    group: bool = False,
    sigterm_grace: float = watchdog.SIGNAL_GRACE,
) -> Dist:
    """Pick the device, and join the process group when launched by torchrun or the legacy launcher. `group`: a
    single process gets a process group of its own too (FSDP shards over a mesh, even a mesh of one)."""
    watchdog.joining()  # a SIGTERM held through the checks ends this process here; else SIGTERM as it was
    device = choose_device(device_flag, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not launch.is_distributed and not group:
        return Dist(0, 1, 0, device, None)
    backend = backend_of(backend_flag, device.type)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not launch.is_distributed:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return Dist(0, 1, 0, device, backend, dist.new_group(backend="gloo", timeout=timeout))
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun keeps one store across restarts; without a per-attempt prefix, a restarted rank can read the
    # address that a killed rank of the previous attempt published, and gloo then waits on a dead port.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ddp_tricks/attempt_{attempt}/", store)
    if backend == "nccl":
        refuse_shared_gpu(store, torch.cuda.get_device_properties(device).uuid, rank)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    # its own queue: agreement never waits behind DDP's traffic; a new group's timeout is gloo's 30 minutes unless given
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    # a failing rank ends the job in seconds; after SIGTERM, a rank stuck in one call ends after `sigterm_grace`
    watchdog.start(dist.PrefixStore("watchdog/", store), dist.get_rank(), sigterm_grace, dist.get_world_size())
    return Dist(dist.get_rank(), dist.get_world_size(), launch.local_rank, device, backend, control_group, store)


def refuse_shared_gpu(store, gpu_id, rank: int) -> None:
    """nccl puts one rank on one GPU. Several processes that each see one GPU all use cuda:0 (choose_device), which
    is right when it is a different GPU in each (SLURM's --gpu-bind) and a mistake when it is the same one (more
    processes per node than GPUs): each rank counts itself on its GPU's id in the rendezvous store (one add, no
    wait), and a rank that finds another there says so, by rank; the launcher then ends the others."""
    if store.add(f"gpu/{gpu_id}", 1) > 1:
        raise UserError(
            f"rank {rank} shares its GPU ({gpu_id}) with another rank, and nccl needs one GPU per rank: launch at "
            "most as many processes per node as there are GPUs, or give each process its own "
            "(CUDA_VISIBLE_DEVICES, SLURM's --gpu-bind)",
            rank_specific=True,
        )


def cleanup(ending: bool = False) -> None:
    """Leave the process group at a normal end; safe to call twice, or with no group at all. (A failure with a
    group leaves by watchdog.leave() instead: peers may be stuck, and a teardown would wait for them.)

    Every SIGTERM agreement gives SIGTERM its handler back first (preemption.close_all). `ending`: the process ends
    right after (run.py as a script): SIGTERM stays held through the teardown and the interpreter's end, so the
    SIGTERM a launcher sends every worker once one has ended (a preempted peer, one that finished first) does not
    replace the exit code this process ends with; else SIGTERM's handler is as before.
    """
    watchdog.restore_signals()  # first: a failure's hold was set over preemption's handler, which then restores its own
    if ending:
        watchdog.hold_sigterm()  # preemption then leaves it in place (its own handler is no longer SIGTERM's)
    preemption.close_all()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    watchdog.stop()
    if ending:  # the interpreter's end gives SIGTERM back to the default action, where a launcher's SIGTERM (another
        # worker ended first) would end this process as -15 instead of its own exit code: ignored from here
        watchdog.ignore_sigterm()
