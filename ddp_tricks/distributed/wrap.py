"""The model wrapped for data parallelism (SyncBatchNorm on request, then DistributedDataParallel; sharding is
fsdp.py's), the one way the loop keeps a backward's gradients local while it accumulates micro-batches, and DDP's
error for parameters a step did not use, said in one line."""

from __future__ import annotations

import contextlib
import inspect
import re

import torch

from ddp_tricks.distributed.collectives import broadcast_buffers
from ddp_tricks.errors import UserError


def wrap(model: torch.nn.Module, dist_info, sync_bn: bool = False, apart=(), **ddp_options) -> torch.nn.Module:
    """SyncBatchNorm (on request) and DistributedDataParallel, in a distributed run; the model as is otherwise.

    `apart`: the names of parameters DDP leaves alone (the sparse tables, which sparse.SparseGradients averages):
    rank 0's values are given to every rank here, as DDP does for the others when it is built. A model with nothing
    else to train is not wrapped (DDP refuses a module without a parameter of its own): its state is rank 0's
    (its buffers given once, not before every forward as DDP would). A group of one process (torchrun
    --nproc_per_node=1) is not wrapped either: DDP over one rank would add its reducer's copies and a one-rank
    all-reduce to every step (15 % of a step of the built-in model on a CPU: bench/e2e.py --processes 1) and change
    nothing else; SyncBatchNorm over one rank is BatchNorm. Lightning and Accelerate leave one process unwrapped too."""
    if dist_info.world_size == 1:  # one process, with or without a group
        return model
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if apart:
        named = dict(model.named_parameters())
        tables = [named[name] for name in apart]
        ignored = ddp_names(model, {id(p) for p in tables})
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        for table in tables:
            torch.distributed.broadcast(table.detach(), 0)
        if all(getattr(p, "_ddp_ignored", False) for p in model.parameters() if p.requires_grad):
            broadcast_buffers(model)
            return model
    device_ids = [dist_info.device] if dist_info.device.type == "cuda" else None
    buffers = buffer_sync(not only_norm_statistics(model))
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, **buffers, **ddp_options
    )


def ddp_names(model: torch.nn.Module, ids: set[int]) -> list[str]:
    """Every name by which DDP may look up the parameters whose id() is in `ids`: named_parameters()'s, and module by
    module the "{module}.{parameter}" its reducer checks (".weight" for the root module's own; a parameter shared
    by two modules under each)."""
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    for module_name, module in model.named_modules():
        names += [f"{module_name}.{n}" for n, p in module.named_parameters(recurse=False) if id(p) in ids]
    return list(dict.fromkeys(names))


def buffer_sync(on: bool) -> dict[str, bool]:
    """DDP's option for broadcasting rank 0's buffers before every forward, by its name in this torch: 2.14 renamed
    it `forward_sync_buffers` (and warns on the old name); older ones have only `broadcast_buffers`."""
    renamed = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    return {"forward_sync_buffers" if renamed else "broadcast_buffers": on}


def only_norm_statistics(model: torch.nn.Module) -> bool:
    """Whether every buffer of the model is a norm layer's running statistic (BatchNorm's, an InstanceNorm's that
    tracks them). Then DDP need not broadcast rank 0's buffers at each forward, as it does by default (a blocking
    collective in every step: 12 % of a 2-process step of the built-in model on CPU): a training forward does not
    read them, evaluation gives every rank rank 0's first (loop.evaluate), and checkpoints hold rank 0's, which are
    the same either way (the broadcast never changes rank 0's). Any other buffer (a queue, a mask a forward updates)
    keeps DDP's default."""
    norms = {id(b) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) for b in m.buffers()}
    return all(id(b) in norms for b in model.buffers())


def accumulating(model: torch.nn.Module):
    """A context in which a backward pass does not reduce gradients across ranks (the step's last micro-batch
    does): DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync(False)` (no reduce-scatter before the last
    micro-batch); a model with no reducer of its own needs nothing."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def name_unused_parameters(error: RuntimeError, model: torch.nn.Module) -> None:
    """DDP's "Expected to have finished reduction in the prior iteration" (a step in which some parameters got no
    gradient on this rank, without find_unused_parameters) raised as one line naming them and the fix; DDP gives
    only their indices in its reducer. Any other error: returns, for the caller to raise it as it is."""
    ddp = getattr(model, "_orig_mod", model)  # under --compile
    text = str(error)
    if "Expected to have finished reduction in the prior iteration" not in text or not hasattr(ddp, "module"):
        return
    found = re.search(r"did not receive grad for rank (\d+): ([\d ,]+)", text)
    names = reducer_names(ddp.module)
    unused = [names[int(i)] for i in re.findall(r"\d+", found.group(2)) if int(i) < len(names)] if found else []
    raise _unused(unused) from None


def check_every_gradient(model: torch.nn.Module) -> None:
    """After a step's backward, before any collective of the template's own (a step's row, the non-finite check):
    under DDP without --find-unused-parameters, a parameter that got no gradient on this rank (its gradients were set
    to None at the last step) is the one line `name_unused_parameters` gives, raised here, on this rank alone. Else
    DDP's reducer on the other ranks still waits in their backward for this rank's bucket, this rank's collective is
    paired with that all-reduce, and the job hangs; DDP itself says so only at the next forward. A host read of
    attributes, no sync: called at logging steps only."""
    ddp = getattr(model, "_orig_mod", model)
    if not hasattr(ddp, "module") or ddp.find_unused_parameters or ddp.static_graph:
        return
    unused = [
        name
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and p.grad is None and not getattr(p, "_ddp_ignored", False)
    ]
    if unused:
        raise _unused(unused)


def _unused(unused: list[str]) -> UserError:
    shown = ", ".join(repr(n) for n in unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
    return UserError(
        f"parameters {shown or 'of the model'} got no gradient in a training step, and DDP without "
        "--find-unused-parameters waits for every parameter's gradient: pass --find-unused-parameters (a branch "
        "that some batches skip), or freeze the parameters that never train (requires_grad=False)",
        rank_specific=True,
    )


def reducer_names(module: torch.nn.Module) -> list[str]:
    """The names of the parameters DDP's reducer holds, in its order (what its error messages index): module by
    module, each module's own parameters that require a gradient, a shared one at its first place; not those it
    was told to leave alone (wrap's `apart`)."""
    names, seen = [], set()
    for module_name, child in module.named_modules():
        for name, param in child.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen and not getattr(param, "_ddp_ignored", False):
                seen.add(id(param))
                names.append(f"{module_name}.{name}" if module_name else name)
    return names
