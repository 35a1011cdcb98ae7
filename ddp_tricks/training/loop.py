"""THE training loop, one for every kind of run (plain, accumulated, traced), and the exact evaluation.

A step is what the plan says: this rank's micro-batches, each forward under autocast, its loss divided so the
step averages exactly its samples, backward under DDP's `no_sync()` until the last one (or, in a traced run,
one all-reduce at the end); then clipping, the GradScaler and the step's LR factor. Metrics are the task's
sums, kept as device tensors: no host sync per step (`.item()` only at logging intervals).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from ddp_tricks.data.loaders import seed_epoch
from ddp_tricks.distributed.collectives import all_reduce_sum, any_rank, broadcast_buffers
from ddp_tricks.plan import Step
from ddp_tricks.training import precise_bn
from ddp_tricks.training.seam import report
from ddp_tricks.training.state import Training, restore_rng


def to_device(t: Training, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = inputs.to(t.device, non_blocking=True)
    if t.channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets.to(t.device, non_blocking=True)


def forward(t: Training, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
    """The model under autocast, then the task's loss on float outputs: (outputs, batch-mean loss)."""
    with t.precision.autocast():
        outputs = model(inputs)
    outputs = outputs.float() if outputs.is_floating_point() else outputs
    return outputs, t.task.loss(outputs, targets)


def batch_sums(t: Training, outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """[loss x samples, *the task's metric sums], float64 on the device."""
    sums = t.task.metric_sums(outputs.detach(), targets) if t.sum_names else {}
    # one stack (it promotes the dtypes) and one cast: the fewest operations per micro-batch
    return torch.stack([loss.detach() * len(targets), *(sums[k] for k in t.sum_names)]).double()


def progress_bar(enabled: bool, total: int, description: str):
    """A tqdm bar on stderr (rank 0, unless --no-progress), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)


def start_epoch(t: Training, epoch: int, loader, steps: list[Step], seed: int) -> int:
    """Point the loader at the epoch's steps and seed the epoch; returns the step to start from (a resumed
    epoch continues where its checkpoint stopped, with the RNG that checkpoint saved)."""
    first_step = t.step_in_epoch if epoch == t.completed_epochs + 1 else 0
    loader.batch_sampler.start(steps, first_step)
    seed_epoch(loader, epoch, seed, t.rank)
    if first_step and t.resume_rng is not None:
        restore_rng(t.resume_rng)
    t.resume_rng = None
    t.epoch = epoch
    return first_step


def train_one_epoch(
    t: Training,
    steps: list[Step],
    loader,
    first_step: int = 0,
    progress=None,
    log_interval: int = 20,
    after_step: Callable[[Training], bool] | None = None,
) -> dict[str, float] | None:
    """Train the epoch's `steps` from `first_step` on; return the epoch's metrics reduced across ranks.

    The loader yields this rank's micro-batches of those steps in order. A resumed epoch continues from
    `t.resume_sums` (this rank's running [loss, *metric sums, samples] when its checkpoint was written).
    `after_step(t)` runs after every optimizer step (`t.step_in_epoch` steps done, `t.epoch_sums` the running
    sums); when it returns True the epoch stops there and None is returned.
    """
    t.model.train()
    width = len(t.sum_names) + 1
    resumed = t.resume_sums if first_step else None
    start_sums = torch.zeros(width + 1, dtype=torch.float64) if resumed is None else resumed.cpu()
    t.resume_sums = None
    running = start_sums[:width].to(t.device, copy=True)
    t.epoch_sums = running  # a non-finite loss makes it non-finite: "stop" checks it, at no cost per step
    t.epoch_samples = int(start_sums[width])

    skip_nonfinite = not t.precision.skips_nonfinite and t.on_nonfinite == "skip"
    step_nonfinite = torch.zeros((), dtype=torch.bool, device=t.device)
    params = [p for p in t.raw_model.parameters() if p.requires_grad]
    skipped_before, start = t.skipped_steps, time.perf_counter()
    batches = iter(loader)
    if progress is not None:
        progress.update(first_step)
    for done, step in enumerate(steps[first_step:], start=first_step + 1):
        for k in range(len(step.micro_batches)):
            inputs, targets = to_device(t, *next(batches))
            sync = k == len(step.micro_batches) - 1 or not hasattr(t.model, "no_sync")  # DDP: reduce on the last
            with contextlib.nullcontext() if sync else t.model.no_sync():
                outputs, loss = forward(t, t.model, inputs, targets)
                t.precision.backward(loss * (len(targets) / step.divisor), t.optimizer)
            if t.reduction is not None:
                t.reduction.after_backward(len(targets), step.batch)
            with torch.no_grad():
                row = batch_sums(t, outputs, targets, loss)
                if skip_nonfinite:  # keep the skipped batch out of the epoch's sums
                    nonfinite = ~torch.isfinite(row[0])
                    step_nonfinite |= nonfinite
                    row = torch.where(nonfinite, torch.zeros_like(row), row)
                running += row
            t.epoch_samples += len(targets)
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
        t.step_in_epoch = done
        if done % log_interval == 0:
            t.raise_if_nonfinite()
        if after_step is not None and after_step(t):
            return None
        if progress is not None and done % log_interval == 0:
            progress.set_postfix(
                loss=f"{running[0].item() / max(t.epoch_samples, 1):.4f}",
                lr=f"{t.lr:.4g}",
                samples_per_s=f"{t.epoch_samples / (time.perf_counter() - start):.0f}",
            )
            progress.update(done - progress.n)
    if progress is not None:
        progress.update(len(steps) - progress.n)
    t.raise_if_nonfinite()
    seconds = time.perf_counter() - start
    trained_now = t.epoch_samples - float(start_sums[width])
    counts = torch.tensor([t.epoch_samples, trained_now], dtype=torch.float64, device=t.device)
    *total, count_all, samples_now = all_reduce_sum(torch.cat([running, counts])).tolist()
    return report(t.task, t.sum_names, "train", total, count_all) | {
        "global_batch": count_all / max(len(steps), 1),
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
    inputs = (to_device(t, x, y)[0] for x, y in loader)
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
        inputs, targets = to_device(t, inputs, targets)
        outputs, loss = forward(t, model, inputs, targets)
        sums[:-1] += batch_sums(t, outputs, targets, loss)
        sums[-1] += len(targets)
    *total, samples = all_reduce_sum(sums).tolist()
    return report(t.task, t.sum_names, "val", total, samples)
