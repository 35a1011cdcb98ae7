"""Values reduced across ranks: sums, minima, one flag that every rank agrees on, buffers from rank 0, small
gathers, the rows of evaluation's gathered metric states (`gather_rows`), and the gather a task's loss may use
(`gather_with_grad`: every rank's rows, gradients flowing back).
Each is a no-op (or the value itself) in a single process without a process group.

On nccl a collective returns once queued and the host waits later, where it reads the result (`.item()`,
`.tolist()`, `.cpu()`), outside any torch.distributed call. So every function here that reads a collective's result
on the host is marked (`stacks.waits_for`): a rank inside it waits in that collective, for the watchdog, in any
phase (each reads a few numbers: its time is waiting, not work; a gather of whole weights to the CPU is not marked).
They run their collectives the nccl way on gloo too (`async_op=True`, then the wait beside the read), so the CPU
tests see what a GPU job does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ddp_tricks.distributed.stacks import waits_for
from ddp_tricks.errors import UserError

_gathers = 0  # calls of gather_with_grad in this process: how the start-up check learns that a loss uses the ranks
_uneven = False  # inside uneven_rows(): the ranks' tensors may differ in their number of rows
_alike = False  # inside alike_rows(): every rank holds the same rows


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor across ranks in place (a no-op for one process) and return it."""
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@waits_for("all_reduce")
def sum_to_host(tensor: torch.Tensor) -> list:
    """Sum a tensor across ranks in place and read it on the host: its values as a (nested) list of numbers."""
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True).wait()
    return tensor.tolist()


@waits_for("all_gather")
def gather_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's copy of a same-shaped tensor, stacked by rank, on the CPU (just the tensor, unsqueezed, alone)."""
    if not _distributed():
        return tensor.unsqueeze(0).cpu()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous(), async_op=True).wait()
    return torch.stack(parts).cpu()


@waits_for("all_reduce")
def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (the value itself for one process)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True).wait()
    return int(tensor.item())


@waits_for("all_reduce")
def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest `value` over the ranks (the value itself for one process)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True).wait()
    return int(tensor.item())


@waits_for("all_reduce")
def any_rank(flag: bool | torch.Tensor, device: torch.device, group=None) -> bool:
    """True on every rank when it is true on any rank: one decision that no rank waits behind.

    A tensor `flag` (a bool on the device) is reduced where it lies and read once: one host sync, and no copy from
    the host. With a gloo `group` a Python flag stays on the CPU, so asking costs no GPU synchronisation.
    """
    if isinstance(flag, torch.Tensor):
        value = flag.reshape(1).to(torch.float32, copy=True)  # the caller's flag is not reduced in place
    else:
        value = torch.full((1,), float(flag), device="cpu" if group is not None else device)  # a fill: no copy
    if _distributed():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
    return bool(value.item() > 0)


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank `src`'s buffers (BatchNorm running statistics), so all hold the same model."""
    if _distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def gather_from_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's copy of a same-shaped tensor, stacked by rank (just the tensor, unsqueezed, alone)."""
    return gather_from_ranks_later(tensor)()


def gather_from_ranks_later(tensor: torch.Tensor):
    """gather_from_ranks, started now without waiting (every rank calls it at the same point): returns a function
    that waits for it and gives the stack. The collective runs while the caller goes on (the next step's forward);
    `tensor` must not change until then."""
    if not _distributed():
        return tensor.unsqueeze(0).clone
    flat = tensor.contiguous().reshape(-1)
    out = flat.new_empty(dist.get_world_size() * flat.numel())
    # into one tensor: on gloo, with a step's work running meanwhile, half the cost of a list of tensors (0.34 ms
    # against 0.65 ms on a 2-core CPU)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its name since torch 2.12
    work = gather(out, flat, async_op=True)
    return _Waiting(work, out.view(-1, *tensor.shape))


class _Waiting:
    """An all-gather started: calling it waits for it and gives the ranks' tensors, stacked."""

    def __init__(self, work, stacked: torch.Tensor):
        self.work, self.stacked = work, stacked

    @waits_for("all_gather")
    def __call__(self) -> torch.Tensor:
        self.work.wait()
        return self.stacked


@waits_for("all_gather")
def gather_rows(tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Every rank's rows of `tensor`, concatenated along the first dimension in rank order, without gradients (the
    tensor itself alone): the ranks' numbers of rows may differ (each is padded to the longest for the all-gather
    and cut back after); the other dimensions and the dtype must agree. One small all-gather of the row counts (a
    host read; none where every rank passes them, `sizes`) and one of the rows (none when no rank has one):
    evaluation's gathered metric states, once per evaluation; sparse gradients' rows (sparse.py)."""
    if not _distributed():
        return tensor
    if sizes is None:
        sizes = _row_counts(len(tensor), tensor.device)
    sizes = [int(n) for n in sizes]
    if max(sizes) == 0:
        return tensor
    dtype = tensor.dtype
    padded = (tensor.to(torch.uint8) if dtype == torch.bool else tensor).contiguous()  # backends move bytes, not bools
    if len(tensor) < max(sizes):
        padded = torch.cat([padded, padded.new_zeros((max(sizes) - len(tensor), *tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)]).to(dtype)


@waits_for("broadcast")
def broadcast_floats(tensor: torch.Tensor) -> list[float]:
    """Rank 0's values of a small tensor, on every rank, as floats (a host sync: off the hot path)."""
    if _distributed():
        tensor = tensor.clone()
        dist.broadcast(tensor, 0, async_op=True).wait()
    return tensor.tolist()


@waits_for("all_gather")
def _row_counts(rows: int, device: torch.device) -> list[int]:
    """Every rank's number of rows, in rank order (one small all-gather and its host read)."""
    counts = torch.tensor([rows], device=device)
    parts = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, counts, async_op=True).wait()
    return torch.cat(parts).tolist()


def gather_objects(value) -> list:
    """Every rank's picklable value, in rank order (only for small values, off the hot path)."""
    if not _distributed():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def require_same(value, what: str) -> None:
    """A UserError on every rank together when the ranks disagree about `value` (a small, picklable one)."""
    values = gather_objects(value)
    if any(v != values[0] for v in values):
        raise UserError(f"the ranks disagree about {what}: {values}")


def _distributed() -> bool:
    """Whether there are other ranks: a process group of one (torchrun --nproc_per_node=1, or the group a single
    process makes for FSDP) is one process, every collective here the identity, and skipped."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _distributed() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if _distributed() else 1


def gather_calls() -> int:
    """How many times gather_with_grad ran in this process (the start-up check compares before and after)."""
    return _gathers


@contextlib.contextmanager
def uneven_rows():
    """Within it, gather_with_grad first exchanges every rank's number of rows (one small all-gather and one host
    read per call): an epoch's short last step in training (the plan marks it, Step.uneven) differs between
    ranks. Every other training step gives every rank as many rows, so its gathers
    skip that exchange and never wait on the host."""
    global _uneven
    before, _uneven = _uneven, True
    try:
        yield
    finally:
        _uneven = before


@contextlib.contextmanager
def alike_rows():
    """Within it, every rank holds the same rows (the evaluation's leftover samples, evaluated alike on every rank
    and counted once): gather_with_grad is then the tensor itself, the global batch one process would hold."""
    global _alike
    before, _alike = _alike, True
    try:
        yield
    finally:
        _alike = before


def gather_with_grad(tensor: torch.Tensor, return_offset: bool = False):
    """Every rank's `tensor`, concatenated along the first dimension in rank order, with gradients flowing back to
    each rank's own rows: what a loss over the global batch needs (NT-Xent with negatives from every rank).

    The backward sums the gradient of the concatenation over the ranks, then takes this rank's rows: every rank's
    loss may read every rank's rows, and each contribution reaches the rank that owns them. With DDP averaging the
    ranks' parameter gradients, a loss that every rank computes alike over the whole gathered batch (or one whose
    mean over the ranks is that loss: each rank's share of the anchors) then gets exactly the gradient one process
    gets from the whole batch; no scaling by the world size is needed or wanted.

    Without a process group (one process, the start-up check), or inside alike_rows() (evaluation's leftovers), it is
    the tensor itself. With `return_offset`, returns (gathered, offset): this rank's rows are gathered[offset :
    offset + len(tensor)]. The trailing dimensions must agree on every rank; the rows may differ only inside
    uneven_rows() (the training steps whose micro-batches differ in length between the ranks: an epoch's short last
    step; the evaluation gives every rank the same rows)."""
    global _gathers
    _gathers += 1
    if not _distributed() or _alike:
        return (tensor, 0) if return_offset else tensor
    if tensor.dim() == 0:
        raise ValueError("gather_with_grad gathers rows: give it a tensor of at least one dimension")
    rows = len(tensor)
    sizes = [rows] * dist.get_world_size()
    if _uneven:
        sizes = _row_counts(rows, tensor.device)
    if max(sizes) == 0:  # no rank has a row (the start-up check's empty batch on the device): nothing to send
        return (tensor, 0) if return_offset else tensor
    gathered = _Gather.apply(tensor, sizes)
    offset = sum(sizes[: dist.get_rank()])
    return (gathered, offset) if return_offset else gathered


class _Gather(torch.autograd.Function):
    """all_gather whose backward all-reduces (sums) the gradient of the whole concatenation, then slices."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        longest = max(sizes)
        padded = tensor.contiguous()
        if len(tensor) < longest:  # all_gather moves equal shapes: pad to the longest, cut after
            padded = torch.cat([padded, padded.new_zeros((longest - len(tensor), *tensor.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        rank = dist.get_rank()
        ctx.start, ctx.stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # reduced in place: never the buffer autograd handed us
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start : ctx.stop], None
