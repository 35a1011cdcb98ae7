"""The gradient noise scale (McCandlish et al., 2018, "An Empirical Model of Large-Batch Training", appendix A.1),
measured in every run that sees two batch sizes in each step: the noise scale B_simple = tr(Sigma) / |G|^2 says
about how large a batch can usefully be (larger ones buy fewer steps only at more samples).

Each optimizer step gives a small batch's gradient (B_small samples) and the step's gradient (B_big):
    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
both unbiased; each is averaged over steps (an exponential moving average, bias-corrected) before the ratio is
taken, as the paper does. An untraced run measures every K-th optimizer step (--noise-scale-every K, by the global
step: a resumed run measures the same steps), and the averages are over those: a step's measurement costs a few small
operations per parameter, which on a small model is several per cent of the step; on the others the small batches
are not read at all (DDP reduces and one process accumulates as without the estimator).
|G_small|^2 is the mean over the step's small batches:
- under DDP (2+ processes), each rank's gradient before the all-reduce (read by hooks on the parameters in a
  measured step's last backward: no extra pass, no extra collective, DDP's own reduction), B_small its samples in
  the step;
- in one process with accumulation, each micro-batch's gradient (kept apart as it is computed), B_small its
  samples;
- in a traced run (--batch-trace), each micro-batch's gradient on every rank, its squared norm summed over the
  ranks in the step's one all-reduce (distributed/trace_reduction.py), so every rank's averages are the same.
The batch sizes are counted in the units the loss averages over: samples, or what the task's units() counts (tokens,
labels), whose counts stay device tensors; Sigma is then the covariance of one unit's gradient, and the noise scale
is in units. Everything stays on the device: no host sync in a step. The per-rank averages are linear in
|G_small|^2, so the ranks' moving averages are averaged once, at the end of the epoch, inside the epoch's one
all-reduce.
"""

from __future__ import annotations

import torch

from ddp_tricks.distributed.collectives import broadcast_floats
from ddp_tricks.distributed.trace_reduction import squared_norm, squared_norms

BETA = 0.99  # the moving average's weight: about the last 100 steps


class NoiseScale:
    """The moving averages of the two unbiased estimates, on the device. A step gives its small batches'
    squared gradient norms (`small`: RankGradient's or MicroBatches'), then the step's own (`big`), which enters the
    averages."""

    def __init__(self, device: torch.device, beta: float = BETA, every: int = 1):
        self.beta = beta
        self.every = every  # measure on the optimizer steps whose global step (before it) is a multiple of this
        self.measuring = True  # whether the step under way is one of them (set by `at_step`)
        zeros = dict(dtype=torch.float64, device=device)
        self._state = torch.zeros(3, **zeros)  # [averages, weight]: a step moves all three in one operation
        self.averages = self._state[:2]  # the moving averages of [tr(Sigma), |G|^2], not yet corrected
        self.weight = self._state[2]  # what the averages' weights sum to: their bias correction
        self._zero, self._one = torch.zeros((), **zeros), torch.ones((), **zeros)
        self._rate = torch.full((), 1 - beta, **zeros)  # a step's weight in the averages
        self._small_sum = self._zero  # this step's small batches' squared norms, summed
        self._small_count = 0
        self._small_size: int | torch.Tensor = 0
        self._coefficients: dict[tuple, torch.Tensor] = {}

    def at_step(self, global_step: int) -> bool:
        """Whether the optimizer step after `global_step` steps is measured (a host integer: no sync)."""
        self.measuring = global_step % self.every == 0
        return self.measuring

    def small(self, sq_norm: torch.Tensor, size: int | torch.Tensor, count: int = 1) -> None:
        """One small batch's squared gradient norm (the gradient of its mean loss), and its size; or `count` small
        batches' squared norms summed, and their sizes summed. A size is counted in the units the loss averages over:
        samples (a number the plan knows), or the task's units() (a device tensor: read by no one on the host)."""
        sq_norm = sq_norm.to(torch.float64)
        self._small_sum = sq_norm if self._small_count == 0 else self._small_sum + sq_norm  # 0 + x is x: no add
        self._small_count += count
        self._small_size = self._small_size + size

    def big(self, sq_norm: torch.Tensor, size: int | torch.Tensor) -> None:
        """The step's squared gradient norm (the mean over all its `size` samples, or units): the step's estimates
        enter the averages, unless one is not finite (an fp16 overflow). A step with no small batch smaller than
        itself leaves them as they are."""
        count, small_size, small_sum = self._small_count, self._small_size, self._small_sum
        self._small_sum, self._small_count, self._small_size = self._zero, 0, 0
        if count == 0:
            return
        stacked = torch.stack([small_sum, sq_norm.to(torch.float64), self._one])  # the 1: the weight's target
        if isinstance(small_size, torch.Tensor) or isinstance(size, torch.Tensor):  # units: on the device, no sync
            b_small, b_big = (torch.as_tensor(v).to(self.averages.device, torch.float64) for v in (small_size, size))
            b_small = b_small / count
            inverse = 1 / b_small - 1 / b_big
            trace_of = torch.stack([1 / count / inverse, -1 / inverse, self._zero])
            grad_sq_of = torch.stack([-b_small / count / (b_big - b_small), b_big / (b_big - b_small), self._zero])
            targets = torch.stack([trace_of, grad_sq_of, torch.stack([self._zero, self._zero, self._one])]) @ stacked
            smaller = (b_small < b_big).to(torch.float64)
        else:
            if small_size >= count * size:
                return
            # both estimates are linear in (sum of the small batches' |G_small|^2, |G_big|^2): one product gives them
            # and the weight's target 1, its coefficients made once per (small batches, samples) on the device (no
            # copy from the host per step)
            key = (count, small_size, size)
            coefficients = self._coefficients.get(key)
            if coefficients is None:
                b_small, b_big = small_size / count, float(size)
                trace_of = [1 / count / (1 / b_small - 1 / b_big), -1 / (1 / b_small - 1 / b_big), 0.0]
                grad_sq_of = [-b_small / count / (b_big - b_small), b_big / (b_big - b_small), 0.0]
                coefficients = torch.tensor([trace_of, grad_sq_of, [0.0, 0.0, 1.0]], dtype=torch.float64,
                                            device=self.averages.device)  # fmt: skip
                self._coefficients[key] = coefficients
            targets = coefficients @ stacked
            smaller = self._one
        # [estimates, 1] enter [averages, weight] with weight 1 - beta; 0 for a step left out (fp16 overflow, or units
        # that leave no small batch smaller): no sync
        keep = torch.where(torch.isfinite(targets).all(), self._rate, self._zero)
        if smaller is not self._one:
            keep = keep * smaller
        self._state.lerp_(torch.nan_to_num(targets, nan=0.0, posinf=0.0, neginf=0.0), keep)

    def corrected(self) -> torch.Tensor:
        """[tr(Sigma), |G|^2] on the device, bias-corrected (zeros before the first step)."""
        return self.averages / self.weight.clamp(min=1e-300)

    def agreed_scale(self, units_per_sample: float = 1.0) -> float:
        """The noise scale measured so far, in samples (nan before any step), rank 0's on every rank, so that every
        rank decides alike (a broadcast and a host sync: at an epoch's start, never in a step). Measured in the task's
        units, it is divided by `units_per_sample` (rank 0's last epoch's): a batch of b samples holds about that
        many times b units."""
        ratio = torch.full((1,), float(units_per_sample), dtype=torch.float64, device=self.averages.device)
        trace, grad_sq, ratio = broadcast_floats(torch.cat([self.corrected(), ratio]))
        return trace / grad_sq / ratio if grad_sq > 0 and ratio > 0 else float("nan")

    def packed(self) -> torch.Tensor:
        """[averages, weight]: what a checkpoint keeps, one row per rank."""
        return torch.cat([self.averages, self.weight.reshape(1)])

    def unpack(self, row: torch.Tensor) -> None:
        self.averages.copy_(row[:2])
        self.weight.copy_(row[2])


def report(corrected_sums: list[float], world_size: int) -> dict[str, float]:
    """The epoch's columns from the ranks' summed corrected averages: tr(Sigma), |G|^2 and their ratio."""
    trace, grad_sq = (value / world_size for value in corrected_sums)
    scale = trace / grad_sq if grad_sq > 0 else float("nan")
    return {"noise_scale": scale, "grad_noise_trace": trace, "grad_sq_norm": grad_sq}


class RankGradient:
    """Under DDP: this rank's gradient before the all-reduce as the step's small batch. On a measured step a hook on
    each parameter sees its gradient in the step's last backward before it is accumulated into `.grad` (so before
    DDP's reducer, which reads it from there), added to what the step's earlier micro-batches left in `.grad` (under
    `no_sync()`: this rank's alone); the hooks are removed after that backward. So DDP reduces as it does without the
    estimator, on every step (its own all-reduce, no Python communication hook), and a step not measured costs
    nothing. A parameter this rank did not use in the last micro-batch keeps what its earlier ones gave."""

    def __init__(self, noise: NoiseScale, params: list[torch.Tensor]):
        self.noise = noise
        self.params = params
        self._handles: list = []
        self._earlier: torch.Tensor | None = None  # |.grad|^2 by parameter before the last backward (accumulation)
        self._seen: dict[int, torch.Tensor] = {}  # |this rank's gradient| by parameter's place, from the hooks
        self._weight: float | torch.Tensor = 0.0  # what the micro-batches' mean losses were multiplied by, summed
        self._size: int | torch.Tensor = 0  # their samples (or units)
        self._readers = [self._reader(i, p) for i, p in enumerate(params)]

    def before_backward(self, last: bool) -> None:
        """Before a micro-batch's backward: the step's last one is watched."""
        if not last:
            return
        grads = [p.grad for p in self.params]
        if any(g is not None for g in grads):  # earlier micro-batches under no_sync(): this rank's so far
            zeros = [torch.zeros((), device=p.device) if g is None else g for p, g in zip(self.params, grads)]
            self._earlier = squared_norms(zeros)
        self._handles = [p.register_hook(read) for p, read in zip(self.params, self._readers)]

    def _reader(self, place: int, param: torch.Tensor):
        def read(grad: torch.Tensor) -> None:  # before accumulation: `param.grad` holds the earlier micro-batches'
            local = grad if param.grad is None else param.grad + grad
            self._seen[place] = torch.linalg.vector_norm(local, dtype=torch.float32)  # one op: squared at the end

        return read

    def after_backward(self, weight, size, scale) -> None:
        """After a micro-batch's backward (`weight` multiplied its mean loss, `scale` the loss: fp16's, or 1; `size`:
        its samples, or units); after the last, this rank's gradient (its squared norm by parameter, summed in their
        order), divided by the summed weights (and the loss scale): the mean over this rank's samples."""
        self._weight = self._weight + weight
        self._size = self._size + size
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        seen, count = self._seen, len(self.params)
        if len(seen) == count:  # every parameter read (the usual case): the norm of their norms, squared
            norms = torch.stack([seen[i] for i in range(count)])
            total = torch.linalg.vector_norm(norms, dtype=torch.float64).square()
        else:  # some parameter not used in the last micro-batch: its earlier micro-batches' (or nothing)
            parts = self._earlier
            if parts is None:
                parts = torch.zeros(count, dtype=torch.float64, device=self.noise.averages.device)
            if seen:
                places = sorted(seen)
                norms = torch.stack([seen[i] for i in places]).to(parts.device, torch.float64)
                parts = parts.index_copy(0, torch.tensor(places, device=parts.device), norms.square_())
            total = parts.sum()
        self.noise.small(_divided(total, (self._weight * scale) ** 2), self._size)
        self._earlier, self._seen, self._weight, self._size = None, {}, 0.0, 0

    def finish(self) -> None:
        """Nothing to put back: DDP reduced the gradients in place."""


class MicroBatches:
    """One process with accumulation: each micro-batch's gradient kept apart as it is computed (its squared norm
    taken, then added into a buffer of the step's), so the micro-batches are the small batches."""

    def __init__(self, noise: NoiseScale, params: list[torch.Tensor]):
        self.noise = noise
        self.params = params
        self._sums: list[torch.Tensor] | None = None

    def before_backward(self, last: bool) -> None:
        """Nothing before a backward: each is read after it."""

    def after_backward(self, weight, size, scale) -> None:
        """After a micro-batch's backward: `weight` multiplied its mean loss, `scale` the loss (fp16's, or 1), `size`:
        its samples, or units. A parameter no micro-batch gave a gradient keeps None (an optimizer then leaves it as
        it is)."""
        grads = [p.grad for p in self.params]
        present = [g for g in grads if g is not None]
        if present:
            self.noise.small(_divided(squared_norm(present), (weight * scale) ** 2), size)
        if self._sums is None:
            self._sums = grads
        else:
            both = [(s, g) for s, g in zip(self._sums, grads) if s is not None and g is not None]
            if both:
                torch._foreach_add_([s for s, _ in both], [g for _, g in both])
            self._sums = [s if s is not None else g for s, g in zip(self._sums, grads)]
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """The step's gradient back into p.grad."""
        if self._sums is not None:
            for p, g in zip(self.params, self._sums):
                p.grad = g
        self._sums = None


def measure(noise: NoiseScale, params, batch, loss_scale) -> None:
    """The end of a step's backward passes: its small batches (this rank's gradient, or the micro-batches, already
    in) and its gradient over `batch` samples (or units: a device tensor), into the averages."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        noise.big(_divided(squared_norm(grads), loss_scale**2), batch)


def _divided(value: torch.Tensor, by) -> torch.Tensor:
    """`value / by`, with no operation where `by` is the number 1 (an unscaled loss's whole step: x / 1 is x)."""
    return value if type(by) in (int, float) and by == 1 else value / by
