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
