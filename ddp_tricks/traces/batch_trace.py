"""Variable batch size from a trace: the global batch of every optimizer step comes from a CSV file (or a list),
the step's samples are cut into micro-batches dealt round-robin to the ranks, and the update uses the exact
mean gradient over the step's samples, with linear / root / AdaScale learning-rate rules.

How an epoch is cut: step i takes the next B_i samples of the epoch's permutation (seeded by seed + epoch).
A step that would run past the end of the epoch is not taken: the remaining samples (fewer than B_i) are left
out of that epoch, and the next epoch starts with trace step i.

`--batch-trace auto` writes the trace as it goes: at each epoch's start the global batch grows towards the
gradient noise scale measured so far (`next_batch`), and the rows it used are written to the run folder's
batch_trace.csv, which `--batch-trace FILE` replays.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_tricks.errors import UserError
from ddp_tricks.storage import files
from ddp_tricks.training.noise import squared_norm


def lr_factor(rule: str, batch: float, ref_batch: float) -> float:
    """The one LR-scaling rule, for --lr-scaling and --batch-lr-rule alike: x1 (keep, none), x batch / ref
    (linear), x sqrt(batch / ref) (sqrt, root)."""
    if rule in ("keep", "none", "adascale"):
        return 1.0
    if rule == "linear":
        return batch / ref_batch
    if rule in ("sqrt", "root"):
        return math.sqrt(batch / ref_batch)
    raise ValueError(f"unknown LR scaling rule {rule!r}")


class Trace(list):
    """Batch sizes by step (a list of ints) that remembers where each one is in its file, for messages:
    `where[i]` is e.g. "'trace.csv' line 5 (step 3)" (line 1 is the header; the step is the file's own)."""

    def __init__(self, sizes: list[int], where: list[str]):
        super().__init__(sizes)
        self.where = where


def load_trace(source: str | Path | list[int] | int) -> list[int]:
    """Batch sizes by step from a CSV (`step,batchsize` or a single `batchsize` column), a list, or one int.
    From a file, the list is a `Trace` that names each row's line (and step) for check_trace's messages."""
    if isinstance(source, int):
        return [source]
    if isinstance(source, (list, tuple)):
        return [int(b) for b in source]
    path = Path(source)
    name = repr(str(path))
    if not path.is_file():
        raise UserError(f"--batch-trace {name} does not exist: give a CSV with a header `step,batchsize`")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if "batchsize" not in header:
            raise UserError(f"{name} line 1: expected a header with a `batchsize` column (e.g. `step,batchsize`)")
        column = header.index("batchsize")
        step_column = header.index("step") if "step" in header else None
        sizes, where = [], []
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            here = f"{name} line {reader.line_num}"
            if step_column is not None and step_column < len(row) and row[step_column].strip():
                here += f" (step {row[step_column].strip()})"
            try:
                sizes.append(int(row[column]))
            except (ValueError, IndexError):
                raise UserError(f"{here}: {','.join(row)!r} has no integer batch size") from None
            where.append(here)
    if not sizes:
        raise UserError(f"{name} has no rows: give one batch size per optimizer step")
    return Trace(sizes, where)


def check_trace(trace: list[int], micro_batch: int, where: list[str] | None = None) -> None:
    """Every batch size a positive multiple of the micro-batch. `where[i]` names row i in the message
    (default: a Trace's own, else "trace step i")."""
    where = where if where is not None else getattr(trace, "where", None)
    for step, batch in enumerate(trace):
        if batch < 1 or batch % micro_batch:
            label = where[step] if where is not None else f"trace step {step}"
            raise UserError(
                f"{label}: batch size {batch} is not a positive multiple of the micro-batch "
                f"(--batch-size {micro_batch})"
            )


def write_trace(path: Path, sizes: list[int]) -> None:
    """The batch of every step so far as a CSV `step,batchsize` (steps from 1), which load_trace reads back;
    written atomically (a reader, or a run resumed after a crash, never sees half a file)."""
    rows = "".join(f"{step},{batch}\n" for step, batch in enumerate(sizes, start=1))
    files.write_text(path, "step,batchsize\n" + rows)


def next_batch(noise_scale: float, batch: int, unit: int, ceiling: int) -> int:
    """--batch-trace auto's rule, at an epoch's start: the global batch grows to the measured gradient noise scale
    (McCandlish et al.'s critical batch, where a step costs about twice the fewest samples and takes about twice
    the fewest steps), rounded down to a multiple of `unit` (the micro-batch x the processes), when that is larger
    than `batch`: at most twice `batch` at a time, at most `ceiling`, never smaller (a noisy estimate does not
    shrink it back)."""
    if not math.isfinite(noise_scale) or noise_scale <= batch:
        return batch
    target = min(noise_scale, 2 * batch, ceiling)
    return max(batch, int(target // unit) * unit)


def batch_at(trace: list[int], step: int, repeat_last: bool) -> int | None:
    if step < len(trace):
        return trace[step]
    return trace[-1] if repeat_last else None


def epoch_steps(
    num_samples: int, trace: list[int], first_step: int, seed: int, epoch: int, repeat_last: bool
) -> list[tuple[int, torch.Tensor]]:
    """The epoch's steps: (trace step, the sample indices of its global batch)."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    steps, position, step = [], 0, first_step
    while True:
        batch = batch_at(trace, step, repeat_last)
        if batch is None or position + batch > num_samples:
            return steps
        steps.append((step, order[position : position + batch]))
        position += batch
        step += 1


def steps_needed(num_samples: int, trace: list[int], epochs: int, seed: int) -> int:
    """How many trace rows a run of `epochs` uses (each epoch as far as the trace, repeated last, reaches)."""
    step = 0
    for epoch in range(1, epochs + 1):
        step += len(epoch_steps(num_samples, trace, step, seed, epoch, repeat_last=True))
    return step


def deal(indices: torch.Tensor, micro_batch: int, world_size: int, rank: int) -> list[torch.Tensor]:
    """Cut a global batch into micro-batches and deal them round-robin: micro-batch j goes to rank j % world."""
    chunks = indices.split(micro_batch)
    return [chunk for j, chunk in enumerate(chunks) if j % world_size == rank]


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


def reduce_gradients(params: list[torch.Tensor], grads: list[torch.Tensor], sq_norms, adascale: AdaScale | None,
                     micro_batches: int, noise=None, batch: int = 0, loss_scale=1.0) -> float:  # fmt: skip
    """The end of a trace step, on every rank: one all-reduce (one per gradient dtype) sums each rank's share of the
    step's mean gradient in the gradients' own dtype (every rank takes part, also one with no micro-batch, which adds
    exactly zero); for AdaScale or the noise scale, one more all-reduce of one float64 sums the micro-batch
    gradients' squared norms; `p.grad` becomes the sum. The noise scale (`noise`) takes the step's micro-batches as
    its small batches and the step's `batch` samples as its big one, the same on every rank, on the device. Returns
    AdaScale's gain (one host sync), or 1."""
    apart = adascale is not None or noise is not None
    if apart and not isinstance(sq_norms, torch.Tensor):  # a rank with no micro-batch: a fill, no host copy
        sq_norms = torch.full((), float(sq_norms), dtype=torch.float64, device=params[0].device)
    extras = [sq_norms.to(torch.float64).reshape(1)] if apart else []
    if dist.is_available() and dist.is_initialized():
        for dtype in dict.fromkeys(g.dtype for g in grads):  # a flat buffer per dtype: torch.cat would promote
            _all_reduce_flat([g for g in grads if g.dtype == dtype])
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


def _all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum tensors of one dtype across ranks in place, in one all-reduce of one flat buffer of that dtype."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


class TraceReduction:
    """A traced run's gradient reduction, in place of DDP's (the model is not DDP-wrapped): each rank's
    micro-batch losses are divided by the step's global batch B and their gradients summed, then summed across
    ranks: the exact mean gradient over the B samples, however unevenly the ranks hold them."""

    def __init__(self, params: list[torch.Tensor], micro_batch: int, adascale: AdaScale | None = None, noise=None):
        self.params = params
        self.micro_batch = micro_batch
        self.adascale = adascale
        self.noise = noise  # the gradient noise scale's estimator (training/noise.py), or None
        self._accumulated: list[torch.Tensor] | None = None
        self._sq_norms = 0.0

    def after_backward(self, weight: float | torch.Tensor) -> None:
        """With AdaScale or the noise scale, each micro-batch's gradient is kept apart for its squared norm; else
        grads accumulate. `weight`: what the micro-batch's mean loss was multiplied by (its share of the step: b / B
        samples, or its units over the step's)."""
        if self.adascale is None and self.noise is None:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        # the micro-batch's mean gradient g_j = grad / its share
        self._sq_norms = self._sq_norms + squared_norm(grads) / (weight * weight)
        if self._accumulated is None:
            self._accumulated = [torch.zeros_like(p) for p in self.params]
        torch._foreach_add_(self._accumulated, grads)
        for p in self.params:
            p.grad = None

    def finish(self, batch: int, loss_scale=1.0) -> float:
        """All-reduce the step's gradients into p.grad; return AdaScale's gain (or 1). `loss_scale`: fp16's, which
        the noise scale's squared norms are divided by."""
        if self._accumulated is not None:
            grads = self._accumulated
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        count = -(-batch // self.micro_batch)
        gain = reduce_gradients(self.params, grads, self._sq_norms, self.adascale, count, self.noise, batch, loss_scale)
        self._accumulated, self._sq_norms = None, 0.0
        return gain
