"""The model's build stage, in torchtitan's order: the task's model made (on the meta device under --strategy fsdp:
meta_init.py), activation checkpointing on the blocks (activations.py), the model on its device, then, under
--strategy fsdp, sharded (fsdp.py) and, when made on the meta device, materialised per shard. DDP's wrapping and
compile come after, in run.py, once the optimizer holds the parameters it steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks import activations
from ddp_tricks.distributed import fsdp, meta_init
from ddp_tricks.distributed.mesh import Mesh


def make(task, strategy: str, meta: bool, state: dict | None) -> tuple[nn.Module, meta_init.Recipe | None, list[str]]:
    """The task's model: under --strategy fsdp (`meta`: not --no-meta-init) made on the meta device with the recipe
    that materialises it, and the start line that says how it was made; else made on the CPU (None, no line). A
    checkpoint of whole weights (a sharded run's best.pt) is loaded into a whole model: made on the CPU, said."""
    if strategy != "fsdp" or not meta:
        return task.model(), None, []
    if state is not None and not any(isinstance(v, dict) for v in state["model"].values()):
        return task.model(), None, ["model built whole on the CPU: the checkpoint's whole weights are loaded into it"]
    model, recipe, line = meta_init.build(task.model)
    return model, recipe, [f"model {line}"]


def build(
    model: nn.Module,
    units: tuple,
    device: torch.device,
    dtype: torch.dtype | None,
    recipe: meta_init.Recipe | None = None,
    mesh: Mesh | None = None,
    strategy: str = "ddp",
    channels_last: bool = False,
    checkpointing: str | None = None,
) -> tuple[nn.Module, Mesh | None]:
    """The model checkpointed (`checkpointing`: an activations mode, or None), on `device` (channels-last where
    asked), and sharded over the FSDP `units` with parameters gathered in `dtype` under --strategy fsdp, on `mesh`
    (the checked one, mesh.py, built here once; None: a 1-D mesh over every rank). `recipe`: the model is on the
    meta device, sharded there, then materialised per shard on `device` (meta_init.py). The model, and the built
    mesh it is sharded on (None: not sharded), which the optimizers' norms, the clipping and the EMA take."""
    if checkpointing:
        activations.apply(model, list(units), checkpointing)
    layout = torch.channels_last if channels_last else torch.preserve_format
    model = model.to("meta" if recipe else device, memory_format=layout)
    built = None
    if strategy == "fsdp":  # before the optimizer: it steps the sharded parameters
        mesh = mesh if mesh is not None else Mesh(torch.distributed.get_world_size())
        built = mesh.build(torch.device(device).type)
        model = fsdp.shard(model, list(units), dtype, built)
    if recipe is not None:
        meta_init.materialise(model, recipe, torch.device(device))
    return model, built
