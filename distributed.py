"""How we were launched (torchrun, torch.distributed.launch, plain python, several nodes), the device and
backend, process-group set-up and tear-down, and values reduced across ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config import UserError


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
    """cuda:LOCAL_RANK when CUDA is there (CUDA_VISIBLE_DEVICES respected by torch), else cpu."""
    if device_flag == "cpu" or (device_flag == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(
            f"local rank {local_rank} has no GPU: only {count} visible; "
            "launch at most that many processes per node or check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


def setup(launch: Launch, device_flag: str = "auto", backend_flag: str = "auto", timeout_s: float = 600) -> Dist:
    """Pick the device, and join the process group when launched by torchrun or the legacy launcher."""
    device = choose_device(device_flag, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not launch.is_distributed:
        return Dist(0, 1, 0, device, None)
    backend = backend_flag if backend_flag != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return Dist(dist.get_rank(), dist.get_world_size(), launch.local_rank, device, backend)


def cleanup() -> None:
    """Leave the process group; safe to call on every path, twice, or with no group at all."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor across ranks in place (a no-op for one process) and return it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any rank: one decision that no rank waits behind."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_sum(value).item() > 0)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank `src`'s buffers (BatchNorm running statistics), so all hold the same model."""
    if dist.is_available() and dist.is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)
