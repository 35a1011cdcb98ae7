"""One training epoch and one exact evaluation: autocast, GradScaler, gradient accumulation under
`no_sync()`, and metrics kept as tensors (no host sync per step; `.item()` only at logging intervals).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from distributed import all_reduce_sum, any_rank, broadcast_buffers, gather_from_ranks
from schedulers import Schedule

AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Training:
    """Everything one optimizer step needs, and the counters that outlive an epoch."""

    model: nn.Module  # DDP-wrapped in a distributed run
    optimizer: Optimizer
    schedule: Schedule
    device: torch.device
    amp_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    accum_steps: int = 1
    clip_grad_norm: float = 0.0
    label_smoothing: float = 0.0
    channels_last: bool = False
    apex_amp: object | None = None  # NVIDIA Apex's amp module, when --amp-backend apex
    adascale: object | None = None  # batch_trace.AdaScale, with --batch-lr-rule adascale
    on_nonfinite: str = "stop"  # without a scaler: "stop" the run, or "skip" the step (one host sync per step)
    epoch: int = 0
    global_step: int = 0  # optimizer steps taken or skipped, over the whole run
    skipped_steps: int = 0  # steps skipped (fp16 overflow, or a non-finite loss with "skip"), over the whole run
    criterion: nn.Module = field(init=False)
    epoch_loss: torch.Tensor | None = field(init=False, default=None)  # this rank's running loss of the epoch
    lr_trace: list = field(init=False, default_factory=list)  # (global step, LR used): warmup steps, then every 10th

    def __post_init__(self) -> None:
        self.criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=self.label_smoothing)

    @property
    def raw_model(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self.apex_amp is not None:
            with self.apex_amp.scale_loss(loss, self.optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()

    def to_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.device, non_blocking=True)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets.to(self.device, non_blocking=True)


def micro_batch_sizes(num_samples: int, batch_size: int) -> list[int]:
    """The sizes of the loader's batches on one rank (the last one may be short)."""
    full, rest = divmod(num_samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def group_weights(sizes: list[int], accum_steps: int) -> list[tuple[int, bool]]:
    """For each micro-batch: the number of samples in its accumulation group, and whether it ends the group.

    Each micro-batch's summed loss is divided by its group's sample count, so every optimizer step uses
    the mean gradient over exactly the samples of its group, the epoch's short last group included.
    """
    plan = []
    for start in range(0, len(sizes), accum_steps):
        group = sizes[start : start + accum_steps]
        plan.extend((sum(group), i == len(group) - 1) for i in range(len(group)))
    return plan


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite; raised on every rank together."""

    def __init__(self, epoch: int, step: int, rank: int):
        super().__init__(f"non-finite loss or weights at epoch {epoch}, found at step {step}, on rank {rank}")
        self.epoch, self.step, self.rank = epoch, step, rank


def train_one_epoch(
    t: Training,
    loader,
    progress=None,
    log_interval: int = 20,
    start_step: int = 0,
    sums: torch.Tensor | None = None,
    after_step: Callable[[int, Callable[[], torch.Tensor]], bool] | None = None,
) -> dict[str, float] | None:
    """Train over the loader once; return the epoch's loss and accuracy reduced across ranks.

    To continue an epoch, the loader's sampler must already skip the samples of the first `start_step`
    steps, and `sums` holds this rank's running (loss, correct, samples) from then. `after_step(steps_done,
    current_sums)` runs after every optimizer step (`current_sums()` gives this rank's running sums); when it
    returns True the epoch stops there and None is returned.
    """
    t.model.train()
    plan = group_weights(micro_batch_sizes(len(loader.sampler), loader.batch_size), t.accum_steps)
    sums = torch.zeros(3, dtype=torch.float64) if sums is None else sums.cpu()
    # Running totals: two device scalars and a host count, the fewest operations per step.
    loss_total = sums[0].to(t.device, copy=True)
    correct_total = sums[1].to(t.device, copy=True)
    count = int(sums[2])
    t.epoch_loss = loss_total  # a non-finite loss makes it non-finite: "stop" checks it, at no cost per step

    def current_sums() -> torch.Tensor:
        return torch.stack([loss_total, correct_total, torch.tensor(float(count), device=t.device)])

    skip_nonfinite = t.scaler is None and t.on_nonfinite == "skip"
    group_nonfinite = torch.zeros((), dtype=torch.bool, device=t.device)
    skipped_before = t.skipped_steps
    start = time.perf_counter()
    steps = start_step
    if progress is not None:
        progress.update(start_step)
    for (inputs, targets), (group_samples, ends_group) in zip(loader, plan):
        inputs, targets = t.to_device(inputs, targets)
        sync = ends_group or not isinstance(t.model, DistributedDataParallel)
        with contextlib.nullcontext() if sync else t.model.no_sync():
            with t.autocast():
                outputs = t.model(inputs)
                loss_sum = t.criterion(outputs.float(), targets)
            loss = loss_sum / group_samples
            t.backward(loss)
        with torch.no_grad():
            loss_sum = loss_sum.detach()
            if skip_nonfinite:  # keep the skipped batch out of the epoch's loss
                nonfinite = ~torch.isfinite(loss_sum)
                group_nonfinite |= nonfinite
                loss_sum = torch.where(nonfinite, torch.zeros_like(loss_sum), loss_sum)
            loss_total += loss_sum
            correct_total += (outputs.argmax(1) == targets).sum()
            count += targets.shape[0]
        if ends_group:
            if skip_nonfinite and any_rank(group_nonfinite.item(), t.device):
                t.optimizer.zero_grad(set_to_none=True)  # the same decision on every rank: skip and count it
                t.global_step += 1
                t.skipped_steps += 1
                group_nonfinite.zero_()
            else:
                optimizer_step(t)
            steps += 1
            if steps % log_interval == 0:
                raise_if_nonfinite(t)
            if after_step is not None and after_step(steps, current_sums):
                return None
            if progress is not None and steps % log_interval == 0:
                progress.set_postfix(
                    loss=f"{loss_total.item() / count:.4f}",
                    lr=f"{t.optimizer.param_groups[0]['lr']:.4g}",
                    samples_per_s=f"{count / (time.perf_counter() - start):.0f}",
                )
                progress.update(log_interval)
    if progress is not None:
        progress.update(steps - progress.n)
    raise_if_nonfinite(t)
    return epoch_metrics(all_reduce_sum(current_sums()), time.perf_counter() - start, t.skipped_steps - skipped_before)


def epoch_metrics(sums: torch.Tensor, seconds: float, skipped_steps: int) -> dict[str, float]:
    """A training epoch's row from its (loss, correct, samples) sums, already reduced across ranks."""
    loss, correct, count = sums.tolist()
    count = max(count, 1.0)  # an epoch with no step left (resumed at its very end) has no samples
    return {
        "train_loss": loss / count,
        "train_acc": correct / count,
        "samples_per_second": count / seconds,
        "epoch_seconds": seconds,
        "skipped_steps": skipped_steps,
    }


def raise_if_nonfinite(t: Training, check_weights: bool = False) -> None:
    """Stop every rank together when any rank's epoch loss has become non-finite (one small collective).

    Called every `--log-interval` steps, at the end of the epoch, and (with `check_weights`) before every
    checkpoint, where non-finite weights or buffers count too: a finite loss can still take a step to
    infinite weights, and those must never replace the last good checkpoint.
    """
    if t.scaler is not None or (t.on_nonfinite != "stop" and not check_weights):
        return  # fp16: the GradScaler skips such steps itself
    bad = ~torch.isfinite(t.epoch_loss) if t.on_nonfinite == "stop" and t.epoch_loss is not None else None
    if check_weights:
        state = [v for v in t.raw_model.state_dict().values() if v.is_floating_point()]  # parameters and buffers
        weights_bad = ~torch.stack([v.isfinite().all() for v in state]).all()
        bad = weights_bad if bad is None else bad | weights_bad
    if bad is None:
        return
    flags = gather_from_ranks(bad.reshape(1).to(torch.float32)).flatten().tolist()
    if any(flags):
        raise NonFiniteLoss(t.epoch, t.global_step, flags.index(1.0))


def optimizer_step(t: Training) -> None:
    """One optimizer step and one schedule step; an fp16 step the scaler skips does not advance the schedule."""
    if t.schedule.warming_up or t.global_step % 10 == 0:
        t.lr_trace.append((t.global_step + 1, t.optimizer.param_groups[0]["lr"]))  # a host float: no sync
    took_step = True
    if t.scaler is not None:
        if t.clip_grad_norm > 0:
            t.scaler.unscale_(t.optimizer)
            nn.utils.clip_grad_norm_(t.raw_model.parameters(), t.clip_grad_norm)
        scale_before = t.scaler.get_scale()  # GradScaler.step syncs anyway to decide on skipping
        t.scaler.step(t.optimizer)
        t.scaler.update()
        took_step = t.scaler.get_scale() >= scale_before
    else:
        if t.clip_grad_norm > 0:
            nn.utils.clip_grad_norm_(t.raw_model.parameters(), t.clip_grad_norm)
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.global_step += 1
    if took_step:
        t.schedule.step()
    else:
        t.skipped_steps += 1


@torch.no_grad()
def evaluate(t: Training, loader) -> dict[str, float]:
    """Loss and accuracy over the validation set, each sample counted once across ranks (sums and counts).

    Uses the unwrapped model: ranks hold different numbers of validation batches, and a DDP forward
    would wait for the others.
    """
    model = t.raw_model
    broadcast_buffers(model)  # BatchNorm running stats drift apart per rank; evaluate rank 0's everywhere
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(3, dtype=torch.float64, device=t.device)
    for inputs, targets in loader:
        inputs, targets = t.to_device(inputs, targets)
        with t.autocast():
            outputs = model(inputs)
        sums[0] += criterion(outputs.float(), targets)
        sums[1] += (outputs.argmax(1) == targets).sum()
        sums[2] += targets.numel()
    all_reduce_sum(sums)
    loss, correct, count = sums.tolist()
    return {"val_loss": loss / count, "val_acc": correct / count}
