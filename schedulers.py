"""Learning-rate schedules that advance once per optimizer step: warmup, then constant / poly / cosine /
step decay (`WarmupDecay`, `PolynomialWarmup`), or ReduceLROnPlateau once warmup is over; `build` composes them.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

DECAYS = ("constant", "poly", "cosine", "step")


class WarmupDecay(LRScheduler):
    """LR at optimizer step s (0-based; the LR the s-th step uses), for a base LR b::

        s < W:      b * (s + 1) / W                                    (the first step already trains)
        t = s - W:  constant  b
                    poly      (b - end_lr) * (1 - min(t, D) / D) ** power + end_lr
                    cosine    end_lr + (b - end_lr) * (1 + cos(pi * min(t, D) / D)) / 2
                    step      b * gamma ** floor(s / step_size)

    with W = warmup_steps and D = decay_steps (the steps after warmup).
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

    def lr_at(self, base_lr: float, step: int) -> float:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        if self.decay == "step":
            return base_lr * self.gamma ** (step // self.step_size)
        if self.decay == "constant" or self.decay_steps == 0:
            return base_lr
        progress = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        if self.decay == "poly":
            return (base_lr - self.end_lr) * (1 - progress) ** self.power + self.end_lr
        return self.end_lr + (base_lr - self.end_lr) * (1 + math.cos(math.pi * progress)) / 2

    def get_lr(self) -> list[float]:
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

    _get_closed_form_lr = get_lr


class PolynomialWarmup(WarmupDecay):
    """The original LARS project's scheduler: a linear ramp to the base LR over `warmup_steps`, then
    `(base - end_lr) * (1 - t / decay_steps) ** power + end_lr` for t steps after warmup."""

    def __init__(
        self,
        optimizer: Optimizer,
        decay_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0,
        power: float = 1.0,
        last_epoch: int = -1,
    ):
        super().__init__(optimizer, warmup_steps, decay_steps, "poly", end_lr, power, last_epoch=last_epoch)


class Schedule:
    """The run's schedule: `step()` after every optimizer step that was taken, `epoch_end(monitored)` after
    each evaluation (the monitored metric, reduced across ranks). With a plateau, warmup owns the LR until it
    ends and ReduceLROnPlateau after, so neither overwrites the other."""

    def __init__(self, per_step: WarmupDecay, plateau: ReduceLROnPlateau | None = None):
        self.per_step = per_step
        self.plateau = plateau

    @property
    def warming_up(self) -> bool:
        return self.per_step.last_epoch < self.per_step.warmup_steps

    def step(self) -> None:
        if self.plateau is None or self.warming_up:
            self.per_step.step()

    def epoch_end(self, monitored: float) -> None:
        if self.plateau is not None and not self.warming_up:
            self.plateau.step(monitored)

    def state_dict(self) -> dict:
        return {
            "per_step": self.per_step.state_dict(),
            "plateau": None if self.plateau is None else self.plateau.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.per_step.load_state_dict(state["per_step"])
        if self.plateau is not None:
            self.plateau.load_state_dict(state["plateau"])


def lrs_over_run(make_schedule, base_lr: float, total_steps: int, factor_at=lambda step: 1.0) -> list[float]:
    """The LR every step of a run uses: the schedule stepped on a throwaway optimizer, times `factor_at(step)`."""
    import torch

    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    schedule = make_schedule(probe)
    lrs = []
    for step in range(total_steps):
        lrs.append(probe.param_groups[0]["lr"] * factor_at(step))
        probe.step()
        schedule.step()
    return lrs


def decay_kind(scheduler: str, warmup_type: str = "linear") -> str:
    """`--warmup-type cosine` (the original template's) means cosine decay after warmup."""
    if warmup_type == "cosine" and scheduler == "constant":
        return "cosine"
    return scheduler


def build(
    optimizer: Optimizer, *, total_steps: int, warmup_steps: int, kind: str = "constant", end_lr: float = 0.0,
    power: float = 1.0, step_size: int = 1, gamma: float = 0.1, plateau_factor: float = 0.1,
    plateau_patience: int = 2, plateau_mode: str = "min",
) -> Schedule:  # fmt: skip
    """The run's schedule, counted in optimizer steps: warmup, then `kind` (constant / poly / cosine / step) for
    the rest of the run, or ReduceLROnPlateau on the monitored metric (`plateau_mode`: min or max)."""
    per_step = WarmupDecay(
        optimizer,
        warmup_steps=warmup_steps,
        decay_steps=total_steps - warmup_steps,
        decay="constant" if kind == "plateau" else kind,
        end_lr=end_lr,
        power=power,
        step_size=max(1, step_size),
        gamma=gamma,
    )
    plateau = None
    if kind == "plateau":
        plateau = ReduceLROnPlateau(optimizer, mode=plateau_mode, factor=plateau_factor, patience=plateau_patience)
    return Schedule(per_step, plateau)
