"""Task files for the tests of the optimizer surface (#58): the built-in digits task with one change each, as a user
writes them.

    python run.py --task tests/optim_tasks.py:NoTrustForTheHead --optimizer lamb
    python run.py --task tests/optim_tasks.py:OwnRAdam --lookahead
"""

from __future__ import annotations

import torch

from task import Task


class NoTrustForTheHead(Task):
    """The head's group without LAMB's or LARS's trust ratio ('lars': False), the body's at its own betas."""

    def param_groups(self, model):
        return [
            {"params": model.features.parameters(), "name": "body"},
            {"params": model.head.parameters(), "lars": False, "name": "head"},
        ]


class OwnRAdam(Task):
    """The task's own optimizer: torch's RAdam on the groups the template made."""

    def optimizer(self, param_groups):
        return torch.optim.RAdam(param_groups, lr=param_groups[0]["lr"], decoupled_weight_decay=True)


class NotAnOptimizer(Task):
    """A mistake: optimizer() gives a list."""

    def optimizer(self, param_groups):
        return [torch.optim.SGD(param_groups, lr=0.1)]


class HeadOnly(Task):
    """A mistake: optimizer() leaves out every parameter but the head's."""

    def optimizer(self, param_groups):
        head = [p for group in param_groups for p in group["params"] if p.ndim == 2][-1:]
        return torch.optim.SGD(head, lr=0.1)


class OneLayer(Task):
    """A model without a hidden matrix: its one Linear is the output head."""

    def model(self):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(self.num_classes))
