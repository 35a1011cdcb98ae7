"""Model EMA (`--model-ema DECAY`), as timm's ModelEmaV3 keeps it: a copy of the model's state beside the optimizer,
moved toward the model's after every optimizer step, `ema = decay * ema + (1 - decay) * model` for every float
tensor (parameters and float buffers, with one `torch._foreach_lerp_`), integer tensors copied; `--model-ema-warmup`
uses `min(decay, (1 + u) / (10 + u))` at update u (0, 1, ...), so the first steps are not frozen to the initial
weights. The decay is a host float: no host sync. Under FSDP the copy is of the shards (DTensors like the
parameters): each rank updates the slices it holds, with no collective. Evaluated by the same evaluation with its
weights swapped into the model (`swapped_in`), saved in the same checkpoint state (`state_dict`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ddp_tricks.distributed.mesh import Mesh
from ddp_tricks.shards import is_dtensor, local


class ModelEma:
    """The EMA of `model.state_dict()` (the unwrapped model, possibly sharded on `mesh`, the run's built one: whole
    weights loaded into the EMA are cut to its slices); `update(model)` once per optimizer step that was taken."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False, mesh: Mesh | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"Invalid decay: {decay} (must be in (0, 1))")
        self.decay = decay
        self.warmup = warmup
        self.mesh = mesh
        self.updates = 0  # EMA updates so far: the optimizer steps taken since the EMA began
        with torch.no_grad():
            self.weights = {name: value.detach().clone() for name, value in model.state_dict().items()}

    def decay_at(self, updates: int) -> float:
        """The decay of update number `updates` (0-based): the flag's, or during warmup less."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + updates) / (10 + updates))

    def _pairs(self, model: nn.Module) -> tuple[list, list, list, list]:
        """(EMA floats, model floats, EMA others, model others): this rank's slices, entry by entry."""
        live = model.state_dict()
        ema_floats, live_floats, ema_others, live_others = [], [], [], []
        for name, mine in self.weights.items():
            if mine.is_floating_point():
                ema_floats.append(local(mine))
                live_floats.append(local(live[name]))
            else:
                ema_others.append(local(mine))
                live_others.append(local(live[name]))
        return ema_floats, live_floats, ema_others, live_others

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step toward `model`'s current state."""
        ema_floats, live_floats, ema_others, live_others = self._pairs(model)
        if ema_floats:
            torch._foreach_lerp_(ema_floats, live_floats, 1.0 - self.decay_at(self.updates))
        if ema_others:
            torch._foreach_copy_(ema_others, live_others)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module):
        """The model holds the EMA's weights inside the context, its own again after (exactly: copies). A sharded
        model's gathered parameters are freed first, so that its next forward gathers the slices now in place."""
        _free_gathered(model)
        with torch.no_grad():
            ema_floats, live_floats, ema_others, live_others = self._pairs(model)
            live, ema = live_floats + live_others, ema_floats + ema_others
            kept = [t.clone() for t in live]
            torch._foreach_copy_(live, ema)
        try:
            yield
        finally:
            _free_gathered(model)
            with torch.no_grad():
                torch._foreach_copy_(live, kept)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the settings, the update count and the weights (DTensors under FSDP)."""
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates, "weights": dict(self.weights)}

    def load_state_dict(self, state: dict | None, model: nn.Module) -> None:
        """A checkpoint's EMA (its weights cut to this run's shards already); a checkpoint without one (a run
        that had no --model-ema) starts the EMA from the model's weights as resumed."""
        with torch.no_grad():
            source = model.state_dict() if state is None else state["weights"]
            for name, mine in self.weights.items():
                local(mine).copy_(local(_as_slice(source[name], mine, self.mesh)))
        self.updates = 0 if state is None else int(state["updates"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The EMA's whole weights on the CPU (sharded ones gathered from every rank: a collective)."""
        return {k: (v.full_tensor() if is_dtensor(v) else v).detach().cpu() for k, v in self.weights.items()}

    def describe(self) -> str:
        return f"the EMA of the weights, decay {self.decay:g}{' with warmup' if self.warmup else ''}"


def _as_slice(value: torch.Tensor, like: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
    """`value` as `like` holds it: a whole tensor (a sharded run's best.pt, the same on every rank) as a DTensor laid
    on `mesh` as FSDP lays a parameter (None: as `like` is laid), whose local slice is this rank's."""
    if not is_dtensor(like) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    grid, placements = (like.device_mesh, like.placements) if mesh is None else (mesh.device_mesh, mesh.placements)
    return distribute_tensor(value.to(like.device), grid, placements)  # a collective: every rank


def _free_gathered(model: nn.Module) -> None:
    """FSDP2 keeps the root's gathered parameters after a forward without backward (an evaluation): free them, so
    that weights written into the slices are what the next forward gathers. Nothing for an unsharded model."""
    from ddp_tricks.distributed.fsdp import free_gathered

    free_gathered(model)
