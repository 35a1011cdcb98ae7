"""Mixed precision as one object: autocast for the forward pass, and the backward pass and optimizer step with
fp16's GradScaler (unscale before clipping, a skipped step reported; sharded: one that agrees across the ranks),
bf16 (no scaler), or NVIDIA Apex's amp. An fp16 step waits on the device once: GradScaler's own check for infs.
"""

from __future__ import annotations

import contextlib

import torch

from ddp_tricks import shards
from ddp_tricks.distributed.mesh import Mesh

DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """`autocast()` around the forward, `backward(loss)`, then `step(optimizer, ...)` once per optimizer step."""

    def __init__(self, mode: str, device: torch.device, apex_amp=None, mesh: Mesh | None = None):
        self.device = device
        self.apex_amp = apex_amp  # apex.amp, already initialised on the model and optimizer (before DDP)
        self.dtype = None if apex_amp is not None else DTYPES[mode]
        self.scaler = None
        self._steps = StepCounter()
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's gradient norm, before clipping
        self.shard_group = mesh.shard_group() if mesh is not None else None  # sharded: the clipping's norm sums here
        if mode == "fp16" and apex_amp is None:
            self.scaler = torch.amp.GradScaler(device.type)
            if mesh is not None:  # each rank sees an inf only in its slices: this scaler agrees on it across the ranks
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)

    @property
    def skips_nonfinite(self) -> bool:
        """fp16's scaler skips a step whose gradients overflowed, by itself."""
        return self.scaler is not None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def loss_scale(self) -> torch.Tensor | float:
        """What the loss was multiplied by before its backward: fp16's scale (a device tensor: no sync), or 1. The
        same on every rank, also on one that ran no micro-batch yet (uneven shares, a traced step)."""
        if self.scaler is None:
            return 1.0
        self._scale_ready()
        return self.scaler._scale.double()

    def _scale_ready(self) -> None:
        """GradScaler makes its scale when it first scales a loss: on a rank with no micro-batch in a step (uneven
        shares, a traced step) it would not exist at the step, which then fails ("_scale is None"), and the noise
        scale would divide by 1. Scaling a zero makes it (from the initial or the resumed scale), as the ranks that
        ran a micro-batch made theirs; it then follows the same overflows, read from the reduced gradients."""
        if self.scaler._scale is None:
            self.scaler.scale(torch.zeros((), device=self.device))

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self.apex_amp is not None:
            with self.apex_amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, params, clip_grad_norm: float = 0.0, lr_factor=1.0) -> bool:
        """Clip (on true gradients), then one update at the groups' LR x `lr_factor`, after which the groups get
        their LR back (the schedule keeps seeing its own). Returns False when the scaler skipped the step."""
        if self.scaler is not None:
            self._scale_ready()
        if self.scaler is not None and clip_grad_norm > 0:
            self.scaler.unscale_(optimizer)
        if clip_grad_norm > 0:
            self.grad_norm = shards.clip_grad_norm_(
                params, clip_grad_norm, self.shard_group
            )  # on the device: read by a row
        if lr_factor != 1.0:
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * lr_factor
        took_step = True
        if self.scaler is not None:
            # GradScaler reads its inf flag (one sync) to decide whether to call optimizer.step(); the counter
            # learns that decision from the step itself, so the scale is never read back (each read a sync)
            if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: steps always, skips in its kernel
                scale_before = self.scaler.get_scale()
                self.scaler.step(optimizer)
                self.scaler.update()
                took_step = self.scaler.get_scale() >= scale_before  # two more syncs, for such optimizers only
            else:
                steps_before = self._steps.count_on(optimizer)
                self.scaler.step(optimizer)
                self.scaler.update()
                took_step = self._steps.count > steps_before
        else:
            optimizer.step()
        if lr_factor != 1.0:
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        return took_step

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class StepCounter:
    """Counts an optimizer's steps with a post-hook (run by every torch.optim.Optimizer's step(), wrappers included),
    registered once per optimizer: whether a step ran is then known without asking the device."""

    def __init__(self):
        self.count = 0
        self._hooked: torch.optim.Optimizer | None = None
        self._handle = None

    def count_on(self, optimizer: torch.optim.Optimizer) -> int:
        """Count `optimizer`'s steps from now on (hooked on the first call for it); returns the count so far."""
        if optimizer is not self._hooked:
            if self._handle is not None:
                self._handle.remove()
            self._handle = optimizer.register_step_post_hook(self)
            self._hooked = optimizer
        return self.count

    def __call__(self, optimizer, args, kwargs) -> None:
        self.count += 1
