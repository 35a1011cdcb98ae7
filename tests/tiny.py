"""Small pieces for tests: a minimal classification task and a Training around any model and optimizer."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ddp_tricks.data import loaders as data
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training.meter import EpochMeter
from ddp_tricks.training.metric_states import Layout
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

CPU = torch.device("cpu")


class Classify:
    """Cross-entropy and top-1 accuracy: what task.Task does, without its datasets."""

    better = {"acc": "max"}
    monitor = "loss"

    def loss(self, outputs, targets):
        return nn.functional.cross_entropy(outputs, targets)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(1) == targets).sum()}


def training(model, optimizer, schedule=None, amp="off", **options) -> Training:
    schedule = schedule or Schedule(WarmupDecay(optimizer, 0, 0))
    return Training(model, optimizer, schedule, Classify(), ["acc"], Precision(amp, CPU), CPU, **options)


def retask(t: Training, task, sum_names: list[str]) -> None:
    """`t` training `task`, whose metric_sums() gives `sum_names`: a new epoch meter for them."""
    t.task = task
    t.meter = EpochMeter(Layout.scalars(sum_names), t.device, t.rank, t.world_size)
    t.parts["epoch_sums"] = t.meter


def together_loader(dataset, world_size: int, batch_size: int):
    """One process's validation loader of the global batches that `world_size` ranks evaluate together at
    `batch_size` (each round's rows of every rank, then the leftovers once): the reference for a loss or metric over
    the global batch. `dataset` in memory (its batches as __getitems__ builds them)."""
    from torch.utils.data import DataLoader

    batches = data.global_batches(len(dataset), world_size, batch_size)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=_as_is)


def _as_is(batch):
    return batch


def loader_for(dataset, steps, rank=0, first_step=0):
    """The training loader of run.py, pointed at `steps` (a plan's epoch)."""
    loader = data.train_loader(dataset, rank, CPU, seed=0)
    loader.batch_sampler.start(steps, first_step)
    return loader


class RandomStates:
    """What happens to torch's random state around a model's forwards, watched with nothing replaced: every call of
    torch.set_rng_state (a profile hook, `sys.setprofile`) and the state each forward starts from (a pre-hook), in
    order, as ("set", state) and ("forward", state)."""

    def __init__(self, model: nn.Module | None = None):
        self.events: list[tuple[str, torch.Tensor]] = []
        if model is not None:
            model.register_forward_pre_hook(lambda *_: self.events.append(("forward", torch.get_rng_state())))

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code is torch.random.set_rng_state.__code__:
            self.events.append(("set", frame.f_locals["new_state"].clone()))

    def __enter__(self) -> RandomStates:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
