"""Task files for the tests of DataLoader workers under signals (test_worker_signals.py): the built-in digits task
waiting at a known step for the test's signal, and one whose worker dies.

    torchrun --standalone --nproc_per_node=2 run.py --task tests/worker_tasks.py:WorkerKilled --workers 2
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.data

from ddp_tricks.data.in_memory import InMemoryDataset
from ddp_tricks.distributed import preemption
from task import Task


class Cued(Task):
    """After $PREEMPT_AFTER training micro-batches, rank 0 creates the file $CUE_FILE and waits (up to a minute) for
    the SIGTERM that the test then sends from outside the job, to whole process groups as SLURM, `timeout` or `kill
    -TERM -- -PGID` do: the stop then comes at a known step whatever the machine's speed (the ranks agree after every
    step: preemption.MOST_STEPS = 1). The signal comes from another process, as a cluster's does: a rank that
    signalled its own group would be its DataLoader workers' parent, whose SIGTERM ends them."""

    micro_batches = 0
    if os.environ.get("PREEMPT_AFTER"):
        preemption.MOST_STEPS = 1

    def loss(self, outputs, targets):
        after = int(os.environ.get("PREEMPT_AFTER", "0"))
        if after and torch.is_grad_enabled() and dist.is_initialized():
            self.micro_batches += 1
            if self.micro_batches == after and dist.get_rank() == 0:
                Path(os.environ["CUE_FILE"]).touch()
                deadline = time.monotonic() + 60
                while not any(p.requested for p in preemption._LIVE) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return super().loss(outputs, targets)


class _KillsItsWorker(InMemoryDataset):
    """The training set, but on rank 1 the DataLoader worker 0, at its $KILL_AFTER-th batch, kills itself with
    SIGKILL, as the out-of-memory killer would (worker 0 alone: each counts its own batches, and two that both got
    there before the rank noticed were named together, 'pid 30767, 30771', once in ten runs)."""

    fetched = 0  # in each worker process, its own count

    def __getitems__(self, indices):
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.id == 0 and os.environ.get("RANK") == "1":
            _KillsItsWorker.fetched += 1
            if _KillsItsWorker.fetched == int(os.environ.get("KILL_AFTER", "5")):
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitems__(indices)


class WorkerKilled(Task):
    """The built-in task whose rank-1 DataLoader worker is killed (SIGKILL) in the first epoch; run with --workers."""

    def datasets(self):
        train, val = super().datasets()
        return _KillsItsWorker(train.inputs, train.targets), val
