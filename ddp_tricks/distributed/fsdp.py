"""`--strategy fsdp`: the model sharded with PyTorch's FSDP2 (`fully_shard`), every rank holding a slice of each
parameter, its gradient and its optimizer state. The units that gather and free their parameters together are
the task's (`shard_units(model)`), or by default each direct child of the model that holds parameters; the root
takes the rest. Mixed precision is FSDP's policy: parameters gathered in the --amp dtype, gradients reduced in
float32, BatchNorm layers kept in float32 as their own units (their running statistics are float32).
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks.errors import UserError


def shard_units(task, model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: the task's `shard_units(model)`, else each direct child with parameters.
    A unit that is not a submodule of the model is a user error, found before any process group."""
    if hasattr(task, "shard_units"):
        units = list(task.shard_units(model))
        inside = {id(m) for m in model.modules()}
        for unit in units:
            if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is model:
                what = type(unit).__name__ if isinstance(unit, nn.Module) else repr(unit)[:40]
                raise UserError(
                    f"the task's shard_units() gave {what}, which is not a submodule of its model: return blocks "
                    "of the model it is given (e.g. list(model.blocks)), not new modules or the model itself"
                )
        return units
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard(model: nn.Module, units: list[nn.Module], dtype: torch.dtype | None = None) -> nn.Module:
    """`fully_shard` the units, the deepest first and each once, then the model, on a 1-D mesh over every rank.
    `dtype`: the --amp dtype parameters are gathered in (None: as they are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    done = set()
    if dtype is not None:
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and any(True for _ in module.parameters()):
                fully_shard(module, mesh=mesh, mp_policy=full)
                done.add(id(module))
    for unit in sorted(units, key=lambda m: sum(1 for _ in m.modules())):  # one inside another holds fewer: first
        if id(unit) not in done:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
            done.add(id(unit))
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)
