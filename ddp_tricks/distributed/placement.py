"""The model's build stage, in torchtitan's order: activation checkpointing on the blocks (activations.py), the
model on its device, then, under --strategy fsdp, sharded (fsdp.py). DDP's wrapping and compile come after, in
run.py, once the optimizer holds the parameters it steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks import activations
from ddp_tricks.distributed import fsdp, mesh


def build(
    model: nn.Module,
    units: tuple,
    device: torch.device,
    dtype: torch.dtype | None,
    strategy: str = "ddp",
    channels_last: bool = False,
    checkpointing: str | None = None,
    replicas: int = 1,
) -> nn.Module:
    """The model checkpointed (`checkpointing`: an activations mode, or None), on `device` (channels-last where
    asked), and sharded over the FSDP `units` with parameters gathered in `dtype` under --strategy fsdp, on a mesh of
    `replicas` x world/replicas ranks (mesh.py)."""
    if checkpointing:
        activations.apply(model, list(units), checkpointing)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if strategy == "fsdp":  # before the optimizer: it steps the sharded parameters
        world_size = torch.distributed.get_world_size()
        model = fsdp.shard(model, list(units), dtype, mesh.build(torch.device(device).type, world_size, replicas))
    return model
