"""A task as a user writes one (see task.py), for the gradient noise scale's tests: the built-in digits task with
a small multilayer perceptron, whose per-sample gradients torch.func computes exactly (no BatchNorm: the samples of
a batch do not interact, as the noise scale's model of a gradient assumes).

    torchrun --standalone --nproc_per_node=2 run.py --task tests/noise_tasks.py:PerceptronDigits -b 16
"""

from __future__ import annotations

from torch import nn

from task import Task


class PerceptronDigits(Task):
    def model(self):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, self.num_classes))


class BaggedDigits(Task):
    """Each sample a bag of 1 to 4 digits (the built-in task's, grouped in a fixed order), each digit classified on
    its own and the loss the mean over the batch's digits: units() counts them, so a sample is not a unit and the
    noise scale's batch sizes must be counted in digits."""

    def datasets(self):

        train, val = super().datasets()
        return bags(train.inputs, train.targets), bags(val.inputs, val.targets)

    def model(self):
        return nn.Sequential(nn.Flatten(2), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, self.num_classes))

    def loss(self, outputs, targets):
        import torch.nn.functional as F

        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(-1) == targets).sum()}

    def metrics(self, sums, count):
        return {"acc": sums["acc"] / count}

    def units(self, inputs, targets):
        return (targets != -100).sum()


def bags(images, labels):
    """Digits in bags of 1, 2, 3, 4, 1, 2, ... in their order: inputs (bags, 4, 1, 8, 8) zero-padded, targets (bags, 4)
    with -100 where a bag holds fewer than 4."""
    import torch

    from ddp_tricks import InMemoryDataset

    sizes, start = [], 0
    while start < len(labels):
        sizes.append(min(len(sizes) % 4 + 1, len(labels) - start))
        start += sizes[-1]
    inputs = torch.zeros(len(sizes), 4, *images.shape[1:])
    targets = torch.full((len(sizes), 4), -100, dtype=torch.long)
    start = 0
    for row, size in enumerate(sizes):
        inputs[row, :size], targets[row, :size] = images[start : start + size], labels[start : start + size]
        start += size
    return InMemoryDataset(inputs, targets)
