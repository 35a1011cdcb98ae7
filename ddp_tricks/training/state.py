"""The training state: the objects one optimizer step needs, the counters that outlive an epoch, the best value so
far and early stopping, in one object whose `state_dict()` / `load_state_dict()` are what a checkpoint holds.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from customized_function import EarlyStopping
from ddp_tricks.distributed.collectives import gather_objects, gather_to_host
from ddp_tricks.distributed.fsdp import is_sharded
from ddp_tricks.distributed.sparse import SparseGradients
from ddp_tricks.distributed.trace_reduction import TraceReduction
from ddp_tricks.errors import UserError
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.shards import local
from ddp_tricks.storage import sharded
from ddp_tricks.training.ema import ModelEma
from ddp_tricks.training.metric_states import Layout
from ddp_tricks.training.noise import MicroBatches, NoiseScale, RankGradient
from ddp_tricks.training.precision import Precision


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
class Training:
    """Everything one optimizer step needs, and everything a checkpoint holds."""

    model: nn.Module  # DDP-wrapped in a distributed run without a trace
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    task: object  # see task.py
    sum_names: list[str]  # the task's metric_sums keys, in the order the sums vector holds them
    precision: Precision
    device: torch.device
    clip_grad_norm: float = 0.0
    channels_last: bool = False
    on_nonfinite: str = "stop"  # without a scaler: "stop" the run, or "skip" the step (one host sync per step)
    reduction: TraceReduction | None = None  # a traced run's own gradient reduction (no DDP)
    sparse: SparseGradients | None = None  # the sparse tables' gradients, averaged apart from DDP's reducer
    accumulation: Callable | None = None  # how a step's micro-batches make its gradient: None, loop.py's plain one
    global_loss: bool = False  # the task's loss gathers from every rank: evaluation keeps the ranks in step
    noise: NoiseScale | None = None  # the gradient noise scale's moving averages (None: not measured)
    noise_parts: MicroBatches | RankGradient | None = None  # the small batches' reader (a traced run: None)
    sum_shapes: dict = field(default_factory=dict)  # the metric sums that are not scalars: {name: shape}
    scoring: Layout | None = None  # the states of the task's score(), which evaluates in place of loss and sums
    best: Best | None = None  # the monitored metric's best so far (None: not followed)
    early_stopping: EarlyStopping | None = None
    ema: ModelEma | None = None  # --model-ema: the EMA of the weights, stepped after every optimizer step taken
    epochs: int = 1  # the run's --epochs: the task's per-step hook is told how far the run is (its `progress`)
    rank: int = 0
    world_size: int = 1
    parts: dict = field(default_factory=dict)  # more named parts of the checkpoint: {name: a state_dict() holder}
    epoch: int = 0  # the epoch being trained (or last trained)
    completed_epochs: int = 0
    step_in_epoch: int = 0  # optimizer steps already taken in epoch completed_epochs + 1
    global_step: int = 0  # optimizer steps taken or skipped, over the whole run
    skipped_steps: int = 0  # steps skipped (fp16 overflow, or a non-finite loss with "skip"), over the whole run
    epoch_sums: torch.Tensor | None = field(init=False, default=None)  # this rank's running [loss x units, *sums]
    epoch_units: float | torch.Tensor = field(init=False, default=0.0)  # this rank's units (samples, tokens) in them
    epoch_samples: int = field(init=False, default=0)  # and its samples
    empty_steps: int | torch.Tensor = field(init=False, default=0)  # steps whose units were 0 on every rank
    step_units: torch.Tensor | None = field(init=False, default=None)  # the step's units over every rank (units())
    resume_sums: torch.Tensor | None = field(init=False, default=None)  # a checkpoint's, to continue its epoch
    resume_rng: dict | None = field(init=False, default=None)  # this rank's RNG of a mid-epoch checkpoint
    lr_log: list = field(init=False, default_factory=list)  # (global step, LR used): warmup steps, then every 10th
    first_global_step: int = field(init=False, default=0)  # where this process began: a checkpoint's, or 0
    steps_in_process: int = field(init=False, default=0)  # optimizer steps this process took or skipped, counted

    @property
    def raw_model(self) -> nn.Module:
        """The model without torch.compile's and DDP's wrappers: what checkpoints hold and evaluation runs."""
        model = getattr(self.model, "_orig_mod", self.model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    @functools.cached_property
    def sums_layout(self) -> Layout:
        """The task's metric sums, in the order the running sums hold them (after the loss), with their shapes."""
        return Layout.scalars(self.sum_names, self.sum_shapes)

    @property
    def adascale(self):
        """AdaScale's estimator, in a traced run with --batch-lr-rule adascale: the LR and the schedule's
        progress are scaled by its gain r each step."""
        return self.reduction.adascale if self.reduction is not None else None

    @property
    def sharded(self) -> bool:
        """--strategy fsdp: every forward gathers parameters from every rank, so all ranks run as many."""
        return is_sharded(self.model)

    @property
    def units_per_sample(self) -> float:
        """This rank's units per sample in the epoch so far (the last one, at an epoch's start): 1 for a task that
        counts samples (a host read of a device count otherwise: never in a step)."""
        return float(self.epoch_units) / self.epoch_samples if self.epoch_samples else 1.0

    @property
    def lr(self) -> float:
        """The schedule's LR now: a parameter group's LR over its multiplier (the task's param_groups())."""
        group = self.optimizer.param_groups[0]
        return group["lr"] / group.get("lr_mult", 1.0)

    @property
    def stopped_early(self) -> bool:
        return self.early_stopping is not None and self.early_stopping.early_stop

    def end_epoch(self, row: dict) -> bool:
        """After an epoch's evaluation: `after_evaluation`, and the epoch is done. True when it is a new best."""
        improved = self.after_evaluation(row)
        self.completed_epochs, self.step_in_epoch = self.epoch, 0
        return improved

    def after_evaluation(self, row: dict) -> bool:
        """After an evaluation (an epoch's, or --eval-every-steps'): the schedule, the best value and early stopping
        see the monitored metric (reduced across ranks: every rank decides the same). True when it is a new best."""
        monitored = row[self.best.metric]
        self.schedule.epoch_end(monitored)
        improved = self.best.update(self.epoch, row)
        if self.early_stopping is not None:
            self.early_stopping(monitored)
        return improved

    def describe_resume(self, source) -> str:
        """Where a resumed run starts, as its checkpoint `source` says (the log's line; tests read it)."""
        epoch, step = self.completed_epochs, self.step_in_epoch
        return (
            f"resumed from {source}: epoch {epoch} done, {step} step(s) into epoch {epoch + 1}, "
            f"global step {self.global_step}"
        )

    def describe_steps(self) -> str:
        """The optimizer steps this process took (or skipped), counted as they were taken, and the global steps it
        went between (the log's last line; tests read it: a resume takes exactly the steps its checkpoint lacks)."""
        return (
            f"{self.steps_in_process} optimizer step(s) in this process "
            f"(global steps {self.first_global_step} -> {self.global_step})"
        )

    def raise_if_nonfinite(self, check_weights: bool = False) -> None:
        """Stop every rank together when any rank's epoch loss has become non-finite (one small collective).

        Called every `--log-interval` steps, at the end of the epoch, and (with `check_weights`) before every
        checkpoint, where non-finite weights or buffers count too: a finite loss can still take a step to
        infinite weights, and those must never replace the last good checkpoint.
        """
        if self.precision.skips_nonfinite or (self.on_nonfinite != "stop" and not check_weights):
            return  # fp16: the GradScaler skips such steps itself
        bad = None
        if self.on_nonfinite == "stop" and self.epoch_sums is not None:
            bad = ~torch.isfinite(self.epoch_sums[0])
        if check_weights:
            # sharded weights: each rank checks the slices it holds, and the flags below gather every rank's
            state = [local(v) for v in self.raw_model.state_dict().values() if v.is_floating_point()]
            weights_bad = ~torch.stack([v.isfinite().all() for v in state]).all()
            bad = weights_bad if bad is None else bad | weights_bad
        if bad is None:
            return
        flags = gather_to_host(bad.reshape(1).to(torch.float32)).flatten().tolist()
        if any(flags):
            raise NonFiniteLoss(self.epoch, self.global_step, flags.index(1.0))

    def check_units(self) -> None:
        """A step whose micro-batches held no unit on any rank (the task's units() gave 0 everywhere) trains on
        nothing: said as a user error, on every rank together (the count was all-reduced)."""
        if isinstance(self.empty_steps, torch.Tensor) and self.empty_steps.item() > 0:
            raise UserError(
                f"{int(self.empty_steps.item())} optimizer step(s) so far in epoch {self.epoch} held no units: the "
                "task's units() gave 0 for every micro-batch of the step on every rank; every step needs at least one "
                "unit (a real token, pixel or sample): check units() and the data"
            )

    def state_dict(self) -> dict:
        """The whole training state, with every rank's RNG and (mid-epoch) running sums: a collective, called on
        every rank. Tensors and plain containers only, so `torch.load(weights_only=True)` reads it back."""
        mine = rng_state()
        restore_rng(mine)  # set as a resume sets it: cuDNN's RNN dropout draws anew here, resumed or not (restore_rng)
        rng = gather_objects(mine)
        mid_epoch = self.step_in_epoch > 0 and self.epoch_sums is not None
        sums = None
        if mid_epoch:
            device = self.epoch_sums.device
            units = torch.as_tensor(self.epoch_units, dtype=torch.float64, device=device).reshape(1)
            samples = torch.tensor([float(self.epoch_samples)], dtype=torch.float64, device=device)
            sums = gather_to_host(torch.cat([self.epoch_sums, units, samples]))
        adascale = self.adascale
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_name": describe_optimizer(self.optimizer),
            "schedule": self.schedule.state_dict(),
            "scaler": self.precision.state_dict(),
            "early_stopping": self.early_stopping.state_dict() if self.early_stopping is not None else None,
            "adascale": adascale.state_dict() if adascale is not None else None,
            "noise": gather_to_host(self.noise.packed()) if self.noise is not None else None,  # per rank
            "epoch": self.completed_epochs,
            "step_in_epoch": self.step_in_epoch if mid_epoch else 0,  # optimizer steps taken in epoch `epoch + 1`
            "epoch_sums": sums,  # each rank's running [loss x units, *metric sums, units, samples], mid-epoch only
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "best": self.best.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,  # sharded like the model under FSDP
            "task": self.task_state(),
            "rng": rng,
            "world_size": self.world_size,
        } | {name: part.state_dict() for name, part in self.parts.items()}

    def task_state(self) -> dict | None:
        """The task's own state (a DINO centre), rank 0's; None for a task without `state_dict()`."""
        return self.task.state_dict() if callable(getattr(self.task, "state_dict", None)) else None

    def load_state_dict(self, state: dict, source: str) -> None:
        """Everything a checkpoint holds, the model's weights included. A sharded checkpoint's slices are read
        here, cut to this run's shards (`source`: its folder). Where the checkpoint followed another monitored
        metric, this run's best and early stopping start fresh. A sharded run's best.pt (--eval-only; no optimizer
        state): its weights are in the model already (before sharding), its EMA, task state and counters here."""
        if "optimizer" not in state:
            self._load_for_evaluation(state)
            return
        if self.sharded:
            state = sharded.fill(state, source, self.raw_model)
        self.raw_model.load_state_dict(state["model"])
        saved, ours = state.get("optimizer_name"), describe_optimizer(self.optimizer)
        if saved != ours:
            raise UserError(
                f"checkpoint {source!r} was trained with {saved}, these flags build {ours}; "
                "resume with the optimizer flags it was trained with"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise UserError(
                f"checkpoint {source!r} holds an optimizer state that does not fit these flags "
                f"({str(error).splitlines()[0][:80]}); resume with the flags it was trained with"
            ) from None
        self.precision.load_state_dict(state.get("scaler"))
        if state.get("best", {}).get("metric") == self.best.metric:
            self.best.load_state_dict(state["best"])
            if self.early_stopping is not None and state.get("early_stopping"):
                self.early_stopping.load_state_dict(state["early_stopping"])
        if self.adascale is not None and state.get("adascale"):
            self.adascale.load_state_dict(state["adascale"])
        if self.noise is not None and state.get("noise") is not None:
            self.noise.unpack(resume_rows(state["noise"], self.rank, self.world_size, mean=True))
        if self.ema is not None:  # a checkpoint without one: the EMA starts from the resumed weights
            self.ema.load_state_dict(state.get("ema"), self.raw_model)
        self._load_task(state)
        for name, part in self.parts.items():  # a checkpoint from before a part: the part starts fresh
            part.load_state_dict(state.get(name))
        self.global_step = self.first_global_step = state["global_step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.completed_epochs = self.epoch = state["epoch"]
        self.step_in_epoch = state.get("step_in_epoch", 0)
        if self.step_in_epoch:  # the epoch's running sums, which add up over the ranks of any world size
            self.resume_sums = resume_rows(state["epoch_sums"], self.rank, self.world_size)
            saved_rng = state["rng"]  # another world size's ranks draw differently anyway (Plan: same samples)
            self.resume_rng = saved_rng[self.rank] if len(saved_rng) == self.world_size else None

    def _load_task(self, state: dict) -> None:
        if state.get("task") is not None and callable(getattr(self.task, "load_state_dict", None)):
            self.task.load_state_dict(state["task"])

    def _load_for_evaluation(self, state: dict) -> None:
        """A sharded run's best.pt: the EMA's whole weights (cut to this run's slices), the task's state, the
        counters the evaluation row shows."""
        if self.ema is not None:
            self.ema.load_state_dict(state.get("ema"), self.raw_model)
        self._load_task(state)
        self.completed_epochs = self.epoch = state["epoch"]
        self.global_step = self.first_global_step = state.get("global_step", 0)


def resume_rows(saved: torch.Tensor, rank: int, world_size: int, mean: bool = False) -> torch.Tensor:
    """This rank's share of a checkpoint's per-rank rows (one per rank that wrote it): its own row at the same world
    size; else running sums (`mean` False) continue from their total on rank 0 and from zero on the others, and
    averages (`mean`) from their mean on every rank."""
    if len(saved) == world_size:
        return saved[rank]
    if mean:
        return saved.mean(0)
    return saved.sum(0) if rank == 0 else torch.zeros_like(saved[0])


def rng_state() -> dict:
    """This process's random generators, as tensors and plain values (safe for weights_only loading)."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict) -> None:
    """Set this process's random generators to `state` (rng_state's). Setting torch's CUDA generator also makes
    cuDNN's RNN dropout draw its own dropout state anew from it at its next use (that state is not in `state`): so
    a checkpoint sets what it saves (Training.state_dict), and the run it continues draws as the resumed one."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`Lookahead(LARSWrapper(SGD))`: the optimizer and the wrappers around it."""
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ + (f"({describe_optimizer(inner)})" if inner is not None else "")
