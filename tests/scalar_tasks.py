"""A task file with a 0-d parameter, as every CLIP port writes its learnable temperature
(`nn.Parameter(torch.tensor(2.0))`): `--task tests/scalar_tasks.py:Temperature` is the built-in digits task whose
logits are scaled by exp(temperature)."""

from __future__ import annotations

import torch
from hook_tasks import DinoCenter, NoisyViews
from torch import nn

from ddp_tricks import InMemoryDataset
from task import Task


class Scaled(nn.Module):
    """A model's logits times exp(temperature), the temperature a 0-d parameter of the root module."""

    def __init__(self, inner: nn.Module, start: float = 0.5):
        super().__init__()
        self.inner = inner
        self.temperature = nn.Parameter(torch.tensor(start))

    def forward(self, x):
        return self.inner(x) * self.temperature.exp()


class Temperature(Task):
    def model(self):
        return Scaled(super().model())


class CleanViews(NoisyViews):
    """Two copies of each digit, no noise: an evaluation that gives the same numbers every time."""

    def __getitems__(self, indices):
        images, labels = InMemoryDataset.__getitems__(self, indices)
        return torch.stack([images, images], 1), labels


class DinoCleanValidation(DinoCenter):
    """tests/hook_tasks.py's DINO centre (the task's own state, kept by its per-step hook), validated on clean
    views: what an --eval-only of best.pt reports must be the training run's row for that epoch."""

    def datasets(self):
        train, val = super().datasets()
        return train, CleanViews(val.inputs, val.targets)
