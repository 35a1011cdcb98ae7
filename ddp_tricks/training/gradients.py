"""How a step's gradients reach every rank, chosen once when the run is built: by the wrapper (DDP's reducer in the
backward, the sparse tables' gradients averaged apart, FSDP's whole 0-d parameters averaged after it; the noise
scale read from what DDP already has), or by a traced / unevenly shared run's own reduction after its last backward
(trace_reduction.py, with AdaScale's gain). The step calls `after_backward` and `finish` without asking which.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks.distributed.fsdp import replicated_of
from ddp_tricks.distributed.sparse import SparseGradients
from ddp_tricks.distributed.trace_reduction import TraceReduction
from ddp_tricks.training import noise as noise_scale


class ByWrapper:
    """DDP or FSDP reduces the gradients in the backward: every rank's micro-batch weights are a share of the mean
    over the ranks (`averaged`). After the last backward: the sparse tables (`sparse`), FSDP's whole 0-d parameters,
    and on a measured step the noise scale's big batch (`noise`)."""

    averaged = True
    adascale = None
    traced = None

    def __init__(self, model: nn.Module, params: list[torch.Tensor], sparse: SparseGradients | None = None, noise=None):
        self.model, self.params, self.sparse, self.noise = model, params, sparse, noise
        self.replicated = replicated_of(model)  # --strategy fsdp: the 0-d parameters kept whole (None: none)

    def start_step(self, global_step: int) -> None:
        """Before step `global_step` + 1: whether the noise scale measures it (every --noise-scale-every steps)."""
        if self.noise is not None:
            self.noise.at_step(global_step)

    def after_backward(self, weight) -> None:
        """Nothing: the wrapper's hooks reduce in the backward."""

    def finish(self, samples: int, units, loss_scale) -> float:
        """After the step's last backward (`samples` in the step, `units` over every rank). AdaScale's gain: 1."""
        if self.sparse is not None:
            self.sparse.reduce()
        if self.replicated is not None:
            self.replicated.reduce()  # their gradients averaged over the ranks
        if self.noise is not None and self.noise.measuring:
            noise_scale.measure(self.noise, self.params, units, loss_scale)
        return 1.0


class Traced:
    """A traced run, or uneven shares: ranks run different numbers of backwards, so the run sums each micro-batch's
    gradient itself and reduces once after the last (`traced`: trace_reduction.TraceReduction)."""

    averaged = False

    def __init__(self, traced: TraceReduction):
        self.traced = traced
        self.adascale = traced.adascale

    def start_step(self, global_step: int) -> None:
        """Nothing: a traced run measures the noise scale at every step."""

    def after_backward(self, weight) -> None:
        self.traced.after_backward(weight)

    def finish(self, samples: int, units, loss_scale) -> float:
        """The step's gradients reduced (and its noise scale measured); AdaScale's gain, or 1."""
        return self.traced.finish(samples, loss_scale, units=units)
