"""THE training loop, one for every kind of run (plain, accumulated, traced), and the exact evaluation.

A step is what the plan says: this rank's micro-batches, each forward under autocast, its loss divided so the
step averages exactly its samples, backward under DDP's `no_sync()` until the last one (or, in a traced run,
one all-reduce at the end); then clipping, the GradScaler and the step's LR factor. Metrics are the task's
sums, kept as device tensors: no host sync per step (`.item()` only at logging intervals).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import precise_bn
from batch_trace import TraceReduction
from config import UserError
from distributed import all_reduce_sum, any_rank, broadcast_buffers, gather_from_ranks
from plan import Step
from precision import Precision
from schedulers import Schedule


@dataclass
class Training:
    """Everything one optimizer step needs, and the counters that outlive an epoch."""

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
    epoch: int = 0
    global_step: int = 0  # optimizer steps taken or skipped, over the whole run
    skipped_steps: int = 0  # steps skipped (fp16 overflow, or a non-finite loss with "skip"), over the whole run
    epoch_sums: torch.Tensor | None = field(init=False, default=None)  # this rank's running sums of the epoch
    lr_log: list = field(init=False, default_factory=list)  # (global step, LR used): warmup steps, then every 10th

    @property
    def raw_model(self) -> nn.Module:
        """The model without torch.compile's and DDP's wrappers: what checkpoints hold and evaluation runs."""
        model = getattr(self.model, "_orig_mod", self.model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def adascale(self):
        """AdaScale's estimator, in a traced run with --batch-lr-rule adascale: the LR and the schedule's
        progress are scaled by its gain r each step."""
        return self.reduction.adascale if self.reduction is not None else None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def to_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.device, non_blocking=True)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets.to(self.device, non_blocking=True)

    def forward(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        """The model under autocast, then the task's loss on float outputs: (outputs, batch-mean loss)."""
        with self.precision.autocast():
            outputs = model(inputs)
        outputs = outputs.float() if outputs.is_floating_point() else outputs
        return outputs, self.task.loss(outputs, targets)

    def batch_sums(self, outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """[loss x samples, *the task's metric sums], float64 on the device."""
        sums = self.task.metric_sums(outputs.detach(), targets) if self.sum_names else {}
        # one stack (it promotes the dtypes) and one cast: the fewest operations per micro-batch
        return torch.stack([loss.detach() * len(targets), *(sums[k] for k in self.sum_names)]).double()

    def report(self, prefix: str, sums: torch.Tensor, count: float) -> dict[str, float]:
        """The task's reported metrics from sums reduced over a whole set: `{prefix}_loss`, `{prefix}_<name>`."""
        return report(self.task, self.sum_names, prefix, sums.tolist(), count)


def progress_bar(enabled: bool, total: int, description: str):
    """A tqdm bar on stderr (rank 0, unless --no-progress), or None."""
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)


def report(task, sum_names: list[str], prefix: str, values: list[float], count: float) -> dict[str, float]:
    count = max(count, 1.0)  # an epoch with no step left (resumed at its very end) has no samples
    sums = dict(zip(sum_names, values[1:]))
    metrics = task.metrics(sums, count) if hasattr(task, "metrics") else {k: v / count for k, v in sums.items()}
    return {f"{prefix}_loss": values[0] / count} | {f"{prefix}_{k}": float(v) for k, v in metrics.items()}


def check_task(task, model: nn.Module, dataset) -> list[str]:
    """One forward pass and loss on four training samples, before any process group: initialises lazy modules,
    and turns a model that does not fit the loss into one line. Returns the task's metric-sum names."""
    inputs, targets = torch.utils.data.default_collate([dataset[i] for i in range(min(4, len(dataset)))])
    training = model.training
    model.eval()  # no BatchNorm statistics change
    try:
        with torch.no_grad():
            outputs = model(inputs)
            loss = task.loss(outputs.float(), targets)
            sums = task.metric_sums(outputs.float(), targets) if hasattr(task, "metric_sums") else {}
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
        raise UserError(
            f"the task's model output (on inputs of shape {tuple(inputs.shape)}) does not fit its loss or metrics "
            f"({reason}); make model() return what loss() expects"
        ) from None
    finally:
        model.train(training)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UserError("the task's loss() must return the batch mean as a scalar tensor, e.g. F.mse_loss(...)")
    shaped = [k for k, v in sums.items() if not isinstance(v, torch.Tensor) or v.dim() != 0]
    if shaped:
        raise UserError(f"the task's metric_sums() must give scalar tensors (batch sums); {shaped[0]!r} is not")
    modes = getattr(task, "better", {})
    if any(mode not in ("min", "max") for mode in modes.values()):
        raise UserError(f"the task's `better` must map each metric to 'min' or 'max', got {modes}")
    values = [float(loss) * len(targets), *(float(v) for v in sums.values())]
    try:  # the names metrics() reports, from these samples' sums (a degenerate sample may not compute: no check)
        reported = set(report(task, list(sums), "", values, float(len(targets)))) - {"_loss"}
    except ArithmeticError:
        reported = None
    declared = {f"_{name}" for name in getattr(task, "better", {})}
    if reported is not None and reported != declared:
        raise UserError(
            f"the task reports metrics {sorted(m[1:] for m in reported)} but its `better` names "
            f"{sorted(m[1:] for m in declared)}: give each reported metric 'min' or 'max' in `better`"
        )
    return list(sums)


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite; raised on every rank together."""

    def __init__(self, epoch: int, step: int, rank: int):
        super().__init__(f"non-finite loss or weights at epoch {epoch}, found at step {step}, on rank {rank}")
        self.epoch, self.step, self.rank = epoch, step, rank


def train_one_epoch(
    t: Training,
    steps: list[Step],
    loader,
    first_step: int = 0,
    sums: torch.Tensor | None = None,
    progress=None,
    log_interval: int = 20,
    after_step: Callable[[int, Callable[[], torch.Tensor]], bool] | None = None,
) -> dict[str, float] | None:
    """Train the epoch's `steps` from `first_step` on; return the epoch's metrics reduced across ranks.

    The loader yields this rank's micro-batches of those steps in order. To continue an epoch, `sums` holds this
    rank's running [loss, *metric sums, samples] from then. `after_step(steps_done, current_sums)` runs after
    every optimizer step; when it returns True the epoch stops there and None is returned.
    """
    t.model.train()
    width = len(t.sum_names) + 1
    start_sums = torch.zeros(width + 1, dtype=torch.float64) if sums is None else sums.cpu()
    running = start_sums[:width].to(t.device, copy=True)
    count = int(start_sums[width])
    t.epoch_sums = running  # a non-finite loss makes it non-finite: "stop" checks it, at no cost per step

    def current_sums() -> torch.Tensor:
        return torch.cat([running, torch.tensor([float(count)], dtype=torch.float64, device=t.device)])

    skip_nonfinite = not t.precision.skips_nonfinite and t.on_nonfinite == "skip"
    step_nonfinite = torch.zeros((), dtype=torch.bool, device=t.device)
    params = [p for p in t.raw_model.parameters() if p.requires_grad]
    skipped_before, start = t.skipped_steps, time.perf_counter()
    batches = iter(loader)
    if progress is not None:
        progress.update(first_step)
    for done, step in enumerate(steps[first_step:], start=first_step + 1):
        for k in range(len(step.micro_batches)):
            inputs, targets = t.to_device(*next(batches))
            sync = k == len(step.micro_batches) - 1 or not hasattr(t.model, "no_sync")  # DDP: reduce on the last
            with contextlib.nullcontext() if sync else t.model.no_sync():
                outputs, loss = t.forward(t.model, inputs, targets)
                t.precision.backward(loss * (len(targets) / step.divisor), t.optimizer)
            if t.reduction is not None:
                t.reduction.after_backward(len(targets), step.batch)
            with torch.no_grad():
                row = t.batch_sums(outputs, targets, loss)
                if skip_nonfinite:  # keep the skipped batch out of the epoch's sums
                    nonfinite = ~torch.isfinite(row[0])
                    step_nonfinite |= nonfinite
                    row = torch.where(nonfinite, torch.zeros_like(row), row)
                running += row
            count += len(targets)
        factor = step.lr_factor
        gain = t.reduction.finish(step.batch) if t.reduction is not None else 1.0
        if t.adascale is not None:
            factor *= gain
        if skip_nonfinite and any_rank(step_nonfinite.item(), t.device):
            t.optimizer.zero_grad(set_to_none=True)  # the same decision on every rank: skip and count it
            t.global_step += 1
            t.skipped_steps += 1
            step_nonfinite.zero_()
        else:
            optimizer_step(t, params, factor, gain)
        if done % log_interval == 0:
            raise_if_nonfinite(t)
        if after_step is not None and after_step(done, current_sums):
            return None
        if progress is not None and done % log_interval == 0:
            progress.set_postfix(loss=f"{running[0].item() / max(count, 1):.4f}", lr=f"{t.lr:.4g}",
                                 samples_per_s=f"{count / (time.perf_counter() - start):.0f}")  # fmt: skip
            progress.update(done - progress.n)
    if progress is not None:
        progress.update(len(steps) - progress.n)
    raise_if_nonfinite(t)
    seconds = time.perf_counter() - start
    trained_now = torch.tensor([count - float(start_sums[width])], dtype=torch.float64, device=t.device)
    *total, samples, samples_now = all_reduce_sum(torch.cat([current_sums(), trained_now])).tolist()
    return t.report("train", torch.tensor(total), samples) | {
        "global_batch": samples / max(len(steps), 1),
        "samples_per_second": samples_now / seconds,
        "epoch_seconds": seconds,
        "skipped_steps": t.skipped_steps - skipped_before,
    }


def optimizer_step(t: Training, params: list[torch.Tensor], lr_factor: float = 1.0, progress: float = 1.0) -> None:
    """One optimizer step at the schedule's LR x `lr_factor`, and one schedule step (by `progress` with AdaScale);
    an fp16 step the scaler skips does not advance the schedule."""
    if t.schedule.warming_up or t.global_step % 10 == 0:
        t.lr_log.append((t.global_step + 1, t.lr * lr_factor))  # host floats: no sync
    took_step = t.precision.step(t.optimizer, params, t.clip_grad_norm, lr_factor)
    t.global_step += 1
    if not took_step:
        t.skipped_steps += 1
        return
    t.schedule.step(progress if t.adascale is not None else 1.0)  # AdaScale: scale-invariant progress, by r


def raise_if_nonfinite(t: Training, check_weights: bool = False) -> None:
    """Stop every rank together when any rank's epoch loss has become non-finite (one small collective).

    Called every `--log-interval` steps, at the end of the epoch, and (with `check_weights`) before every
    checkpoint, where non-finite weights or buffers count too: a finite loss can still take a step to
    infinite weights, and those must never replace the last good checkpoint.
    """
    if t.precision.skips_nonfinite or (t.on_nonfinite != "stop" and not check_weights):
        return  # fp16: the GradScaler skips such steps itself
    bad = None
    if t.on_nonfinite == "stop" and t.epoch_sums is not None:
        bad = ~torch.isfinite(t.epoch_sums[0])
    if check_weights:
        state = [v for v in t.raw_model.state_dict().values() if v.is_floating_point()]  # parameters and buffers
        weights_bad = ~torch.stack([v.isfinite().all() for v in state]).all()
        bad = weights_bad if bad is None else bad | weights_bad
    if bad is None:
        return
    flags = gather_from_ranks(bad.reshape(1).to(torch.float32)).flatten().tolist()
    if any(flags):
        raise NonFiniteLoss(t.epoch, t.global_step, flags.index(1.0))


@torch.no_grad()
def recompute_bn_stats(t: Training, loader, steps: list, samples: int, micro_batch: int, world_size: int) -> int:
    """--precise-bn SAMPLES: BatchNorm statistics from about `samples` training samples in all (whole micro-batches
    of the epoch's `steps`, from its first, also after a resume; split over the ranks; all the epoch has when
    fewer), with the current weights, averaged over the ranks (precise_bn.py). Returns the micro-batches used per
    rank."""
    if samples < 1:
        return 0
    loader.batch_sampler.start(steps)
    batches = min(-(-samples // (micro_batch * world_size)), len(loader))
    inputs = (t.to_device(x, y)[0] for x, y in loader)
    return precise_bn.recompute(t.raw_model, inputs, batches, t.precision.autocast)


def evaluate(t: Training, loader) -> dict[str, float]:
    """The task's loss and metrics over the validation set, each sample counted once across ranks (sums and
    counts). Uses the unwrapped model: ranks hold different numbers of validation batches, and a DDP forward
    would wait for the others."""
    model = t.raw_model
    broadcast_buffers(model)  # BatchNorm running stats drift apart per rank; evaluate rank 0's everywhere
    model.eval()
    sums = torch.zeros(len(t.sum_names) + 2, dtype=torch.float64, device=t.device)
    for inputs, targets in loader:
        inputs, targets = t.to_device(inputs, targets)
        outputs, loss = t.forward(model, inputs, targets)
        sums[:-1] += t.batch_sums(outputs, targets, loss)
        sums[-1] += len(targets)
    *total, samples = all_reduce_sum(sums).tolist()
    return t.report("val", torch.tensor(total), samples)
