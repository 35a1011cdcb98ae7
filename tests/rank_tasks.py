"""Task files as a user writes them (see task.py), for the tests of what happens across ranks: a model with a branch
that some batches skip, a head no step uses, a rank that fails in its fifth step, a rank that stops answering, a
mistake that every rank finds, rank 0 last, tiny models for many ranks. Each is the built-in digits task with one
change.

    torchrun --standalone --nproc_per_node=2 run.py --task tests/rank_tasks.py:SometimesAux -b 8
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddp_tricks import UserError
from ddp_tricks.distributed import preemption
from task import Task

BRIGHT = 0.1  # a digit image whose mean pixel is above this (about one in ten) is "bright"


class WithAuxHead(nn.Module):
    """The task's classifier plus an auxiliary linear head on the raw pixels, added to the logits. `always`: the
    head runs on every batch; else only on batches that hold a bright image (a data-dependent branch); None:
    never (a head left in the model by mistake)."""

    def __init__(self, body: nn.Module, pixels: int, classes: int, always: bool | None):
        super().__init__()
        self.body = body
        self.aux = nn.Linear(pixels, classes)
        self.always = always

    def forward(self, x):
        logits = self.body(x)
        if self.always is None:
            return logits
        if self.always or bool((x.flatten(1).mean(1) > BRIGHT).any()):
            logits = logits + self.aux(x.flatten(1))
        return logits


def stamp() -> None:
    """When $STEP_TIMES names a file, this rank's training steps are stamped there (the time a step's loss is
    computed): a test measures from the last one how soon the job ends."""
    if os.environ.get("STEP_TIMES") and torch.is_grad_enabled():
        with open(f"{os.environ['STEP_TIMES']}.{dist.get_rank() if dist.is_initialized() else 0}", "a") as f:
            f.write(f"{time.time()}\n")


class ConstantBuffer(Task):
    """The built-in model with one more buffer that is not a norm layer's statistic (a constant no forward reads):
    DDP then keeps its default, rank 0's buffers broadcast at every forward."""

    def model(self):
        model = super().model()
        model.register_buffer("constant", torch.ones(3))
        return model


class MistakeBeforeTheGroup(Task):
    """Every rank finds the same mistake in its data, before any process group, rank 0 a second after rank 1 (as a
    loaded machine can have it): rank 0 is the one to say it."""

    def datasets(self):
        if os.environ.get("RANK") == "0":
            time.sleep(1)
        raise UserError("the task's data is wrong (a test's own mistake)")


class SometimesAux(Task):
    """The auxiliary head runs only on batches that hold a bright image: some steps skip it on one rank."""

    def model(self):
        return WithAuxHead(super().model(), 64, self.num_classes, always=False)

    def loss(self, outputs, targets):
        stamp()
        return super().loss(outputs, targets)


class NeverUsedHead(Task):
    """An auxiliary head that no step uses."""

    def model(self):
        return WithAuxHead(super().model(), 64, self.num_classes, always=None)


class FrozenBackbone(Task):
    """The classifier frozen (requires_grad=False), only the auxiliary head trains."""

    def model(self):
        model = WithAuxHead(super().model(), 64, self.num_classes, always=True)
        model.body.requires_grad_(False)
        return model


class FailsOnRank1(Task):
    """Rank 1 raises in its fifth training step; rank 0 is then waiting for its gradients."""

    steps = 0

    def loss(self, outputs, targets):
        if torch.is_grad_enabled() and dist.is_initialized():
            self.steps += 1
            if self.steps == 5 and dist.get_rank() == 1:
                stamp()
                raise RuntimeError("rank 1 breaks in its fifth step")
        return super().loss(outputs, targets)


class StuckOnRank1(Task):
    """Rank 1 stops answering in its fifth training step (it sleeps, as a process waiting on a dead file system
    would), after touching the file $STUCK_FILE; rank 0 then waits in a collective for it."""

    steps = 0

    def loss(self, outputs, targets):
        if torch.is_grad_enabled() and dist.is_initialized():
            self.steps += 1
            if self.steps == 5 and dist.get_rank() == 1:
                open(os.environ["STUCK_FILE"], "w").close()
                time.sleep(3600)
        return super().loss(outputs, targets)


class Preempting:
    """After $PREEMPT_AFTER training micro-batches (forwards with gradients, counted once the process group exists),
    rank 0 sends SIGTERM to its launcher, as a cluster's scheduler would, and the launcher forwards it to every
    worker: the job then stops at an agreed step, its checkpoint written, at a known place in the run. On the tests'
    warm ranks (multiproc.Job), whose parent is no launcher, rank 0 sends it to every rank of the job itself, as a
    launcher would ($TEST_JOB_PIDS names the file of their process ids). With $PREEMPT_AFTER the ranks agree after
    every step (preemption.MOST_STEPS = 1), so the stop comes on the step after the signal whatever the machine's
    speed; the default (every 8 steps) is tested by test_resume's SIGTERM to one worker. Without
    $PREEMPT_AFTER, the task as it is."""

    micro_batches = 0
    if os.environ.get("PREEMPT_AFTER"):
        preemption.MOST_STEPS = 1

    def loss(self, outputs, targets):
        after = int(os.environ.get("PREEMPT_AFTER", "0"))
        if after and torch.is_grad_enabled() and dist.is_initialized():
            self.micro_batches += 1
            if self.micro_batches == after and dist.get_rank() == 0:
                job = os.environ.get("TEST_JOB_PIDS")
                for pid in map(int, Path(job).read_text().split()) if job else [os.getppid()]:
                    os.kill(pid, signal.SIGTERM)
        return super().loss(outputs, targets)


class StepsPerRank(Task):
    """The built-in task, each rank counting its training micro-batches (forwards with gradients, once the process
    group exists) and writing the count to $STEPS_DIR/steps-rankR.txt as its process ends: the step each rank
    stopped at (one micro-batch per step without accumulation)."""

    def __init__(self, args):
        super().__init__(args)
        self.micro_batches = 0
        atexit.register(self._write)

    def _write(self):
        Path(os.environ["STEPS_DIR"], f"steps-rank{os.environ.get('RANK', '0')}.txt").write_text(
            str(self.micro_batches)
        )

    def loss(self, outputs, targets):
        if torch.is_grad_enabled() and dist.is_initialized():
            self.micro_batches += 1
        return super().loss(outputs, targets)


class PreemptedDigits(Preempting, Task):
    """The built-in task (a BatchNorm model), preempted on cue."""


def _language_model():
    spec = importlib.util.spec_from_file_location("language_model", Path(__file__).parent.parent / "examples" /
                                                  "language_model.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PythonSourceLM


class PreemptedLM(Preempting, _language_model()):
    """The language-model example (a loss over tokens, units()), preempted on cue."""


class PreemptedTinyMLP(Preempting, Task):
    """The built-in task with a tiny model of two linear layers (no BatchNorm), preempted on cue: cheap on 7 ranks."""

    norm = False

    def model(self):
        pixels = self.in_channels * self._image_size[0] * self._image_size[1]
        norm = [nn.BatchNorm1d(16)] if self.norm else []
        return nn.Sequential(nn.Flatten(), nn.Linear(pixels, 16), *norm, nn.ReLU(), nn.Linear(16, self.num_classes))


class PreemptedTinyBN(PreemptedTinyMLP):
    """The same tiny model with a BatchNorm layer: its batch statistics follow each micro-batch's samples."""

    norm = True
