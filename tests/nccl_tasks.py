"""Task files for the GPU tests of #48 (test_nccl.py): the built-in digits task with one twist each.

python run.py --device cuda --task tests/nccl_tasks.py:RefusesEmptyOnGpu
"""

from __future__ import annotations

from torch import nn

from ddp_tricks import gather_with_grad
from task import Task


class _RefusesEmptyOnGpu(nn.Module):
    """The digits model, except that on a GPU it refuses a batch of 0 rows, as some CUDA kernels do (the CPU's take
    it)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.is_cuda and len(x) == 0:
            raise RuntimeError("this CUDA kernel refuses a batch of 0 rows")
        return self.inner(x)


class RefusesEmptyOnGpu(Task):
    """A loss that reads every rank's rows (gather_with_grad), so its evaluation must take a batch of 0 samples, and a
    model that refuses one on a GPU only."""

    def model(self):
        return _RefusesEmptyOnGpu(super().model())

    def loss(self, outputs, targets):
        gather_with_grad(outputs)  # every rank's rows: what makes the start-up check run an empty batch
        return super().loss(outputs, targets)
