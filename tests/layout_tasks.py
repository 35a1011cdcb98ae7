"""Models as they are really laid out, for `--strategy fsdp` against DDP (#39): blocks in an `nn.ModuleList` (every
transformer's `self.layers`), and a mixture of experts whose top-1 router calls only the experts some sample chose
(an expert that no sample of a rank's batch chose is not called on that rank), with the experts inside one unit or
each its own unit.

    torchrun --standalone --nproc_per_node=2 run.py --task tests/layout_tasks.py:Blocks --strategy fsdp
    torchrun --standalone --nproc_per_node=2 run.py --task tests/layout_tasks.py:ExpertsInOneUnit --strategy fsdp
    torchrun --standalone --nproc_per_node=2 run.py --task tests/layout_tasks.py:MoE --find-unused-parameters
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset

EXPERTS = 4


def digits(train: int = 384, val: int = 97):
    """The first `train` and the next `val` of the 8x8 digits, flattened and scaled to [0, 1]."""
    from ddp_tricks.data import images

    whole = images.digits()[0]
    inputs, targets = whole.inputs[: train + val].reshape(train + val, -1), whole.targets[: train + val]
    return InMemoryDataset(inputs[:train], targets[:train]), InMemoryDataset(inputs[train:], targets[train:])


class Classifier:
    better = {"acc": "max"}
    monitor = "loss"

    def __init__(self, args):
        pass

    def datasets(self):
        return digits()

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(1) == targets).sum()}


class Stack(nn.Module):
    """A stem, three residual blocks held in a ModuleList, a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Blocks(Classifier):
    """The blocks in a ModuleList: under FSDP, by default, each block its own unit."""

    def model(self):
        return Stack()


class Experts(nn.Module):
    """Top-1 mixture of experts, as most MoE code writes it: an expert that no row chose is not called at all."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.router = nn.Linear(width, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(EXPERTS))

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        weight, chosen = gate.max(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (chosen == i).nonzero().flatten()
            if len(rows):  # a host read per expert: what MoE code does, and why an expert may go uncalled
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows, None])
        return out


class MixtureModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.moe = Experts()
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.head(x + self.moe(x))


class MoE(Classifier):
    """The default units: stem, router, each expert (a ModuleList's elements), head."""

    def model(self):
        return MixtureModel()


class ExpertsInOneUnit(MoE):
    """The experts inside one unit: the whole MoE layer (router and experts) gathered together."""

    def shard_units(self, model):
        return [model.stem, model.moe, model.head]


class ExpertsEachAUnit(MoE):
    """Each expert its own unit, as the task says it (the experts a rank's batch skips: never called there)."""

    def shard_units(self, model):
        return [model.stem, model.moe.router, *model.moe.experts, model.head]
