"""Learning-rate schedules that advance once per optimizer step: warmup, then constant / poly / cosine /
step decay (`WarmupDecay`, `PolynomialWarmup`), or ReduceLROnPlateau once warmup is over; `build` composes them.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

DECAYS = ("constant", "poly", "cosine", "step")


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
    one decay step.
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
        progress = min(step - self.warmup_steps + 1, self.decay_steps) / self.decay_steps
        if self.decay == "poly":
            return (base_lr - self.end_lr) * (1 - progress) ** self.power + self.end_lr
        return self.end_lr + (base_lr - self.end_lr) * (1 + math.cos(math.pi * progress)) / 2

    def get_lr(self) -> list[float]:
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

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


class Schedule:
    """The run's schedule: `step()` after every optimizer step that was taken, `epoch_end(monitored)` after
    each evaluation (the monitored metric, reduced across ranks). With a plateau, warmup owns the LR until it
    ends and ReduceLROnPlateau after, so neither overwrites the other."""

    def __init__(self, per_step: WarmupDecay | PolynomialWarmup, plateau: ReduceLROnPlateau | None = None):
        self.per_step = per_step
        self.plateau = plateau

    @property
    def warming_up(self) -> bool:
        return self.per_step.last_epoch < self.per_step.warmup_steps

    def step(self, progress: float = 1.0) -> None:
        """One optimizer step taken; AdaScale advances the schedule by its gain r instead of 1."""
        if self.plateau is None or self.warming_up:
            self.per_step.last_epoch += progress - 1
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
        """Where the schedule stood (its step count, the plateau's best and patience counters); this run's own
        settings stay, so a run continued with more --epochs decays over its new length. The LR is set from them,
        except after warmup under a plateau, where the optimizer's restored LR (with its cuts) is the truth."""
        saved = state["per_step"]
        self.per_step.last_epoch = saved["last_epoch"]
        self.per_step._step_count = saved.get("_step_count", self.per_step._step_count)
        if self.plateau is not None and state.get("plateau"):
            for key in ("best", "num_bad_epochs", "cooldown_counter", "last_epoch"):
                setattr(self.plateau, key, state["plateau"][key])
        if self.plateau is None or self.warming_up:
            groups = self.per_step.optimizer.param_groups
            for group, base in zip(groups, self.per_step.base_lrs):
                group["lr"] = self.per_step.lr_at(base, self.per_step.last_epoch)
            self.per_step._last_lr = [group["lr"] for group in groups]


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
