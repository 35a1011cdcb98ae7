"""A traced run's gradient reduction, in place of DDP's (--batch-trace, or a world size that leaves the plan's
shares uneven: the ranks hold different numbers of a step's micro-batches, some maybe none): each rank's share of
the step's mean gradient summed across ranks in DDP-sized buckets, with AdaScale's gain (Johnson et al., 2020) and the
noise scale's small batches read from the micro-batch gradients on the way. Here, below both the training loop and
the original trace API (traces/original_api.py), which reduce alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_tricks.distributed.stacks import waits_for


def squared_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """|g|^2 of each tensor, in float64 on the device (no host sync)."""
    norms = torch._foreach_norm([g.float() if g.dtype in (torch.float16, torch.bfloat16) else g for g in grads])
    return torch.stack(norms).to(torch.float64).square_()


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sum |g|^2 over tensors, on the device (no host sync)."""
    return squared_norms(grads).sum()


@dataclass
class AdaScale:
    """AdaScale's gain (Johnson et al., 2020) from the micro-batch gradients of a step, smoothed across steps.

    With S micro-batch gradients g_j (each the mean over b samples) and their mean g:
        sigma^2 = (sum_j ||g_j||^2 - S ||g||^2) / (S - 1)     (the micro-batch gradient variance, S >= 2)
        mu^2    = ||g||^2 - sigma^2 / S                       (the squared norm of the true gradient)
    both averaged with weight `theta` over steps; gain r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2).
    A step with S = 1 cannot estimate the variance: it keeps the smoothed estimates (r from them, or 1).
    """

    theta: float = 0.9
    sigma2: float | None = None
    mu2: float | None = None
    history: list = field(default_factory=list)

    def update(self, sum_sq_norms: float, mean_sq_norm: float, count: int) -> float:
        if count >= 2 and math.isfinite(sum_sq_norms) and math.isfinite(mean_sq_norm):
            sigma2 = max((sum_sq_norms - count * mean_sq_norm) / (count - 1), 0.0)
            mu2 = max(mean_sq_norm - sigma2 / count, 0.0)
            if self.sigma2 is None:
                self.sigma2, self.mu2 = sigma2, mu2
            else:
                self.sigma2 = self.theta * self.sigma2 + (1 - self.theta) * sigma2
                self.mu2 = self.theta * self.mu2 + (1 - self.theta) * mu2
        return self.gain(count)

    def gain(self, count: int) -> float:
        if self.sigma2 is None or self.sigma2 + self.mu2 <= 0:
            return 1.0
        return (self.sigma2 + self.mu2) / (self.sigma2 / count + self.mu2)

    def state_dict(self) -> dict:
        return {"theta": self.theta, "sigma2": self.sigma2, "mu2": self.mu2}

    def load_state_dict(self, state: dict) -> None:
        self.theta, self.sigma2, self.mu2 = state["theta"], state["sigma2"], state["mu2"]


BUCKET_MB = 25.0  # --bucket-cap-mb: DDP's default bucket


@waits_for("all_reduce")  # AdaScale's read of the summed norms: where nccl's host waits
def reduce_gradients(params: list[torch.Tensor], grads: list[torch.Tensor], sq_norms, adascale: AdaScale | None,
                     micro_batches: int, noise=None, batch: int = 0, loss_scale=1.0,
                     bucket_mb: float = BUCKET_MB) -> float:  # fmt: skip
    """The end of a trace step, on every rank: all-reduces of buckets of at most `bucket_mb` MiB (per gradient dtype,
    as DDP's buckets: torch.cat would promote) sum each rank's share of the step's mean gradient in the gradients' own
    dtype, in place (every rank takes part, also one with no micro-batch, which adds exactly zero); for AdaScale or
    the noise scale, one more all-reduce of one float64 sums the micro-batch gradients' squared norms; `p.grad`
    becomes the sum. The noise scale (`noise`) takes the step's micro-batches as its small batches and the step's
    `batch` samples (or units: a device tensor) as its big one, the same on every rank, on the device. Returns
    AdaScale's gain (one host sync), or 1."""
    apart = adascale is not None or noise is not None
    if apart and not isinstance(sq_norms, torch.Tensor):  # a rank with no micro-batch: a fill, no host copy
        sq_norms = torch.full((), float(sq_norms), dtype=torch.float64, device=params[0].device)
    extras = [sq_norms.to(torch.float64).reshape(1)] if apart else []
    if dist.is_available() and dist.is_initialized():
        for bucket in buckets(grads, int(bucket_mb * 2**20)):
            _all_reduce_flat(bucket)
        # apart from the gradients, in float64: AdaScale's variance is the difference of two near-equal sums
        for extra in extras:
            dist.all_reduce(extra)
    for p, g in zip(params, grads):
        p.grad = g
    if not apart:
        return 1.0
    mean_sq = squared_norm(grads)
    if noise is not None:
        noise.small(extras[0][0] / loss_scale**2, batch, count=micro_batches)
        noise.big(mean_sq / loss_scale**2, batch)
    if adascale is None:
        return 1.0
    sum_sq, mean_sq = torch.stack([extras[0][0], mean_sq]).tolist()  # the one host sync of the step
    return adascale.update(sum_sq, mean_sq, micro_batches)


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """The tensors in buckets of one dtype and at most `cap_bytes` each, in order (a tensor larger than the cap is a
    bucket of its own, reduced in place with no copy): DDP's bucketing, so a step's reduction holds one bucket more
    than the gradients, never a flat copy of them all."""
    found: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        open_bucket = found.setdefault(t.dtype, [[]])
        nbytes = t.numel() * t.element_size()
        if open_bucket[-1] and sizes[t.dtype] + nbytes > cap_bytes:
            open_bucket.append([])
            sizes[t.dtype] = 0
        open_bucket[-1].append(t)
        sizes[t.dtype] = sizes.get(t.dtype, 0) + nbytes
    return [bucket for per_dtype in found.values() for bucket in per_dtype]


def _all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum tensors of one dtype across ranks in place, in one all-reduce (of the tensor itself when it is alone and
    contiguous, else of one flat buffer of that dtype, copied back)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0])
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


class TraceReduction:
    """A traced (or unevenly shared) run's gradient reduction, in place of DDP's (the model is not DDP-wrapped): each
    rank's micro-batch losses are divided by the step's global batch B and their gradients summed, then summed across
    ranks: the exact mean gradient over the B samples, however unevenly the ranks hold them. With AdaScale or the
    noise scale, each micro-batch's gradient is read by a hook on each parameter as autograd hands it over, before it
    is added into `.grad` (its squared norm, on the device): no copy of the gradients is kept, so a step holds the
    gradients and one bucket of the reduction (`bucket_mb`, --bucket-cap-mb), as DDP does."""

    def __init__(self, params: list[torch.Tensor], micro_batch: int, adascale: AdaScale | None = None, noise=None,
                 slots: int = 0, bucket_mb: float = BUCKET_MB):  # fmt: skip
        self.params = params
        self.micro_batch = micro_batch
        self.slots = slots  # uneven shares: the micro-batches of every step (a short last one's too); 0: traced
        self.adascale = adascale
        self.noise = noise  # the gradient noise scale's estimator (training/noise.py), or None
        self.bucket_mb = bucket_mb
        self._sq_norms = 0.0
        self._seen: dict[int, torch.Tensor] = {}  # |a parameter's gradient| in this backward, by its place
        self._handles = [p.register_hook(self._reader(i)) for i, p in enumerate(params)] if self.apart else []

    @property
    def apart(self) -> bool:
        """Each micro-batch's gradient is read apart (AdaScale or the noise scale)."""
        return self.adascale is not None or self.noise is not None

    def _reader(self, place: int):
        def read(grad: torch.Tensor) -> None:  # this backward's gradient of the parameter, before it is accumulated
            self._seen[place] = torch.linalg.vector_norm(grad, dtype=torch.float32)

        return read

    def after_backward(self, weight: float | torch.Tensor) -> None:
        """With AdaScale or the noise scale, the micro-batch's squared norm (of the gradients its backward handed the
        hooks: a parameter it did not use adds none), divided by `weight`^2: the micro-batch's mean loss was
        multiplied by `weight` (its share of the step: b / B samples, or its units over the step's)."""
        if not self.apart:
            return
        if self._seen:
            norms = torch.stack(list(self._seen.values()))
            self._sq_norms = self._sq_norms + torch.linalg.vector_norm(norms, dtype=torch.float64).square() / (
                weight * weight
            )
        self._seen = {}

    def finish(self, batch: int, loss_scale=1.0, units=None) -> float:
        """All-reduce the step's gradients into p.grad; return AdaScale's gain (or 1). `loss_scale`: fp16's, which
        the noise scale's squared norms are divided by; `units`: the step's units over every rank (the task's
        units(), a device tensor), the noise scale's batch sizes (default: the `batch` samples)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        count = self.slots or -(-batch // self.micro_batch)
        big = batch if units is None else units
        gain = reduce_gradients(
            self.params, grads, self._sq_norms, self.adascale, count, self.noise, big, loss_scale, self.bucket_mb
        )
        self._sq_norms = 0.0
        return gain
