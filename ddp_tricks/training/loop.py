"""THE training loop, one for every kind of run (plain, accumulated, traced), and the exact evaluation.

A step is what the plan says: this rank's micro-batches, each forward under autocast, its loss weighted so the
step averages exactly its units (samples, or what the task's `units()` counts: tokens, pixels), backward under
DDP's `no_sync()` until the last one (or, in a traced run, one all-reduce at the end); then clipping, the
GradScaler and the step's LR factor. Batches and outputs may be any structure of tensors (training/batches.py).
Metrics are the task's sums, kept as device tensors: no host sync per step (`.item()` only at logging intervals).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from ddp_tricks.data.loaders import batch_sizes, seed_epoch
from ddp_tricks.distributed import heartbeat
from ddp_tricks.distributed.collectives import (
    alike_rows,
    all_reduce_sum,
    any_rank,
    broadcast_buffers,
    gather_rows,
    sum_to_host,
    uneven_rows,
)
from ddp_tricks.distributed.wrap import accumulating, check_every_gradient, name_unused_parameters
from ddp_tricks.plan import Step
from ddp_tricks.training import noise, precise_bn
from ddp_tricks.training.batches import detached, float_outputs, to_device
from ddp_tricks.training.metric_states import report
from ddp_tricks.training.state import Training
from ddp_tricks.training.step_log import StepLog
from ddp_tricks.training.stepping import training_step


def forward(t: Training, model: nn.Module, inputs, targets):
    """The model under autocast, then the task's loss on its outputs, half-precision tensors cast to float32:
    (outputs, the loss: the mean over the batch's units)."""
    with t.precision.autocast():
        outputs = model(inputs)
    outputs = float_outputs(outputs)
    return outputs, t.task.loss(outputs, targets)


def metric_sums(t: Training, outputs, targets) -> dict:
    """The task's metric sums of a batch (device tensors, by name), on its detached outputs; {} for a task with none."""
    return t.task.metric_sums(detached(outputs), targets) if t.sums_layout.sums else {}


def batch_sums(t: Training, outputs, targets, loss: torch.Tensor, units) -> torch.Tensor:
    """[loss x units, *the task's metric sums, each flattened] on the device, in the widest dtype among them
    (float32 mostly: a batch's sums are exact there); added into float64 running sums."""
    sums = metric_sums(t, outputs, targets)
    return torch.cat([(loss.detach() * units).reshape(1), *t.sums_layout.flat(sums)])  # one op: it promotes dtypes


def units_tensor(units, device: torch.device) -> torch.Tensor:
    """The task's units() of a batch, a number or a one-element tensor, as a float64 scalar on the device (a tensor
    there already: no copy; a number: filled there, no host copy)."""
    if isinstance(units, torch.Tensor):
        return units.to(device, torch.float64, non_blocking=True).reshape(())
    return torch.full((), float(units), dtype=torch.float64, device=device)


def micro_batches(t: Training, step: Step, batches, units_of):
    """This rank's micro-batches of `step`, on the device, each as (inputs, targets, samples, units, weight):
    `weight` multiplies the micro-batch's mean loss so that the step's gradient is the mean over all its units.

    A micro-batch's samples are the plan's: the dataset items it was made of, whatever structure the batch has (a
    list of dicts of boxes, labels concatenated over its sequences). Without the task's `units()`, a unit is a
    sample and the plan knows every weight ahead. With it, the step's micro-batches are fetched first and one
    all-reduce (no host sync) sums their units over the ranks (kept as `t.step_units`, the step's big batch for the
    noise scale: `t.meter.step_units`); every rank takes part, also one with no micro-batch in a traced step."""
    if units_of is None:
        for indices in step.micro_batches:
            inputs, targets = next(batches)
            inputs, targets = to_device(inputs, t.device, t.channels_last), to_device(targets, t.device)
            samples = len(indices)
            yield inputs, targets, samples, samples, samples / step.divisor
        return
    fetched = []
    for indices in step.micro_batches:
        inputs, targets = next(batches)
        inputs, targets = to_device(inputs, t.device, t.channels_last), to_device(targets, t.device)
        fetched.append((inputs, targets, len(indices), units_tensor(units_of(inputs, targets), t.device)))
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for *_, units in fetched:
        total += units
    total = all_reduce_sum(total.reshape(1))[0]
    t.meter.count_empty(total)  # a step with no unit anywhere: said at the next check (check_units)
    # DDP averages the ranks' gradients: a rank's share is its units over the mean units per rank
    scale = (t.world_size if t.gradients.averaged else 1) / total.clamp(min=1)
    for inputs, targets, samples, units in fetched:
        yield inputs, targets, samples, units, units * scale


def plain_accumulation(t: Training, step: Step, batches, units_of):
    """The step's gradient, one micro-batch at a time: each forward and its weighted loss's backward, under
    `no_sync()` until the last (whose backward reduces the step's gradients across ranks). Yields each micro-batch's
    (outputs, targets, loss, units, samples) after its backward, for the epoch's sums."""
    last = len(step.micro_batches) - 1
    # the noise scale's small batches (a measured step's: --noise-scale-every), in the units the loss averages over
    # (samples by default): this rank's gradient under DDP, each micro-batch's in one process; else none is read
    parts = t.noise_parts if t.noise_parts is not None and t.noise.measuring else None
    for k, (inputs, targets, samples, units, weight) in enumerate(micro_batches(t, step, batches, units_of)):
        with contextlib.nullcontext() if k == last else accumulating(t.model):  # gradients reduced on the last
            outputs, loss = forward(t, t.model, inputs, targets)
            whole = type(weight) is float and weight == 1.0  # a step of one micro-batch: no multiply, no sync
            if parts is not None:
                parts.before_backward(last=k == last)
            t.precision.backward(loss if whole else loss * weight, t.optimizer)
        t.gradients.after_backward(weight)
        if parts is not None:
            parts.after_backward(weight, units, t.precision.loss_scale())
        yield outputs, targets, loss, units, samples
    if parts is not None:
        parts.finish()


def start_epoch(t: Training, epoch: int, loader, steps: list[Step], seed: int) -> int:
    """Point the loader at the epoch's steps and seed the epoch; returns the step to start from (a resumed
    epoch continues where its checkpoint stopped, with the RNG that checkpoint saved)."""
    first_step = t.progress.step_in_epoch if epoch == t.progress.completed_epochs + 1 else 0
    loader.batch_sampler.start(steps, first_step)
    seed_epoch(loader, epoch, seed, t.rank)
    t.parts["rng"].resume(t.rank, mid_epoch=first_step > 0)
    t.progress.epoch = epoch
    return first_step


def train_one_epoch(
    t: Training,
    steps: list[Step],
    loader,
    first_step: int = 0,
    log: StepLog | None = None,
    after_step: Callable[[Training], bool] | None = None,
) -> dict[str, float] | None:
    """Train the epoch's `steps` from `first_step` on; return the epoch's metrics reduced across ranks.

    The loader yields this rank's micro-batches of those steps in order. A resumed epoch continues the running sums
    its checkpoint kept (the epoch's meter). `after_step(t)` runs after every optimizer step
    (`t.progress.step_in_epoch` steps done); when it returns True the epoch stops there and None is returned. `log`
    (training/step_log.py's StepLog; None: no rows) starts a row at the steps it says are due and reads it at the
    next step's end, the only reads of the device: the row's one gather carries the loss's non-finite check and the
    empty steps' count.
    """
    try:
        return _train_steps(t, steps, loader, first_step, log or StepLog(0, t.device), after_step)
    except RuntimeError as error:
        name_unused_parameters(error, t.model)  # DDP's "expected to have finished reduction": one line
        raise


def _train_steps(t: Training, steps: list[Step], loader, first_step: int, log: StepLog, after_step):
    t.model.train()
    t.meter.start(resumed=first_step > 0)
    units_of = getattr(t.task, "units", None)
    skip = Skips(t.device) if not t.precision.skips_nonfinite and t.on_nonfinite == "skip" else None
    params = [p for p in t.raw_model.parameters() if p.requires_grad]
    skipped_before, start = t.progress.skipped_steps, time.perf_counter()
    batches = log.begin(t, iter(loader))  # the log times each next(): the data wait
    accumulate = t.accumulation or plain_accumulation  # chosen when the run was built (cached.py's, or this one)
    after_each = t.ema is not None or getattr(t.task, "after_step", None) is not None  # else nothing to call per step
    for done, step in enumerate(steps[first_step:], start=first_step + 1):
        heartbeat.step(t.progress.global_step + 1, first=done == first_step + 1)  # the watchdog's progress
        t.gradients.start_step(t.progress.global_step)
        big = step_gradients(t, step, batches, units_of, accumulate, skip)
        gain = t.gradients.finish(step.batch, big, t.precision.loss_scale())
        due = log.due(t.progress.global_step + 1)
        if due:  # before this step's collectives: a rank whose backward left a DDP bucket unreduced says so alone
            check_every_gradient(t.model)
            log.measure(t, params)  # the gradient norm, before the step zeroes it
        if skip is not None and skip.now(t):  # the step's one host sync: skipped alike on every rank
            t.progress.took_step(skipped=True)
        elif optimizer_step(t, params, step.lr_factor * gain, gain if t.adascale is not None else step.progress):
            if after_each:
                after_optimizer_step(t, run_progress(t.progress.epoch, t.epochs, done, len(steps)))
        t.progress.step_in_epoch = done
        log.settle()  # the previous step's row, its gather done during this step: read, checked, written
        if due:
            log.write(t)  # its one gather checks the loss and the units too, started; settled at the next step
        if after_step is not None and after_step(t):
            log.settle()
            return None
    log.settle()
    return epoch_metrics(t, len(steps), time.perf_counter() - start, t.progress.skipped_steps - skipped_before)


def step_gradients(t: Training, step: Step, batches, units_of, accumulate, skip) -> torch.Tensor | int:
    """The step's micro-batches forward and backward (`accumulate`), each one's sums into the epoch's meter (a
    non-finite one kept out when `skip`ping such steps). Returns the step's units over every rank."""
    # an epoch's short last step gives the ranks micro-batches of different lengths: only there do the task's
    # gathers (its loss's, its metric sums') exchange their row counts, a host read each
    with training_step(), uneven_rows() if step.uneven else contextlib.nullcontext():
        for outputs, targets, loss, units, samples in accumulate(t, step, batches, units_of):
            with torch.no_grad():
                sums = metric_sums(t, outputs, targets)
                if skip is not None:
                    loss, sums = skip.keep(loss, sums)
                t.meter.add(loss, sums, units, samples)
    return step.batch if units_of is None else t.meter.step_units


class Skips:
    """--on-nonfinite skip: a step with a non-finite micro-batch loss on any rank is skipped on every rank (one host
    sync a step); the batch is kept out of the epoch's sums."""

    def __init__(self, device: torch.device):
        self.device = device
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)

    def keep(self, loss: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]:
        """A micro-batch's loss and metric sums, or zeros where its loss is not finite (the step is then skipped)."""
        bad = ~torch.isfinite(loss)
        self.nonfinite |= bad
        return torch.where(bad, 0.0, loss), {name: torch.where(bad, 0, value) for name, value in sums.items()}

    def now(self, t: Training) -> bool:
        if not any_rank(self.nonfinite, self.device):
            return False
        t.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.zero_()
        return True


def epoch_metrics(t: Training, steps: int, seconds: float, skipped: int) -> dict[str, float]:
    """The epoch's training metrics over every rank: its meter's sums (and the noise scale's averages) in one
    all-reduce, after the checks of the loss and the units."""
    t.raise_if_nonfinite()
    t.meter.check_units(t.progress.epoch)
    meter = t.meter
    averages = {"noise": t.noise.corrected()} if t.noise is not None else {}  # the ranks' moving averages, summed
    packed = meter.packed(new_samples=float(meter.samples - meter.samples_at_start), **averages)
    reduced = packed.named(sum_to_host(packed.vector))
    (units,), (samples,), (samples_now,) = reduced["units"], reduced["samples"], reduced["new_samples"]
    measured = noise.report(reduced["noise"], t.world_size) if averages else {}
    return (
        report(t.task, t.sums_layout, "train", reduced["sums"], units)
        | measured
        | {
            "global_batch": samples / max(steps, 1),
            "samples_per_second": samples_now / seconds,
            "epoch_seconds": seconds,
            "skipped_steps": skipped,
        }
    )


def optimizer_step(t: Training, params: list[torch.Tensor], lr_factor: float = 1.0, progress: float = 1.0) -> bool:
    """One optimizer step at the schedule's LR x `lr_factor`, and one schedule step, by `progress` (a traced step:
    its samples over the reference batch's, or AdaScale's gain); an fp16 step the scaler skips does not advance the
    schedule. Returns whether the step was taken."""
    t.progress.lrs = tuple(group["lr"] * lr_factor for group in t.optimizer.param_groups)  # host floats: no sync
    took_step = t.precision.step(t.optimizer, params, t.clip_grad_norm, lr_factor)
    t.progress.took_step(skipped=not took_step)
    if took_step:
        t.schedule.step(progress)
    return took_step


def run_progress(epoch: int, epochs: int, done: int, steps: int) -> float:
    """How far the run is after step `done` of the `steps` of epoch `epoch` (1-based) of `epochs`, in (0, 1]: an
    untraced run's global step over its total steps, exactly (one division of whole numbers)."""
    return ((max(epoch, 1) - 1) * steps + done) / (max(epochs, 1) * steps)


def after_optimizer_step(t: Training, progress: float) -> None:
    """What follows an optimizer step that was taken (not a skipped one), on every rank: the task's per-step hook
    `after_step(model, step, progress)` on the unwrapped model, then the model EMA, which averages what the step
    and the hook left."""
    hook = getattr(t.task, "after_step", None)
    if hook is not None:
        with torch.no_grad():  # state written in place (a teacher's weights), not part of any graph
            hook(t.raw_model, t.progress.global_step, progress)
    if t.ema is not None:
        t.ema.update(t.raw_model)


@torch.no_grad()
def recompute_bn_stats(t: Training, loader, steps: list, samples: int, micro_batch: int, world_size: int) -> int:
    """--precise-bn SAMPLES: BatchNorm statistics from about `samples` training samples in all (whole micro-batches
    of the epoch's `steps`, from its first, also after a resume; split over the ranks; all the epoch has when
    fewer), with the current weights, averaged over the ranks (precise_bn.py). Returns the micro-batches used per
    rank."""
    if samples < 1:
        return 0
    heartbeat.phase("precise-bn")
    loader.batch_sampler.start(steps)
    batches = min(-(-samples // (micro_batch * world_size)), len(loader))
    inputs = (to_device(x, t.device, t.channels_last) for x, _ in loader)
    return precise_bn.recompute(t.raw_model, inputs, batches, t.precision.autocast)


@torch.no_grad()
def evaluate(t: Training, loader) -> dict[str, float]:
    """The task's loss and metrics over the validation set, each sample counted once across ranks: its sums (and
    units) all-reduced once, and the states that score() gives as rows (`gathered`) concatenated across ranks once,
    at the end (an AUC's scores, a detector's detections; uneven counts padded for the gather and cut back). A task
    with score() is evaluated by it alone, on the model's eval-mode outputs: no loss, no `val_loss`.

    Every rank runs the same batches of the same number of rows, by construction (loaders.EvalSampler: each round
    dealt out over the ranks in equal rows, then the few leftover samples, fewer than the ranks, evaluated alike on
    every rank and counted by rank 0 alone), so whatever the task's loss(), metric_sums() or score() calls across
    ranks once per batch (an all_gather of equal shapes, an all_reduce) meets every rank's call with the same shapes,
    and a sharded model's forwards gather alike; no count is exchanged. In a leftover batch gather_with_grad is the
    rows themselves (every rank holds them all). Uses the unwrapped model: a DDP forward would add collectives of its
    own."""
    heartbeat.phase("eval")
    model = t.raw_model
    broadcast_buffers(model)  # BatchNorm running stats drift apart per rank; evaluate rank 0's everywhere
    model.eval()
    units_of = getattr(t.task, "units", None)
    layout = t.scoring or t.sums_layout
    sums = torch.zeros(layout.width + (t.scoring is None) + 1, dtype=torch.float64, device=t.device)
    rows = {name: [] for name in layout.gathered}
    sampler = loader.batch_sampler
    counted = sampler.counted() if hasattr(sampler, "counted") else [True] * len(loader)
    alike = len(loader) - getattr(sampler, "alike", 0)  # the first leftover batch
    for k, (samples, (inputs, targets)) in enumerate(zip(batch_sizes(loader), loader)):  # samples: dataset items
        inputs, targets = to_device(inputs, t.device, t.channels_last), to_device(targets, t.device)
        with alike_rows() if k >= alike else contextlib.nullcontext():
            units = samples if units_of is None else units_tensor(units_of(inputs, targets), t.device)
            states = validation_states(t, model, inputs, targets, units, rows if counted[k] else None)
        if counted[k]:  # a leftover batch on another rank than 0: the same evaluation, its states discarded
            sums[:-1] += states
            sums[-1] += units
    *total, units = sum_to_host(sums)
    gathered = {name: gather_rows(torch.cat(parts)) for name, parts in rows.items()}  # rank order: any order
    return report(t.task, layout, "val", total, units, gathered, loss=t.scoring is None)


def validation_states(t: Training, model: nn.Module, inputs, targets, units, rows: dict | None) -> torch.Tensor:
    """A validation batch's summed states, flat: [loss x units, *metric sums], or, for a task with score(), score()'s
    summed states (its gathered ones appended to `rows`, unless None)."""
    if t.scoring is None:
        outputs, loss = forward(t, model, inputs, targets)
        return batch_sums(t, outputs, targets, loss, units)
    with t.precision.autocast():
        outputs = float_outputs(model(inputs))
    states = t.task.score(outputs, targets)
    for name, parts in (rows or {}).items():
        parts.append(states[name])
    flat = t.scoring.flat(states)
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=t.device)


def evaluate_ema(t: Training, loader) -> dict[str, float]:
    """--model-ema: the same evaluation of the EMA's weights (swapped into the model for it), as `val_ema_*`; {}
    without an EMA."""
    if t.ema is None:
        return {}
    with t.ema.swapped_in(t.raw_model):
        row = evaluate(t, loader)
    return {f"val_ema_{name.removeprefix('val_')}": value for name, value in row.items()}
