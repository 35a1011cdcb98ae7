"""Per-step learning-rate curves: `WarmupDecay` (warmup, then constant / poly / cosine / step decay) and the
original LARS project's `PolynomialWarmup`, each a torch `LRScheduler` stepped once per optimizer step.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ddp_tricks.schedules import DECAYS


class WarmupDecay(LRScheduler):
    """LR of optimizer step k (0-based: the LR the k-th step uses, i.e. after k calls of `step()`), for a
    base LR b, W = warmup_steps and D = decay_steps (the steps after warmup)::

        k < W:      b * (k + 1) / W                                     (the first step already trains)
        t = k - W,  p = min(t + 1, D) / D:
                    constant  b
                    poly      (b - end_lr) * (1 - p) ** power + end_lr
                    cosine    end_lr + (b - end_lr) * (1 + cos(pi * p)) / 2
                    step      b * gamma ** floor(k / step_size)

    Step k uses the value the curve reaches at the END of it (after k + 1 steps), so a run of W + D steps
    peaks at b on its last warmup step and trains its last step with end_lr (poly and cosine hold end_lr
    after that). Poly is the original LARS project's curve one step earlier than `PolynomialWarmup` (decay_steps
    = W + D) gives it: that class keeps the original's counter, so the last step of its run misses end_lr by
    one decay step. A parameter group with an `lr_mult` (its base LR b times that multiplier) follows the curve
    times its multiplier at every step: its end_lr is multiplied too.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        decay_steps: int,
        decay: str = "constant",
        end_lr: float = 0.0,
        power: float = 1.0,
        step_size: int = 1,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ):
        if decay not in DECAYS:
            raise ValueError(f"Invalid decay: {decay!r} (one of {', '.join(DECAYS)})")
        if warmup_steps < 0 or decay_steps < 0:
            raise ValueError(f"Invalid steps: warmup_steps={warmup_steps}, decay_steps={decay_steps} (must be >= 0)")
        if step_size < 1:
            raise ValueError(f"Invalid step_size: {step_size} (must be >= 1)")
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.decay = decay
        self.end_lr = end_lr
        self.power = power
        self.step_size = int(step_size)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int, lr_mult: float = 1.0) -> float:
        """The LR of step `step` for a group whose base LR is `base_lr` (already times its `lr_mult`)."""
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        if self.decay == "step":
            return base_lr * self.gamma ** (step // self.step_size)
        if self.decay == "constant" or self.decay_steps == 0:
            return base_lr
        end_lr = self.end_lr * lr_mult
        progress = min(step - self.warmup_steps + 1, self.decay_steps) / self.decay_steps
        if self.decay == "poly":
            return (base_lr - end_lr) * (1 - progress) ** self.power + end_lr
        return end_lr + (base_lr - end_lr) * (1 + math.cos(math.pi * progress)) / 2

    def lrs_at(self, step: int) -> list[float]:
        """Every parameter group's LR at step `step`."""
        groups = self.optimizer.param_groups
        return [self.lr_at(base, step, group.get("lr_mult", 1.0)) for base, group in zip(self.base_lrs, groups)]

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch)

    _get_closed_form_lr = get_lr


class PolynomialWarmup(LRScheduler):
    """The original LARS project's scheduler (LARS-ImageNet-PyTorch's `utils.PolynomialWarmup`), with its
    signature and defaults. `decay_steps` is the WHOLE run (epochs x steps per epoch), warmup included; call
    `step()` after every optimizer step. After s calls (W = warmup_steps, D = decay_steps, b = the base LR)::

        s < W:   b * (s + 1) / W
        s >= W:  (b - end_lr) * (1 - min(s - W, D - W) / (D - W)) ** power + end_lr

    These are the original's values but for one improvement: its warmup is b * s / W, so its first step
    trains with LR 0; ours is one step ahead there (and so uses b on steps W - 1 and W). The decay is the
    original's to the step: b after W calls, end_lr after D calls and from then on.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        decay_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ):
        if not 0 <= warmup_steps <= decay_steps:
            raise ValueError(
                f"Invalid steps: warmup_steps={warmup_steps}, decay_steps={decay_steps} "
                "(need 0 <= warmup_steps <= decay_steps; decay_steps is the whole run)"
            )
        self.decay_steps = int(decay_steps)
        self.warmup_steps = int(warmup_steps)
        self.end_lr = end_lr
        self.power = power
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.end_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return (base_lr - self.end_lr) * (1 - progress) ** self.power + self.end_lr

    def get_lr(self) -> list[float]:
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

    _get_closed_form_lr = get_lr
