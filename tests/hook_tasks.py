"""A task of a family the template does not ship, written from docs/tasks.md alone as a user would: DINO-style
self-distillation (Caron et al., 2021) on the 8x8 digits. A student and a teacher (a frozen copy inside the model,
the per-step hook's EMA of the student with a cosine momentum) see two noisy views of each digit; the student's
softmax of one view learns the teacher's centred, sharpened softmax of the other. The center, a moving average of
the teacher's outputs over every rank's batch, is the task's own state: summed in loss() inside training steps,
gathered from every rank and applied once per step by the hook, checkpointed through the task's state_dict().

    torchrun --standalone --nproc_per_node=2 run.py --task tests/hook_tasks.py:DinoCenter --optimizer adamw -l 0.003
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset, gather_with_grad, in_training_step

PROTOTYPES, STUDENT_TEMPERATURE, TEACHER_TEMPERATURE = 16, 0.1, 0.04


class NoisyViews(InMemoryDataset):
    """Flattened digits as (two noisy views (n, 2, 64), label), the noise drawn anew for every batch."""

    def __getitem__(self, index):
        inputs, targets = self.__getitems__([index])
        return inputs[0], targets[0]

    def __getitems__(self, indices):
        images, labels = super().__getitems__(indices)
        return torch.stack(
            [images + 0.3 * torch.randn_like(images), images + 0.3 * torch.randn_like(images)], 1
        ), labels


def network(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, PROTOTYPES))  # fmt: skip


class StudentTeacher(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.student = network(hidden)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, views):
        with torch.no_grad():
            teacher = self.teacher(views)
        return {"student": self.student(views), "teacher": teacher}


class DinoCenter:
    better = {"agree": "max"}  # how often the student's prototype of a view is the teacher's of the other view
    monitor = "loss"

    @staticmethod
    def add_arguments(parser):
        parser.add_argument("--hidden", type=int, default=64)
        parser.add_argument("--teacher-momentum", type=float, default=0.99)
        parser.add_argument("--center-momentum", type=float, default=0.9)

    def __init__(self, args):
        self.args = args
        self.center = torch.zeros(PROTOTYPES)
        self.pending, self.rows = None, 0

    def datasets(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        val, train = order[:359], order[359:]
        return NoisyViews(x[train], y[train]), NoisyViews(x[val], y[val])

    def model(self):
        return StudentTeacher(self.args.hidden)

    def loss(self, outputs, targets):
        student, teacher = outputs["student"], outputs["teacher"]
        self.center = self.center.to(teacher.device)
        if in_training_step():  # the step's teacher outputs on this rank; the hook adds every rank's
            rows = teacher.detach().flatten(0, 1)
            self.pending = rows.sum(0) + (0 if self.pending is None else self.pending)
            self.rows += len(rows)
        targets = F.softmax((teacher - self.center) / TEACHER_TEMPERATURE, dim=-1)
        logs = F.log_softmax(student / STUDENT_TEMPERATURE, dim=-1)
        crossed = -(targets[:, 0] * logs[:, 1]).sum(-1) - (targets[:, 1] * logs[:, 0]).sum(-1)
        return crossed.sum() / (2 * max(len(student), 1))

    def metric_sums(self, outputs, targets):
        student, teacher = outputs["student"].argmax(-1), outputs["teacher"].argmax(-1)
        return {"agree": ((student[:, 0] == teacher[:, 1]).sum() + (student[:, 1] == teacher[:, 0]).sum()) / 2}

    def after_step(self, model, step, progress):
        momentum = 1 - (1 - self.args.teacher_momentum) * (math.cos(math.pi * progress) + 1) / 2
        torch._foreach_lerp_(list(model.teacher.parameters()), list(model.student.parameters()), 1 - momentum)
        # every rank's sums and row counts (every rank calls the hook: it may gather); a rank that ran no
        # micro-batch in this step (a --batch-trace step) adds zeros
        mine = torch.zeros(PROTOTYPES + 1, device=self.center.device)
        if self.pending is not None:
            mine = torch.cat([self.pending, torch.full((1,), float(self.rows), device=self.center.device)])
        total = gather_with_grad(mine.unsqueeze(0)).sum(0)
        m = self.args.center_momentum
        self.center = m * self.center + (1 - m) * total[:-1] / total[-1]
        self.pending, self.rows = None, 0

    def state_dict(self):
        return {"center": self.center}

    def load_state_dict(self, state):
        self.center = state["center"]


class RecordingDino(DinoCenter):
    """DinoCenter, with the steps its hook saw appended to $HOOK_LOG.<rank> (tests/step_tasks.py's format)."""

    def after_step(self, model, step, progress):
        super().after_step(model, step, progress)
        from step_tasks import Recording

        Recording.after_step(self, model, step, progress)
