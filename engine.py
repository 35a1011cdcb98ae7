"""One training epoch and one exact evaluation: autocast, GradScaler, gradient accumulation under
`no_sync()`, and metrics kept as tensors (no host sync per step; `.item()` only at logging intervals).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from distributed import all_reduce_sum, broadcast_buffers
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
    global_step: int = 0  # optimizer steps taken or skipped, over the whole run
    skipped_steps: int = 0  # fp16 steps skipped by the GradScaler (inf/NaN gradients), over the whole run
    criterion: nn.Module = field(init=False)

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


def train_one_epoch(t: Training, loader, progress=None, log_interval: int = 20) -> dict[str, float]:
    """Train over the loader once; return the epoch's loss and accuracy reduced across ranks."""
    t.model.train()
    plan = group_weights(micro_batch_sizes(len(loader.sampler), loader.batch_size), t.accum_steps)
    sums = torch.zeros(3, dtype=torch.float64, device=t.device)  # loss, correct, samples
    skipped_before = t.skipped_steps
    start = time.perf_counter()
    steps = 0
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
            sums[0] += loss_sum.detach()
            sums[1] += (outputs.argmax(1) == targets).sum()
            sums[2] += targets.numel()
        if ends_group:
            optimizer_step(t)
            steps += 1
            if progress is not None and steps % log_interval == 0:
                progress.set_postfix(
                    loss=f"{(sums[0] / sums[2]).item():.4f}",
                    lr=f"{t.optimizer.param_groups[0]['lr']:.4g}",
                    samples_per_s=f"{sums[2].item() / (time.perf_counter() - start):.0f}",
                )
                progress.update(log_interval)
    if progress is not None:
        progress.update(steps - progress.n)
    all_reduce_sum(sums)
    loss, correct, count = sums.tolist()
    seconds = time.perf_counter() - start
    return {
        "train_loss": loss / count,
        "train_acc": correct / count,
        "samples_per_second": count / seconds,
        "epoch_seconds": seconds,
        "skipped_steps": t.skipped_steps - skipped_before,
    }


def optimizer_step(t: Training) -> None:
    """One optimizer step and one schedule step; an fp16 step the scaler skips does not advance the schedule."""
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
