"""The training state: the objects one optimizer step needs, where the run stands (`Progress`), the best value so
far and early stopping, and the checkpoint's named parts (`Training.parts`, training/parts.py): `state_dict()` /
`load_state_dict()` are the header and every part's state by name. A new checkpointed part is one registration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from customized_function import EarlyStopping
from ddp_tricks.distributed.collectives import gather_to_host
from ddp_tricks.distributed.fsdp import is_sharded
from ddp_tricks.distributed.sparse import SparseGradients
from ddp_tricks.distributed.trace_reduction import TraceReduction
from ddp_tricks.errors import UserError
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.shards import local
from ddp_tricks.storage import sharded
from ddp_tricks.training.ema import ModelEma
from ddp_tricks.training.gradients import ByWrapper, Traced
from ddp_tricks.training.meter import EpochMeter
from ddp_tricks.training.metric_states import Layout
from ddp_tricks.training.noise import MicroBatches, NoiseScale, RankGradient
from ddp_tricks.training.parts import (
    Absent,
    Ema,
    Monitored,
    Needed,
    Noise,
    RandomStates,
    TaskState,
    Weights,
    restore_rng,
)
from ddp_tricks.training.precision import Precision

__all__ = ["Best", "NonFiniteLoss", "Progress", "Training", "describe_optimizer", "restore_rng"]


@dataclass
class Best:
    """The best value of the monitored validation metric so far, its epoch and that epoch's other metrics."""

    metric: str  # e.g. "val_loss"
    mode: str  # "min" or "max": which way it improves
    value: float = math.nan
    epoch: int = 0
    val: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if math.isnan(self.value):
            self.value = math.inf if self.mode == "min" else -math.inf

    def update(self, epoch: int, row: dict) -> bool:
        """Record an epoch's metrics row; True when its monitored value is a new best."""
        value = row[self.metric]
        if not (value < self.value if self.mode == "min" else value > self.value):
            return False
        self.value, self.epoch = value, epoch
        self.val = {k: v for k, v in row.items() if k.startswith("val_")}
        return True

    def describe(self, run_dir) -> str:
        """A run's last line: the best value, its epoch and that epoch's other metrics, and the run's folder."""
        others = ", ".join(f"{k} {v:.4f}" for k, v in self.val.items() if k != self.metric)
        others = f" ({others})" if others else ""  # a task that reports one metric and no validation loss has none
        return f"best {self.metric} {self.value:.4f} at epoch {self.epoch}{others}; run folder: {run_dir}"

    def state_dict(self) -> dict:
        return {"metric": self.metric, "value": self.value, "epoch": self.epoch, "val": dict(self.val)}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.epoch, self.val = state["value"], state["epoch"], dict(state.get("val", {}))


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite; raised on every rank together."""

    def __init__(self, epoch: int, step: int, rank: int):
        super().__init__(f"non-finite loss or weights at epoch {epoch}, found at step {step}, on rank {rank}")
        self.epoch, self.step, self.rank = epoch, step, rank


@dataclass
class Progress:
    """Where the run stands: the checkpoint's header (with the sampler's position in the epoch: its steps taken),
    and what this process took (its last line)."""

    epoch: int = 0  # the epoch being trained (or last trained)
    completed_epochs: int = 0
    step_in_epoch: int = 0  # optimizer steps already taken in epoch completed_epochs + 1
    global_step: int = 0  # optimizer steps taken or skipped, over the whole run
    skipped_steps: int = 0  # steps skipped (fp16 overflow, or a non-finite loss with "skip"), over the whole run
    first_global_step: int = 0  # where this process began: a checkpoint's, or 0
    steps_in_process: int = 0  # optimizer steps this process took or skipped, counted
    lrs: tuple[float, ...] = ()  # each group's LR the last step applied (host floats; not saved: () before a step)

    def took_step(self, skipped: bool = False) -> None:
        self.global_step += 1
        self.steps_in_process += 1
        self.skipped_steps += skipped


@dataclass
class Training:
    """Everything one optimizer step needs, and everything a checkpoint holds: `parts`, by name."""

    model: nn.Module  # DDP-wrapped in a distributed run without a trace
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    task: object  # see task.py
    sum_names: InitVar[list[str]]  # the task's metric_sums keys, in the order the epoch's meter holds them
    precision: Precision
    device: torch.device
    clip_grad_norm: float = 0.0
    channels_last: bool = False
    on_nonfinite: str = "stop"  # without a scaler: "stop" the run, or "skip" the step (one host sync per step)
    reduction: InitVar[TraceReduction | None] = None  # a traced run's own gradient reduction (no DDP)
    sparse: InitVar[SparseGradients | None] = None  # the sparse tables' gradients, averaged apart from DDP's reducer
    accumulation: Callable | None = None  # how a step's micro-batches make its gradient: None, loop.py's plain one
    noise: NoiseScale | None = None  # the gradient noise scale's moving averages (None: not measured)
    noise_parts: MicroBatches | RankGradient | None = None  # the small batches' reader (a traced run: None)
    sum_shapes: InitVar[dict | None] = None  # the metric sums that are not scalars: {name: shape}
    scoring: Layout | None = None  # the states of the task's score(), which evaluates in place of loss and sums
    best: Best | None = None  # the monitored metric's best so far (None: not followed)
    early_stopping: EarlyStopping | None = None
    ema: ModelEma | None = None  # --model-ema: the EMA of the weights, stepped after every optimizer step taken
    epochs: int = 1  # the run's --epochs: the task's per-step hook is told how far the run is (its `progress`)
    rank: int = 0
    world_size: int = 1
    progress: Progress = field(default_factory=Progress)
    meter: EpochMeter = field(init=False)  # the epoch's running sums
    gradients: ByWrapper | Traced = field(init=False)  # how the step's gradients reach every rank
    parts: dict = field(init=False)  # the checkpoint's named parts: {name: a state_dict()/load_state_dict() holder}

    def __post_init__(self, sum_names, reduction, sparse, sum_shapes) -> None:
        self.meter = EpochMeter(Layout.scalars(sum_names, sum_shapes), self.device, self.rank, self.world_size)
        params = [p for p in self.raw_model.parameters() if p.requires_grad]
        noise = self.noise if reduction is None else None
        self.gradients = Traced(reduction) if reduction is not None else ByWrapper(self.model, params, sparse, noise)
        self.best = self.best or Best("val_loss", "min")
        self.parts = {
            "model": Weights(self.raw_model),
            "optimizer": self.optimizer,
            "schedule": Needed(self.schedule),
            "scaler": self.precision,
            "best": Monitored(self.best, self.early_stopping),
            "adascale": Needed(self.adascale) if self.adascale is not None else Absent(),
            "noise": Absent() if self.noise is None else Noise(self.noise, self.rank, self.world_size),
            "ema": Absent() if self.ema is None else Ema(self.ema, self.raw_model),  # after the model: starts from it
            "task": TaskState(self.task),
            "rng": RandomStates(self.world_size),
            "epoch_sums": self.meter,
        }

    @property
    def raw_model(self) -> nn.Module:
        """The model without torch.compile's and DDP's wrappers: what checkpoints hold and evaluation runs."""
        model = getattr(self.model, "_orig_mod", self.model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def sums_layout(self) -> Layout:
        """The task's metric sums, in the order the epoch's meter holds them (after the loss), with their shapes."""
        return self.meter.layout

    @property
    def adascale(self):
        """AdaScale's estimator, in a traced run with --batch-lr-rule adascale: the LR and the schedule's
        progress are scaled by its gain r each step."""
        return self.gradients.adascale

    @property
    def sharded(self) -> bool:
        """--strategy fsdp: every forward gathers parameters from every rank, so all ranks run as many."""
        return is_sharded(self.model)

    @property
    def lr(self) -> float:
        """The LR the last step applied (before any step: the schedule's now), as a parameter group's LR over its
        multiplier (the task's param_groups()): the schedule's times the step's factor (a --batch-trace run's batch
        rule, AdaScale's gain)."""
        group = self.optimizer.param_groups[0]
        return (self.progress.lrs[0] if self.progress.lrs else group["lr"]) / group.get("lr_mult", 1.0)

    @property
    def stopped_early(self) -> bool:
        return self.early_stopping is not None and self.early_stopping.early_stop

    def end_epoch(self, row: dict) -> bool:
        """After an epoch's evaluation: `after_evaluation`, and the epoch is done. True when it is a new best."""
        improved = self.after_evaluation(row)
        self.progress.completed_epochs, self.progress.step_in_epoch = self.progress.epoch, 0
        self.meter.close()
        return improved

    def after_evaluation(self, row: dict) -> bool:
        """After an evaluation (an epoch's, or --eval-every-steps'): the schedule, the best value and early stopping
        see the monitored metric (reduced across ranks: every rank decides the same). True when it is a new best."""
        monitored = row[self.best.metric]
        self.schedule.epoch_end(monitored)
        improved = self.best.update(self.progress.epoch, row)
        if self.early_stopping is not None:
            self.early_stopping(monitored)
        return improved

    def describe_resume(self, source) -> str:
        """Where a resumed run starts, as its checkpoint `source` says (the log's line; tests read it)."""
        epoch, step = self.progress.completed_epochs, self.progress.step_in_epoch
        return (
            f"resumed from {source}: epoch {epoch} done, {step} step(s) into epoch {epoch + 1}, "
            f"global step {self.progress.global_step}"
        )

    def describe_steps(self) -> str:
        """The optimizer steps this process took (or skipped), counted as they were taken, and the global steps it
        went between (the log's last line; tests read it: a resume takes exactly the steps its checkpoint lacks)."""
        return (
            f"{self.progress.steps_in_process} optimizer step(s) in this process "
            f"(global steps {self.progress.first_global_step} -> {self.progress.global_step})"
        )

    @property
    def checks_loss(self) -> bool:
        """Whether a non-finite epoch loss stops the run (fp16's scaler, or "skip", skip such steps instead)."""
        return not self.precision.skips_nonfinite and self.on_nonfinite == "stop"

    def nonfinite_flag(self, check_weights: bool = False) -> torch.Tensor | None:
        """This rank's "something is non-finite" as a one-element float on the device (None: nothing to check): its
        epoch loss (when a non-finite loss stops the run), and with `check_weights` its weights and buffers (the
        slices it holds of sharded ones)."""
        bad = None
        if self.checks_loss and self.meter.sums is not None:
            bad = ~self.meter.loss_finite
        if check_weights:
            state = [local(v) for v in self.raw_model.state_dict().values() if v.is_floating_point()]
            weights_bad = ~torch.stack([v.isfinite().all() for v in state]).all()
            bad = weights_bad if bad is None else bad | weights_bad
        return None if bad is None else bad.reshape(1).to(torch.float64)

    def raise_if_nonfinite(self, check_weights: bool = False, flags: list[float] | None = None, step=None) -> None:
        """Stop every rank together when any rank's epoch loss has become non-finite (one small collective, or none
        when `flags`, every rank's nonfinite_flag(), came with another: a step row's, read a step later: `step`, the
        step they were taken at).

        Called at rows' steps, at the end of the epoch, and (with `check_weights`) before every checkpoint, where
        non-finite weights or buffers count too: a finite loss can still take a step to infinite weights, and those
        must never replace the last good checkpoint.
        """
        if flags is None:
            if self.precision.skips_nonfinite and not check_weights:
                return  # fp16: the GradScaler skips such steps itself
            bad = self.nonfinite_flag(check_weights)
            if bad is None:
                return
            flags = gather_to_host(bad).flatten().tolist()
        if any(flags):
            raise NonFiniteLoss(self.progress.epoch, step or self.progress.global_step, flags.index(1.0))

    def header(self) -> dict:
        """What every reader of a checkpoint looks at first: where the run stands, the optimizer it was trained
        with and the names of its parameters in its groups' order (--init-optimizer maps its state by them), the world
        size that wrote it (the sampler's position: `step_in_epoch` steps into epoch `epoch` + 1)."""
        p, names = self.progress, {id(param): name for name, param in self.raw_model.named_parameters()}
        return {
            "epoch": p.completed_epochs,
            "step_in_epoch": p.step_in_epoch if self.meter.open else 0,
            "global_step": p.global_step,
            "skipped_steps": p.skipped_steps,
            "optimizer_name": describe_optimizer(self.optimizer),
            "optimizer_parameters": [
                names.get(id(q), "") for group in self.optimizer.param_groups for q in group["params"]
            ],
            "world_size": self.world_size,
        }

    def state_dict(self, names: tuple[str, ...] | None = None) -> dict:
        """The header and every part's state by name (or the parts `names`): a collective (the RNG, the running
        sums and the noise scale are every rank's), called on every rank. Tensors and plain containers only, so
        `torch.load(weights_only=True)` reads it back."""
        chosen = self.parts if names is None else {name: self.parts[name] for name in names if name in self.parts}
        return self.header() | {name: part.state_dict() for name, part in chosen.items()}

    def load_state_dict(self, state: dict, source: str, names: tuple[str, ...] | None = None) -> None:
        """The header and the parts of a checkpoint (or the parts `names`); a part the checkpoint lacks starts
        fresh. A sharded checkpoint's slices are read here, cut to this run's shards (`source`: its folder). A
        sharded run's best.pt (--eval-only; no optimizer state) loads its EMA and task state: its weights are in
        the model already (before sharding)."""
        if "optimizer" not in state:
            names = ("ema", "task")
        elif self.sharded:
            state = sharded.fill(state, source, self.raw_model)
        if "optimizer" in state:
            self._check_optimizer(state.get("optimizer_name"), source)
        if "early_stopping" in state:  # written before the parts: early stopping beside best, not in it
            state = state | {"best": state["best"] | {"early_stopping": state["early_stopping"]}}
        for name, part in self.parts.items():
            if names is None or name in names:
                self._load_part(name, part, state.get(name), source)
        p = self.progress
        p.global_step = p.first_global_step = state.get("global_step", 0)
        p.skipped_steps = state.get("skipped_steps", 0)
        p.completed_epochs = p.epoch = state["epoch"]
        p.step_in_epoch = state.get("step_in_epoch", 0)

    def _check_optimizer(self, saved: str | None, source: str) -> None:
        ours = describe_optimizer(self.optimizer)
        if saved != ours:
            raise UserError(
                f"checkpoint {source!r} was trained with {saved}, these flags build {ours}; "
                "resume with the optimizer flags it was trained with"
            )

    @staticmethod
    def _load_part(name: str, part, state, source: str) -> None:
        try:
            part.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as error:
            what = "an optimizer state" if name in ("optimizer", "schedule") else f"a {name!r} state"
            raise UserError(
                f"checkpoint {source!r} holds {what} that does not fit these flags "
                f"({str(error).splitlines()[0][:80]}); resume with the flags it was trained with"
            ) from None


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`Lookahead(LARSWrapper(SGD))`: the optimizer and the wrappers around it."""
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ + (f"({describe_optimizer(inner)})" if inner is not None else "")
