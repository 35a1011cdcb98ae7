"""Values reduced across ranks: sums, minima, one flag that every rank agrees on, buffers from rank 0, and small
gathers. Each is a no-op (or the value itself) in a single process without a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_tricks.errors import UserError


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor across ranks in place (a no-op for one process) and return it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (the value itself for one process)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest `value` over the ranks (the value itself for one process)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool | torch.Tensor, device: torch.device, group=None) -> bool:
    """True on every rank when it is true on any rank: one decision that no rank waits behind.

    A tensor `flag` (a bool on the device) is reduced where it lies and read once: one host sync, and no copy from
    the host. With a gloo `group` a Python flag stays on the CPU, so asking costs no GPU synchronisation.
    """
    if isinstance(flag, torch.Tensor):
        value = flag.reshape(1).to(torch.float32, copy=True)  # the caller's flag is not reduced in place
    else:
        value = torch.full((1,), float(flag), device="cpu" if group is not None else device)  # a fill: no copy
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return bool(value.item() > 0)


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank `src`'s buffers (BatchNorm running statistics), so all hold the same model."""
    if dist.is_available() and dist.is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def gather_from_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's copy of a same-shaped tensor, stacked by rank (just the tensor, unsqueezed, alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def gather_objects(value) -> list:
    """Every rank's picklable value, in rank order (only for small values, off the hot path)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def require_same(value, what: str) -> None:
    """A UserError on every rank together when the ranks disagree about `value` (a small, picklable one)."""
    values = gather_objects(value)
    if any(v != values[0] for v in values):
        raise UserError(f"the ranks disagree about {what}: {values}")
