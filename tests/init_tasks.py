"""Tasks for --init-from's tests (#57): the built-in digits task on its first five classes (a checkpoint of the
ten-class task starts it with a new head), and on a training set of half the size (a resume with it is refused).

    python run.py --task tests/init_tasks.py:FiveDigits --init-from runs/ten-classes
"""

from __future__ import annotations

from ddp_tricks import InMemoryDataset
from task import Task


def _kept(dataset, keep) -> InMemoryDataset:
    return InMemoryDataset(dataset.inputs[keep], dataset.targets[keep])


class FiveDigits(Task):
    """The digits 0 to 4: the toy model's head has 5 outputs."""

    def datasets(self):
        train, val = super().datasets()
        train, val = _kept(train, train.targets < 5), _kept(val, val.targets < 5)
        self.num_classes = 5
        return train, val


class HalfDigits(Task):
    """The digits' first half of the training set, the same validation set."""

    def datasets(self):
        train, val = super().datasets()
        return _kept(train, slice(0, len(train) // 2)), val
