"""Batch-level transforms on the device, after the dataset's `finish` and before the forward: a task's
`batch_transform(inputs, targets)` (torchvision's v2.MixUp / v2.CutMix, timm's Mixup, as they are) or the built-in
mixup / cutmix of --mixup / --cutmix (`Mixing`), each run by the Feed under `seeded(key)`.

The key is (seed, epoch, step of the epoch, slot): the plan's slot is the step's micro-batch over all ranks, which
holds the same samples at any world size (plan.py), so a micro-batch's draws (torch's, numpy's and Python's global
generators, all seeded from the key in a fork that is put back after) are the same after a resume, on any world
size, and do not depend on anything drawn before. `Mixing` pairs each sample with one of its own micro-batch (the
batch reversed, as timm's Mixup): the mixed global batch is the same at any world size whenever the micro-batches
are (a resume keeps the run's micro-batch where --batch-size allows; a new run with another micro-batch mixes other
pairs). Pairing across ranks would need every rank's images (an all-gather of the global batch each step).
"""

from __future__ import annotations

import contextlib
import random

import torch

from ddp_tricks.data.recipe import MIX_MODES


def batch_key(seed: int, epoch: int, step: int, slot: int) -> int:
    """The seed of one micro-batch's batch transform: a function of (seed, epoch, step of the epoch, slot) alone."""
    return (((seed * 1_000_003 + epoch) * 1_000_033 + step) * 10_007 + slot) % (2**63)


@contextlib.contextmanager
def seeded(key: int, device: torch.device):
    """torch's (the CPU's and `device`'s), numpy's and Python's global generators seeded from `key`, and put back
    after: what a transform draws inside is a function of the key alone, and leaves the run's generators as they
    were."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(key)
            random.seed(key)
            np.random.seed(key % 2**32)
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class Mixing:
    """Mixup and cutmix as timm's Mixup does them (its flags' names), on a finished batch on the device: with
    probability `prob` (per micro-batch, pair or sample: `mode`), cutmix with probability `switch_prob` where both
    are on, else mixup; lambda ~ Beta(alpha, alpha), the cut box's lambda corrected to its area; sample i mixed with
    sample N-1-i of the same micro-batch. Targets become class probabilities (a task's label smoothing applies to them
    in its loss, which is timm's smoothed mix). Its draws come from torch's global generator: the Feed seeds it."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float, prob: float = 1.0,
                 switch_prob: float = 0.5, mode: str = "batch"):  # fmt: skip
        assert mode in MIX_MODES and (mixup_alpha > 0 or cutmix_alpha > 0)
        self.num_classes, self.mixup_alpha, self.cutmix_alpha = num_classes, mixup_alpha, cutmix_alpha
        self.prob, self.switch_prob, self.mode = prob, switch_prob, mode

    def describe(self) -> str:
        """What it does and what holds across world sizes, for the start line."""
        both = self.mixup_alpha > 0 and self.cutmix_alpha > 0
        kinds = [f"mixup {self.mixup_alpha:g}"] * (self.mixup_alpha > 0) + [f"cutmix {self.cutmix_alpha:g}"] * (
            self.cutmix_alpha > 0
        )
        switch = f", cutmix's share {self.switch_prob:g}" if both else ""
        return (
            f"batch transform: {' and '.join(kinds)} (probability {self.prob:g}{switch}, one draw per {self.mode}), "
            "each sample mixed with another of its micro-batch, drawn from (seed, step, micro-batch): the same mixed "
            "batch at any world size while the micro-batches stay the same"
        )

    def _draws(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lambda, cut) for each of `n` draws, on the CPU: lambda 1 where nothing is mixed."""
        use = torch.rand(n) < self.prob
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = torch.rand(n) < self.switch_prob
        else:
            cut = torch.full((n,), self.cutmix_alpha > 0)
        lam = torch.ones(n)
        for alpha, where in ((self.mixup_alpha, ~cut), (self.cutmix_alpha, cut)):
            if alpha > 0:
                beta = torch.distributions.Beta(torch.tensor(float(alpha)), torch.tensor(float(alpha)))
                lam = torch.where(where, beta.sample((n,)), lam)
        return torch.where(use, lam, torch.ones(n)), cut & use

    def _boxes(self, lam: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, ...]:
        """timm's rand_bbox for each lambda: a box of sqrt(1 - lambda) of each side, centred anywhere, clipped."""
        ratio = (1 - lam).sqrt()
        cut_h, cut_w = (height * ratio).long(), (width * ratio).long()
        cy, cx = torch.randint(0, height, lam.shape), torch.randint(0, width, lam.shape)
        top, bottom = (cy - cut_h // 2).clamp(0, height), (cy + cut_h // 2).clamp(0, height)
        left, right = (cx - cut_w // 2).clamp(0, width), (cx + cut_w // 2).clamp(0, width)
        return top, bottom, left, right

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, height, width = inputs.shape[0], inputs.shape[-2], inputs.shape[-1]
        draws = {"batch": 1, "pair": (n + 1) // 2, "elem": n}[self.mode]
        lam, cut = self._draws(draws)
        if self.mode == "batch":
            lam, cut = lam.expand(n), cut.expand(n)
        elif self.mode == "pair":  # sample i and its partner N-1-i share a draw
            lam, cut = torch.cat([lam, lam[: n // 2].flip(0)]), torch.cat([cut, cut[: n // 2].flip(0)])
        top, bottom, left, right = self._boxes(lam, height, width)
        area = ((bottom - top) * (right - left)).float() / (height * width)
        lam = torch.where(cut, 1 - area, lam)  # cutmix's lambda: the share of the sample's own pixels
        device = inputs.device
        lam_d, cut_d = lam.to(device, non_blocking=True), cut.to(device, non_blocking=True)
        ys = torch.arange(height, device=device).view(1, height, 1)
        xs = torch.arange(width, device=device).view(1, 1, width)
        box = [t.to(device, non_blocking=True).view(n, 1, 1) for t in (top, bottom, left, right)]
        inside = (ys >= box[0]) & (ys < box[1]) & (xs >= box[2]) & (xs < box[3]) & cut_d.view(n, 1, 1)
        partner = inputs.flip(0)
        weight = lam_d.view(n, *[1] * (inputs.dim() - 1)).to(inputs.dtype)
        mixed = torch.where(cut_d.view(weight.shape), inputs, inputs * weight + partner * (1 - weight))
        mixed = torch.where(inside.unsqueeze(1), partner, mixed)
        if not targets.is_floating_point():
            targets = torch.nn.functional.one_hot(targets, self.num_classes).float()
        share = lam_d.view(n, 1).to(targets.dtype)
        return mixed, targets * share + targets.flip(0) * (1 - share)
