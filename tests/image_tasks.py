"""Tasks for the image recipe's tests (#59): the built-in task with torchvision's CutMix as its batch_transform
(preempted on cue), and one whose loss takes class labels only."""

from __future__ import annotations

import torch.nn.functional as F
from rank_tasks import Preempting

from task import Task


class CutMixDigits(Preempting, Task):
    """The built-in task (digits by default) whose batch_transform is torchvision's v2.CutMix, as it is."""

    def datasets(self):
        from torchvision.transforms import v2

        train, val = super().datasets()
        self.batch_transform = v2.CutMix(num_classes=self.num_classes)
        return train, val


class LabelsOnly(Task):
    """The built-in task with a loss that takes class labels only (nll_loss): soft targets do not fit it."""

    def loss(self, outputs, targets):
        return F.nll_loss(F.log_softmax(outputs, 1), targets)
