"""Task files for the watchdog's tests (test_hangs.py): the built-in digits task with one fault or one long piece of
legitimate work, chosen by $FAULT, at the training loss's call $AT (counted per process from 1, once the process group
exists):

    FAULT=stop     rank 1 stops itself (SIGSTOP) at call AT, in the first attempt only (a restarted one trains on)
    FAULT=skip     every rank all-reduces a scalar in its loss; at call AT rank 1 skips it and waits in a barrier
    FAULT=size     at call AT, rank r all-reduces 3 + 2r numbers: gloo aborts the receiving rank (a mismatch)
    FAULT=eval     rank 0's first validation batch sleeps $SLOW seconds (a slow evaluation)
    FAULT=evalwait at validation batch AT, rank 1 waits in a barrier of a group rank 0 never joins (a side group
                   made at the first training call), while rank 0 goes on to the evaluation's reduction
    FAULT=side     at training call AT, rank 1 waits in a barrier of that side group (on nccl, rank 0 goes on into
                   collectives rank 1 never joins, until NCCL's watchdog aborts it after --dist-timeout)
    FAULT=first    rank 0's first training step sleeps $SLOW seconds (a first step that compiles)
    FAULT=save     rank 0's first checkpoint write sleeps $SLOW seconds (a large checkpoint)
    FAULT=figures  rank 0's figures take $SLOW seconds more (the others have finished)
    FAULT=slow     every rank's training calls 2 to AT take $SLOW seconds each (ordinary slow steps), the rest none
    FAULT=stall    every rank's training calls 2 to AT - 1 take $STEP seconds each; at call AT rank 0 sleeps $SLOW
                   seconds (a step far slower than the ones before it) while rank 1 waits in DDP's backward

    torchrun --standalone --nproc_per_node=2 run.py --task tests/hang_tasks.py:Faulty --hang-timeout 3
"""

from __future__ import annotations

import os
import signal
import time

import torch

from task import Task


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Faulty(Task):
    def __init__(self, args):
        super().__init__(args)
        self.fault = os.environ.get("FAULT", "")
        self.at = int(os.environ.get("AT", "1"))
        self.slow = float(os.environ.get("SLOW", "8"))
        self.step_seconds = float(os.environ.get("STEP", "0"))
        self.calls = 0
        self.val_calls = 0
        self.side = None  # FAULT=evalwait: a group of every rank that only rank 1 ever waits in
        if self.fault == "save" and _rank() == 0:
            from ddp_tricks.storage import checkpoint

            checkpoint.save = self._slow_once(checkpoint.save)
        if self.fault == "figures" and _rank() == 0:
            from ddp_tricks import plots

            plots.curves = self._slow_once(plots.curves)

    def _slow_once(self, function):
        slept = []

        def slow(*args, **kwargs):
            if not slept:
                slept.append(True)
                time.sleep(self.slow)
            return function(*args, **kwargs)

        return slow

    def loss(self, outputs, targets):
        import torch.distributed as dist

        if not dist.is_initialized():  # the checks before the process group
            return super().loss(outputs, targets)
        if not torch.is_grad_enabled():  # evaluation
            self.val_calls += 1
            if self.fault == "eval" and _rank() == 0 and self.val_calls == 1:
                time.sleep(self.slow)
            if self.fault == "evalwait" and _rank() == 1 and self.val_calls == self.at:
                dist.barrier(group=self.side)
            return super().loss(outputs, targets)
        if self.fault in ("evalwait", "side") and self.side is None:  # every rank, at its first training call
            self.side = dist.new_group(backend="gloo")
        self.calls += 1
        now = self.calls == self.at
        if self.fault == "side" and now and _rank() == 1:
            dist.barrier(group=self.side)
        if self.fault == "first" and _rank() == 0 and self.calls == 1:
            time.sleep(self.slow)
        if self.fault == "slow" and 2 <= self.calls <= self.at:
            time.sleep(self.slow)
        if self.fault == "stall" and 2 <= self.calls < self.at:
            time.sleep(self.step_seconds)
        if self.fault == "stall" and now and _rank() == 0:
            time.sleep(self.slow)
        if self.fault == "stop" and now and _rank() == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.fault == "skip":
            if now and _rank() == 1:
                dist.barrier()
            else:
                dist.all_reduce(torch.ones(1))
        if self.fault == "size" and now:
            dist.all_reduce(torch.ones(3 + 2 * _rank()))
        return super().loss(outputs, targets)
