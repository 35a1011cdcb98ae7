"""A run's checkpointed state as named parts: each object a checkpoint keeps has `state_dict()` and
`load_state_dict(state)` (None: the checkpoint has no such part, it starts fresh), registered once under its name
(training/state.py's `Training.parts`); the objects that lack that pair (the model's weights, the EMA, the task, the
RNG, the noise scale, best and early stopping) are held here by small adapters.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from ddp_tricks.distributed.collectives import gather_objects, gather_to_host
from ddp_tricks.training.meter import resume_rows


class Absent:
    """A part this run does not have (no EMA, no noise scale, no AdaScale): saved as None, so every checkpoint has
    the same names; a checkpoint's is not loaded."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


class Needed:
    """An object whose `load_state_dict` needs a state (AdaScale, the schedule): a checkpoint without one (None, or
    written before the object existed) leaves it as built."""

    def __init__(self, holder):
        self.holder = holder

    def state_dict(self):
        return self.holder.state_dict()

    def load_state_dict(self, state) -> None:
        if state is not None:
            self.holder.load_state_dict(state)


class Weights:
    """The unwrapped model's state dict (sharded ones: DTensors, their slices filled before loading)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:
            self.model.load_state_dict(state)


class Ema:
    """--model-ema's weights; a checkpoint without them (a run that had no EMA) starts it from the loaded weights."""

    def __init__(self, ema, model: nn.Module):
        self.ema, self.model = ema, model

    def state_dict(self) -> dict:
        return self.ema.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.ema.load_state_dict(state, self.model)


class TaskState:
    """The task's own state (a DINO centre), rank 0's; None for a task without `state_dict()`."""

    def __init__(self, task):
        self.task = task

    def state_dict(self) -> dict | None:
        return self.task.state_dict() if callable(getattr(self.task, "state_dict", None)) else None

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and callable(getattr(self.task, "load_state_dict", None)):
            self.task.load_state_dict(state)


class Monitored:
    """The monitored metric's best so far and early stopping on it. A checkpoint that followed another metric leaves
    both fresh: this run's best is of its own metric."""

    def __init__(self, best, early_stopping=None):
        self.best, self.early_stopping = best, early_stopping

    def state_dict(self) -> dict:
        stopping = self.early_stopping.state_dict() if self.early_stopping is not None else None
        return self.best.state_dict() | {"early_stopping": stopping}

    def load_state_dict(self, state: dict | None) -> None:
        if not state or state.get("metric") != self.best.metric:
            return
        self.best.load_state_dict(state)
        if self.early_stopping is not None and state.get("early_stopping"):
            self.early_stopping.load_state_dict(state["early_stopping"])


class Noise:
    """The gradient noise scale's moving averages, every rank's (averaged into each rank at another world size)."""

    def __init__(self, noise, rank: int, world_size: int):
        self.noise, self.rank, self.world_size = noise, rank, world_size

    def state_dict(self) -> torch.Tensor:
        return gather_to_host(self.noise.packed())  # a collective

    def load_state_dict(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.noise.unpack(resume_rows(state, self.rank, self.world_size, mean=True))


class RandomStates:
    """Every rank's random generators (a collective to save). Loaded, this rank's are kept for a mid-epoch resume at
    the same world size (`pending`, set where the epoch restarts); another world size's ranks draw otherwise anyway."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.pending: list | None = None

    def state_dict(self) -> list:
        mine = rng_state()
        restore_rng(mine)  # set as a resume sets it: cuDNN's RNN dropout draws anew here, resumed or not (restore_rng)
        return gather_objects(mine)

    def load_state_dict(self, state: list | None) -> None:
        self.pending = state if state is not None and len(state) == self.world_size else None

    def resume(self, rank: int, mid_epoch: bool) -> None:
        """An epoch's start: in an epoch resumed mid-way, this rank's saved generators (once)."""
        if mid_epoch and self.pending is not None:
            restore_rng(self.pending[rank])
        self.pending = None


def rng_state() -> dict:
    """This process's random generators, as tensors and plain values (safe for weights_only loading)."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict) -> None:
    """Set this process's random generators to `state` (rng_state's). Setting torch's CUDA generator also makes
    cuDNN's RNN dropout draw its own dropout state anew from it at its next use (that state is not in `state`): so
    a checkpoint sets what it saves (RandomStates.state_dict), and the run it continues draws as the resumed one."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
