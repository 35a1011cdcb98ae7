"""Mixed precision as one object: autocast for the forward pass, and the backward pass and optimizer step with
fp16's GradScaler (unscale before clipping, a skipped step reported; sharded: one that agrees across the ranks),
bf16 (no scaler), or NVIDIA Apex's amp.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """`autocast()` around the forward, `backward(loss)`, then `step(optimizer, ...)` once per optimizer step."""

    def __init__(self, mode: str, device: torch.device, apex_amp=None, sharded: bool = False):
        self.device = device
        self.apex_amp = apex_amp  # apex.amp, already initialised on the model and optimizer (before DDP)
        self.dtype = None if apex_amp is not None else DTYPES[mode]
        self.scaler = None
        if mode == "fp16" and apex_amp is None:
            self.scaler = torch.amp.GradScaler(device.type)
            if sharded:  # each rank sees an inf only in its slices: this scaler agrees on it across the ranks
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
        if self.scaler is not None and clip_grad_norm > 0:
            self.scaler.unscale_(optimizer)
        if clip_grad_norm > 0:
            nn.utils.clip_grad_norm_(params, clip_grad_norm)
        if lr_factor != 1.0:
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * lr_factor
        took_step = True
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()  # GradScaler.step syncs anyway to decide on skipping
            self.scaler.step(optimizer)
            self.scaler.update()
            took_step = self.scaler.get_scale() >= scale_before
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
