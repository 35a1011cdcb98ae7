"""`--strategy fsdp`: the model sharded with PyTorch's FSDP2 (`fully_shard`), every rank holding a slice of each
parameter, its gradient and its optimizer state. The units that gather and free their parameters together are
the task's (`shard_units(model)`), or by default each direct child of the model that holds parameters, a
ModuleList's or ModuleDict's element by element (a container has no forward for FSDP to hook: torchtitan shards
`model.layers` so), children that share a parameter (a tied embedding and output projection) as one unit (FSDP2
keeps a parameter in one unit); the root takes the rest. A unit whose forward some of the start-up check's forwards
skip (a mixture of experts' expert, a conditional branch), and its siblings in a ModuleList or ModuleDict, go back
into the unit that holds them: its all-gather would wait for the ranks that skip it. Parameters unused on a rank
get zero gradients in the reduce-scatter, so ranks that use different experts reduce the same tensors. Mixed
precision is FSDP's policy: parameters gathered in the --amp dtype, gradients reduced in float32, BatchNorm layers
kept in float32 as their own units (their running statistics are float32). A 0-d parameter (CLIP's learnable
temperature; fully_shard refuses to shard one) is kept whole on every rank, outside FSDP (`ignored_params`), and
`replicated_of(model).reduce()` averages its gradient over the ranks after the step's last backward, as DDP would.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ddp_tricks.distributed.mesh import Mesh
from ddp_tricks.errors import UserError

Unit = nn.Module | list[nn.Module]  # a list: modules gathered and freed together, as one unit


def shard_units(task, model: nn.Module) -> list[Unit]:
    """The units sharded one by one: the task's `shard_units(model)` (a unit may be a list of modules, sharded
    together), else each direct child with parameters, where children that share a parameter (a tied embedding
    and output projection) are one unit. Found before any process group, as one line: a unit that is not a
    submodule of the model, and units that split a shared parameter between them."""
    if not hasattr(task, "shard_units"):
        return default_units(model)
    units = [_as_unit(unit) for unit in task.shard_units(model)]
    inside = {id(m) for m in model.modules()}
    for unit in (m for u in units for m in (u if isinstance(u, list) else [u])):
        if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is model:
            what = type(unit).__name__ if isinstance(unit, nn.Module) else repr(unit)[:40]
            raise UserError(
                f"the task's shard_units() gave {what}, which is not a submodule of its model: return blocks "
                "of the model it is given (e.g. list(model.blocks)), not new modules or the model itself"
            )
    split = _split_parameter(model, units)
    if split is not None:
        param, holders = split
        sharing = [name for name, m in model.named_modules() if any(p is param for p in m.parameters(recurse=False))]
        together = ", ".join(_as_code(name) for name in sharing)
        names = " = ".join(_parameter_names(model, param))
        described = [_describe(model, units, i) for i in holders]
        between = ", ".join(described[:-1]) + f" and {described[-1]}"
        if len(sharing) == 1:  # one module under two units: sharded on its own first, it belongs to neither
            raise UserError(
                f"module {sharing[0]!r} sits under two of the task's shard_units() ({between}): FSDP keeps a "
                f"parameter in one unit; return {_as_code(sharing[0])} as a unit of its own too (it is then "
                "sharded before the units that hold it)"
            )
        raise UserError(
            f"modules {' and '.join(map(repr, sharing))} share a parameter ({names}), but the task's shard_units() "
            f"splits it between {between}: FSDP keeps a shared parameter in one unit; return those modules as one "
            f"unit, a list [{together}], or leave them all to the model's root (return none of them)"
        )
    return units


CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: fully_shard refuses them


def _as_unit(unit) -> Unit:
    """A unit as shard() takes it: a list or tuple of modules, or a ModuleList / ModuleDict (its elements, sharded
    together: a container has no forward for FSDP to hook), as a list; a module as it is."""
    if isinstance(unit, (list, tuple)):
        return [m for u in unit for m in _members(_as_unit(u))]
    if isinstance(unit, CONTAINERS):
        return [m for u in (unit.values() if isinstance(unit, nn.ModuleDict) else unit) for m in _members(_as_unit(u))]
    return unit


def _blocks(module: nn.Module) -> list[nn.Module]:
    """A child as default units: itself, or a ModuleList's / ModuleDict's elements (nested ones, element by
    element), those that hold parameters."""
    if isinstance(module, CONTAINERS):
        return [block for child in module.children() for block in _blocks(child)]
    return [module] if any(True for _ in module.parameters()) else []


def default_units(model: nn.Module) -> list[Unit]:
    """Each direct child of the model that holds parameters, a ModuleList's or ModuleDict's elements each as a unit
    (every transformer's `self.layers`); children that share a parameter become one unit (FSDP2 takes a list of
    modules since torch 2.5), and a child that shares one with the model's own parameters is left to the root."""
    units: list[list[nn.Module]] = [[block] for child in model.children() for block in _blocks(child)]
    while (split := _split_parameter(model, units)) is not None:
        _, holders = split
        if None in holders:  # shared with what the root holds: the root takes them too
            units = [u for i, u in enumerate(units) if i not in holders]
        else:
            merged = [m for i in holders for m in units[i]]
            units = [u for i, u in enumerate(units) if i not in holders] + [merged]
    return [unit[0] if len(unit) == 1 else unit for unit in units]


def skipped(model: nn.Module, units: list[Unit], calls: list[set[int]]) -> list[int]:
    """The indices of the units that some forward skipped: `calls` holds, for each of the start-up check's forwards,
    the ids of the modules it called; a unit is skipped where a forward did not call all its modules. Its siblings in
    a ModuleList or ModuleDict count as skipped too (the other experts of a mixture: a router that chose the same one
    for the check's few samples says nothing about the next batch)."""
    found = {i for i, unit in enumerate(units) if any(not {id(m) for m in _members(unit)} <= c for c in calls)}
    parent = {id(child): module for module in model.modules() for child in module.children()}

    def containers(i: int) -> set[int]:
        return {id(parent[id(m)]) for m in _members(units[i]) if isinstance(parent.get(id(m)), CONTAINERS)}

    shared = set().union(*(containers(i) for i in found)) if found else set()
    return sorted(found | {i for i in range(len(units)) if containers(i) & shared})


def describe_units(model: nn.Module, units: list[Unit], folded: list[Unit] = ()) -> str:
    """The units for the start line: `FSDP units (5): 'embed', 'layers.0'-'layers.3' ...; the root holds the rest`,
    consecutive elements of a ModuleList as a range; `folded`: the units left to the module that holds them."""
    names = [" + ".join(repr(_module_name(model, m)) for m in _members(unit)) for unit in units]
    shown = ", ".join(_ranges(names)) if names else "none"
    line = f"FSDP units ({len(units)}): {shown}; the root holds the rest"
    if folded:
        gone = ", ".join(_ranges([" + ".join(repr(_module_name(model, m)) for m in _members(u)) for u in folded]))
        line += (
            f"; {gone}: skipped by some of the start-up check's forwards (a mixture of experts' expert, a branch), "
            "so sharded with the unit that holds them (a unit whose forward a rank skips would leave the others "
            "waiting in its all-gather)"
        )
    return line


def _ranges(names: list[str]) -> list[str]:
    """'layers.0', 'layers.1', 'layers.2' -> 'layers.0'-'layers.2': consecutive numbered elements as one range."""
    shown, i = [], 0
    while i < len(names):
        j = i
        while j + 1 < len(names) and _next_of(names[j]) == names[j + 1]:
            j += 1
        shown.append(names[i] if j == i else f"{names[i]}-{names[j]}")
        i = j + 1
    return shown


def _next_of(name: str) -> str | None:
    head, _, last = name.strip("'").rpartition(".")
    return f"'{head}.{int(last) + 1}'" if head and last.isdigit() else None


def _members(unit: Unit) -> list[nn.Module]:
    return unit if isinstance(unit, list) else [unit]


def _in_order(units: list[Unit]) -> list[int]:
    """The units' indices in the order `shard` applies them: the smallest first (one inside another holds fewer
    modules), each unit once."""
    seen, order = set(), []
    for i in sorted(range(len(units)), key=lambda i: sum(sum(1 for _ in m.modules()) for m in _members(units[i]))):
        key = tuple(id(m) for m in _members(units[i]))
        if key not in seen:
            seen.add(key)
            order.append(i)
    return order


def _split_parameter(model: nn.Module, units: list[Unit]) -> tuple[nn.Parameter, list[int | None]] | None:
    """A parameter that FSDP2 would put in two units, as (parameter, the units' indices; None for the root), or
    None. Follows fully_shard's rule: a unit manages the parameters of its modules and of their submodules, except
    under a module sharded before it; the root, sharded last, manages the rest."""
    sharded: set[int] = set()
    holders: dict[int, list[int | None]] = {}
    params: dict[int, nn.Parameter] = {}
    for i in [*_in_order(units), None]:
        roots = _members(units[i]) if i is not None else [model]
        for module in _managed(roots, sharded):
            for param in module.parameters(recurse=False):
                params[id(param)] = param
                owners = holders.setdefault(id(param), [])
                if i not in owners:
                    owners.append(i)
        sharded |= {id(m) for m in roots}
    return next(((params[key], owners) for key, owners in holders.items() if len(owners) > 1), None)


def _managed(roots: list[nn.Module], sharded: set[int]) -> list[nn.Module]:
    """The modules a unit with these roots manages: every module under them, once, not entering a module that
    is a unit of its own already."""
    starts = {id(m) for m in roots}
    found, seen, stack = [], set(), list(reversed(roots))
    while stack:
        module = stack.pop()
        if id(module) in seen or (id(module) in sharded and id(module) not in starts):
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed(list(module.children())))
    return found


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _as_code(name: str) -> str:
    """A submodule's name as Python reaches it from the model: 'blocks.0.attn' -> model.blocks[0].attn."""
    return "model" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in name.split("."))


def _parameter_names(model: nn.Module, param: nn.Parameter) -> list[str]:
    return [repr(name) for name, p in model.named_parameters(remove_duplicate=False) if p is param]


def _describe(model: nn.Module, units: list[Unit], index) -> str:
    if index is None:
        return "the rest of the model (its root)"
    names = [repr(_module_name(model, m)) for m in _members(units[index])]
    return f"the unit {names[0]}" if len(names) == 1 else f"the unit [{', '.join(names)}]"


def scalar_parameters(model: nn.Module) -> list[str]:
    """The names of the model's 0-d parameters: fully_shard cannot shard them, so they are kept whole (`shard`)."""
    return [name for name, p in model.named_parameters() if p.dim() == 0]


def check_scalars(model: nn.Module, fp16: bool = False) -> None:
    """Before any process group: a 0-d parameter needs fully_shard's `ignored_params` (torch >= 2.7) to be kept
    whole; on an older torch, one line naming it and the fix. So does --amp fp16: ShardedGradScaler unscales every
    gradient as a DTensor, and a whole one beside them fails its inf check."""
    names = scalar_parameters(model)
    if not names:
        return
    if fp16:
        raise UserError(
            f"parameter {names[0]!r} is 0-d, kept whole beside FSDP's shards, and --amp fp16's ShardedGradScaler "
            "takes only sharded gradients: use --amp bf16, make it 1-d (nn.Parameter(torch.tensor([value]))), or "
            "train with --strategy ddp"
        )
    from torch.distributed.fsdp import fully_shard

    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise UserError(
            f"parameter {names[0]!r} is 0-d, and FSDP in torch {torch.__version__} cannot shard it nor keep it whole: "
            f"make it 1-d (nn.Parameter(torch.tensor([value]))), use torch >= 2.7, or train with --strategy ddp"
        )


class ReplicatedGradients:
    """The gradients of the parameters that FSDP leaves whole on every rank (the 0-d ones), averaged over the ranks by
    `reduce()`, which every rank calls once per optimizer step after the step's last backward: one all-reduce of
    their gradients together, a zero gradient where this rank's step did not use one (every rank takes part)."""

    def __init__(self, params: list[nn.Parameter], world_size: int):
        self.params = params
        self.world_size = world_size

    def reduce(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.world_size
        for p, g, mean in zip(self.params, grads, flat.split([g.numel() for g in grads])):
            p.grad = mean.reshape(g.shape).to(g.dtype)


REPLICATED = "_replicated_gradients"  # shard() puts the model's ReplicatedGradients under this attribute
MESH = "_sharding_mesh"  # and the Mesh it sharded the model on under this one


def mesh_of(model: nn.Module) -> Mesh | None:
    """The mesh `shard` sharded the model on (None: not sharded by `shard`)."""
    return getattr(getattr(model, "_orig_mod", model), MESH, None)


def replicated_of(model: nn.Module):
    """The 0-d parameters that `shard` kept whole (their `reduce()` averages their gradients over the ranks, after
    the step's last backward); None for a model without any, or not sharded. Asked once, when the run is built."""
    return getattr(getattr(model, "_orig_mod", model), REPLICATED, None)


def shard(model: nn.Module, units: list[Unit], dtype: torch.dtype | None = None, mesh: Mesh | None = None) -> nn.Module:
    """`fully_shard` the units, the smallest first and each once (a list of modules as one unit), then the
    model, on `mesh` (built; a 2-D one: HSDP, replicas x shards; None: a 1-D mesh over every rank), which the model
    keeps (`mesh_of`). `dtype`: the --amp dtype parameters are gathered in (None: as they are). The 0-d parameters
    stay whole on every rank (`ignored_params`: not sharded, not reduced by FSDP; see `replicated_of`), rank 0's
    values given to every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    if mesh is None:
        mesh = Mesh(torch.distributed.get_world_size()).build(device.type)
    grid = mesh.device_mesh
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    scalars = [p for p in model.parameters() if p.dim() == 0]
    for param in scalars:
        if not param.is_meta:  # on the meta device: materialised alike on every rank (meta_init.py)
            torch.distributed.broadcast(param.detach(), 0)
    ignored = {"ignored_params": set(scalars)} if scalars else {}
    done = set()
    if dtype is not None:
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and any(True for _ in module.parameters()):
                fully_shard(module, mesh=grid, mp_policy=full, **ignored)
                done.add(id(module))
    for i in _in_order(units):
        members = [m for m in _members(units[i]) if id(m) not in done]
        if members:
            fully_shard(members if len(members) > 1 else members[0], mesh=grid, mp_policy=policy, **ignored)
            done |= {id(m) for m in members}
    model = fully_shard(model, mesh=grid, mp_policy=policy, **ignored)
    setattr(model, MESH, mesh)
    trained = [p for p in model.parameters() if p.dim() == 0 and p.requires_grad]  # in the same order on every rank
    if trained:
        setattr(model, REPLICATED, ReplicatedGradients(trained, torch.distributed.get_world_size()))
    zero_unused_gradients(model)
    return model


def zero_unused_gradients(model: nn.Module, torch_switch: bool | None = None) -> None:
    """Every unit reduce-scatters every parameter that requires a gradient, a zero gradient where this rank's step
    did not use it (an expert no sample chose): FSDP2 otherwise reduce-scatters only the parameters that got one, and
    ranks that used different experts would pair different tensors (pytorch#158719). torch's own switch where it has
    it (`set_reduce_scatter_unused_params`); before, a forward hook on each unit ties every parameter to the unit's
    output with a zero weight while they are gathered, so each gets a zero gradient of its own (`torch_switch`:
    False takes the hook where torch has the switch, for the tests)."""
    from torch.distributed.fsdp import FSDPModule

    if torch_switch is None:
        torch_switch = hasattr(model, "set_reduce_scatter_unused_params")
    if torch_switch:
        model.set_reduce_scatter_unused_params(True)
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_hook(_tie_parameters, prepend=True)  # before FSDP's: the whole parameters


def _tie_parameters(module: nn.Module, args, output):
    """The unit's first floating output that requires a gradient, plus zero times one element of each of the unit's
    own parameters (the whole ones, gathered): backward then gives each parameter a gradient, zeros where unused."""
    from torch.distributed.fsdp import FSDPModule

    if not torch.is_grad_enabled():
        return output
    inside = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in inside]
    if not params:
        return output
    zero = torch.stack([p.reshape(-1)[0] for p in params if p.numel()]).sum() * 0
    return _add_to_first(output, zero)[0]


def _add_to_first(value, zero: torch.Tensor):
    """(value with `zero` added to its first floating tensor that requires a gradient, whether one was found),
    through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        found = value.is_floating_point() and value.requires_grad
        return (value + zero.to(value.dtype) if found else value), found
    items = (
        list(value.items())
        if isinstance(value, dict)
        else list(enumerate(value))
        if isinstance(value, (tuple, list))
        else []
    )
    for key, item in items:
        changed, found = _add_to_first(item, zero)
        if found:
            if isinstance(value, dict):
                return {**value, key: changed}, True
            parts = list(value)
            parts[key] = changed
            return (type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)), True
    return value, False


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def free_gathered(model: nn.Module) -> None:
    """Free the whole parameters a sharded model still holds gathered (FSDP2 keeps the root's after a forward
    without backward, such as an evaluation's), so that its next forward gathers the slices as they are now: after
    weights were written into them outside a step (model EMA's evaluation). No collective; nothing unsharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
