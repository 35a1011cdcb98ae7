"""The run's schedule: warmup, then a decay for the rest of the run, or ReduceLROnPlateau on the monitored metric
once warmup is over (`build`); `lrs_over_run` lists the LR of every step for --plot-lr.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ddp_tricks.schedules.curves import PolynomialWarmup, WarmupDecay


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
        if self.plateau is not None and not self.warming_up:
            return
        curve = self.per_step
        if getattr(curve, "decay", None) == "constant" and not self.warming_up:
            curve.last_epoch += progress  # the LR stays the base LR: count the step, skip the scheduler's work
            curve._step_count += 1
            return
        curve.last_epoch += progress - 1
        curve.step()

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
            for group, lr in zip(groups, self.per_step.lrs_at(self.per_step.last_epoch)):
                group["lr"] = lr
            self.per_step._last_lr = [group["lr"] for group in groups]


def lrs_over_run(
    make_schedule,
    base_lr: float,
    steps: int,
    factor_at=lambda step: 1.0,
    progress_at=lambda step: 1.0,
    lr_mults: tuple[float, ...] = (1.0,),
) -> list[list[float]]:
    """The LR each of a run's `steps` uses, for each parameter group (one per LR multiplier in `lr_mults`, as the
    task's param_groups() give them): the schedule stepped (by `progress_at(step)`) on a throwaway optimizer, times
    `factor_at(step)`. One list per group."""
    import torch

    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": base_lr * m, "lr_mult": m} for m in lr_mults]
    probe = torch.optim.SGD(groups, lr=base_lr)
    schedule = make_schedule(probe)
    lrs = [[] for _ in lr_mults]
    for step in range(steps):
        for mine, group in zip(lrs, probe.param_groups):
            mine.append(group["lr"] * factor_at(step))
        probe.step()
        schedule.step(progress_at(step))
    return lrs


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
        # eps=0: every cut is made, in every group alike (torch skips one smaller than eps: a group at a small LR
        # multiplier would keep its LR while the others are cut)
        plateau = ReduceLROnPlateau(
            optimizer, mode=plateau_mode, factor=plateau_factor, patience=plateau_patience, eps=0.0
        )
    return Schedule(per_step, plateau)
