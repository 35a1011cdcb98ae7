"""Task files for what docs/tasks.md says a task may do: activation checkpointing in its model (`Checkpointed`;
$NO_CHECKPOINT=1: the same model without it), and randomness in its loss drawn per sample from a generator seeded
by the sample's index and the step (`NoisyLoss`; $GLOBAL_NOISE=1: from torch's global generator instead)."""

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddp_tricks import InMemoryDataset
from task import Task


class NoisyLoss(Task):
    """Logit noise in the loss, drawn per sample from a generator seeded by (sample index, step)."""

    step = 0

    def datasets(self):
        train, val = super().datasets()
        indexed = lambda d: InMemoryDataset(d.inputs, torch.stack([d.targets, torch.arange(len(d.targets))], 1))  # noqa
        return indexed(train), indexed(val)

    def model(self):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def loss(self, outputs, targets):
        labels, index = targets[:, 0], targets[:, 1]
        seeds = (index * 1_000_003 + self.step).tolist()
        if os.environ.get("GLOBAL_NOISE") == "1":  # each rank's own stream: not the same at another world size
            return F.cross_entropy(outputs + 2.0 * torch.randn_like(outputs), labels)
        noise = [torch.randn(outputs.shape[1], generator=torch.Generator().manual_seed(s)) for s in seeds]
        noise = torch.stack(noise).to(outputs.device) if seeds else outputs.new_zeros(outputs.shape)
        return F.cross_entropy(outputs + 2.0 * noise, labels)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(1) == targets[:, 0]).sum()}

    def after_step(self, model, step, progress):
        self.step = step


class Block(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if os.environ.get("NO_CHECKPOINT") == "1":
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=False)


class Checkpointed(Task):
    """The digits through an MLP whose hidden block is recomputed in backward (activation checkpointing)."""

    def model(self):
        hidden = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        return nn.Sequential(nn.Flatten(), Block(hidden), nn.Linear(64, 10))
