"""BYOL (Grill et al., 2020) on the 8x8 digits: a student (online network: encoder, projector, predictor) learns to
predict, from one augmented view of an image, a teacher's (target network: encoder and projector) projection of the
other view; no negatives. The teacher is a frozen copy inside the model (so checkpoints, resume and FSDP's shards
carry it), moved toward the student after every optimizer step by the seam's per-step hook, `after_step`:
teacher = tau * teacher + (1 - tau) * student, with tau rising from --tau to 1 on a cosine over the run (BYOL's
schedule, from the hook's `progress`). The views, the encoder and the linear probe are examples/contrastive.py's,
so the two compare at the same budget (docs/tasks.md).

    torchrun --standalone --nproc_per_node=2 run.py --task examples/byol.py:BYOL --optimizer lars \\
        --bn-bias-separately --base-lr 3 -b 64 -e 30 --warmup-epochs 3 --scheduler cosine --wd 1e-4

Reported: the linear probe on the student's encoder (probe_acc, monitored) and, as for SimCLR, the contrastive
top-1 of the student's projections (how often a view's nearest other embedding in the global batch is its pair's
other view), which gathers from every rank in its metric sums; the loss itself is per sample.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from contrastive import Encoder, TwoViews  # beside this file
from torch import nn

from ddp_tricks import UserError


def mlp(features: int, hidden: int, out: int) -> nn.Sequential:
    """BYOL's projector and predictor: Linear, BatchNorm, ReLU, Linear."""
    return nn.Sequential(nn.Linear(features, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Linear(hidden, out))  # fmt: skip


class BYOLNet(nn.Module):
    """The student (encoder, projector, predictor) and the teacher (a copy of the encoder and projector, frozen).
    Called on (n, 3, 1, 8, 8): {"p": the student's predictions, "t": the teacher's projections, "z": the student's
    projections}, each (n, 2, dim), and in eval mode also the clean image's student features {"h": (n, F)}."""

    def __init__(self, width: int, dim: int):
        super().__init__()
        self.encoder = Encoder(width, batchnorm=True)
        hidden = 2 * self.encoder.features
        self.projector = mlp(self.encoder.features, hidden, dim)
        self.predictor = mlp(dim, hidden, dim)
        self.teacher_encoder = copy.deepcopy(self.encoder).requires_grad_(False)
        self.teacher_projector = copy.deepcopy(self.projector).requires_grad_(False)
        self.evaluations = 0  # the probe is fit anew for every evaluation's weights (the EMA's are swapped in)

    def train(self, mode: bool = True):
        if not mode:  # every evaluation starts with model.eval()
            self.evaluations += 1
        return super().train(mode)

    def student_and_teacher(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The teacher's parameters and the student's they follow, in the same order."""
        teacher = [*self.teacher_encoder.parameters(), *self.teacher_projector.parameters()]
        return teacher, [*self.encoder.parameters(), *self.projector.parameters()]

    def forward(self, x: torch.Tensor) -> dict:
        n = len(x)
        views = torch.cat([x[:, 1], x[:, 2]])  # both views in one batch, as in examples/contrastive.py

        def pairs(y):
            return y.unflatten(0, (2, n)).transpose(0, 1).contiguous()

        z = self.projector(self.encoder(views))
        with torch.no_grad():
            t = self.teacher_projector(self.teacher_encoder(views))
        out = {"p": pairs(self.predictor(z)), "t": pairs(t), "z": pairs(z)}
        return out if self.training else out | {"h": self.encoder(x[:, 0])}


def byol_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """BYOL's symmetric loss: each view's prediction against the teacher's projection of the other view, 2 - 2 cos,
    the two directions summed, the mean over the pairs (0 for none)."""
    p, t = F.normalize(p, dim=-1), F.normalize(t, dim=-1)
    cos = (p[:, 0] * t[:, 1]).sum(-1) + (p[:, 1] * t[:, 0]).sum(-1)
    return (4 - 2 * cos).sum() / max(len(p), 1)


class BYOL(TwoViews):
    """BYOL on the digits; see the module's docstring. Its views and evaluation (the contrastive top-1 of the
    student's projections, the linear probe of its encoder) are SimCLR's (TwoViews)."""

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: BYOL on the digits (examples/byol.py)")
        g.add_argument("--tau", type=float, default=0.99,
                       help="the teacher's EMA rate at the start; it rises to 1 on a cosine over the run")  # fmt: skip
        g.add_argument("--width", type=int, default=32, help="the encoder's first convolution's channels")
        g.add_argument("--projection-dim", type=int, default=32, help="the projector's and predictor's output size")
        g.add_argument("--views", choices=("random", "fixed"), default="random",
                       help="random: new views every batch; fixed: drawn once per image (for tests)")  # fmt: skip

    def __init__(self, args):
        if not 0.0 <= args.tau < 1.0:
            raise UserError(f"--tau must be in [0, 1), got {args.tau}")
        if args.width < 1 or args.projection_dim < 1:
            raise UserError("--width and --projection-dim must be positive")
        self.args = args

    def model(self):
        self.net = BYOLNet(self.args.width, self.args.projection_dim)
        return self.net

    def loss(self, outputs, targets):
        return byol_loss(outputs["p"], outputs["t"])

    def tau(self, progress: float) -> float:
        """BYOL's teacher rate after `progress` of the run: 1 - (1 - tau) (cos(pi progress) + 1) / 2."""
        return 1 - (1 - self.args.tau) * (math.cos(math.pi * progress) + 1) / 2

    def after_step(self, model, step, progress):
        """The seam's per-step hook, once per optimizer step on every rank (under FSDP on each rank's slices):
        the teacher moves toward the student."""
        teacher, student = model.student_and_teacher()
        torch._foreach_lerp_(teacher, student, 1 - self.tau(progress))
