"""How we were launched (torchrun, torch.distributed.launch, plain python, several nodes), the device and
backend, process-group set-up and tear-down, and values reduced across ranks.
"""

from __future__ import annotations

import datetime
import os
import signal
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
    control_group: object | None = None  # a gloo group for CPU-side agreement (preemption)

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
            "launch at most that many processes per node or check CUDA_VISIBLE_DEVICES",
            rank_specific=True,
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
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun keeps one store across restarts; without a per-attempt prefix, a restarted rank can read the
    # address that a killed rank of the previous attempt published, and gloo then waits on a dead port.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"ddp_tricks/attempt_{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    control_group = dist.new_group(backend="gloo")  # its own queue: agreement never waits behind DDP's traffic
    return Dist(dist.get_rank(), dist.get_world_size(), launch.local_rank, device, backend, control_group)


def wrap(model: torch.nn.Module, dist_info: Dist, sync_bn: bool = False, **ddp_options) -> torch.nn.Module:
    """SyncBatchNorm (on request) and DistributedDataParallel, in a distributed run; the model as is otherwise."""
    if not dist_info.enabled:
        return model
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [dist_info.device] if dist_info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, **ddp_options
    )


_LIVE_PREEMPTIONS: list = []


def cleanup() -> None:
    """Leave the process group; safe to call on every path, twice, or with no group at all.

    An agreement still in flight is settled first: tearing a group down under pending work aborts the process.
    """
    while _LIVE_PREEMPTIONS:
        _LIVE_PREEMPTIONS.pop().close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank when it is true on any rank: one decision that no rank waits behind.

    With a gloo `group` the flag stays on the CPU, so asking costs no GPU synchronisation.
    """
    value = torch.tensor([1.0 if flag else 0.0], device="cpu" if group is not None else device)
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


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send, and torchrun forwards) asks every rank to stop together.

    `agreed()` runs after every step: it reads the previous step's all-reduced flag and starts the next
    all-reduce without waiting (a CPU collective on the gloo control group), so every rank decides on the
    same step while no step waits on the network. `agreed(final=True)` settles it synchronously.
    """

    def __init__(self, dist_info: Dist):
        self.requested = False
        self.group = dist_info.control_group
        self.enabled = dist_info.enabled
        self._pending = None
        self._value = None
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)
        _LIVE_PREEMPTIONS.append(self)

    def close(self) -> None:
        """Settle any agreement in flight and give SIGTERM its previous handler back."""
        try:
            self._settle()
        except Exception:  # a broken group: the error that broke it is already on its way up
            pass
        signal.signal(signal.SIGTERM, self._previous_handler)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def _start(self) -> None:
        self._value = torch.tensor([1.0 if self.requested else 0.0])
        self._pending = dist.all_reduce(self._value, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _settle(self) -> bool:
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._value.item() > 0)

    def agreed(self, final: bool = False) -> bool:
        if not self.enabled:
            return self.requested
        decided = self._settle()
        if final:
            self._start()
            return self._settle() or decided
        if not decided:
            self._start()
        return decided
