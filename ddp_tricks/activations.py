"""`--activation-checkpointing`: the blocks' activations recomputed in the backward instead of held from the forward
(torchtitan's `activation_checkpoint.mode`), under DDP and FSDP alike, applied before compile and sharding. The
blocks are the FSDP units (the task's `shard_units(model)`, else each child with parameters, fsdp.py), one block per
module of a unit. Modes:

- `full`: every block's forward runs again in the backward; the block keeps only its inputs;
- `ops` (op-level selective): every block, but the outputs of its matrix products and attention are kept (the
  costly ops), the cheap element-wise ones recomputed (`torch.utils.checkpoint.create_selective_checkpoint_contexts`);
- `K` (an integer): every K-th block in full, the first of them the first block (1 = full).

A block's `forward` is replaced on the instance by one that calls the class's forward under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the module stays where it was, so parameter names,
state dicts and lookups by name are unchanged (`checkpoint_wrapper` would put `_checkpoint_wrapped_module` into
every name). Without gradients (evaluation, cached accumulation's first pass) the forward runs plainly. A block
whose forward updates state of its own in training is not checkpointed: its recomputed forward would update it twice
(running statistics of BatchNorm or InstanceNorm; spectral norm's power iteration, whose second update also changes
the gradients).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

MODES = ("full", "ops")  # or an integer K as text: every K-th block (cli/large_models.py checks the flag)
_SPECTRAL = getattr(torch.nn.utils.parametrizations, "_SpectralNorm", ())  # spectral norm's parametrization (private)


def _blocks(units: list) -> list[nn.Module]:
    """Each module of each unit once, in the units' order."""
    seen, blocks = set(), []
    for unit in units:
        for module in unit if isinstance(unit, (list, tuple)) else [unit]:
            if id(module) not in seen:
                seen.add(id(module))
                blocks.append(module)
    return blocks


def _keeps_statistics(module: nn.Module) -> bool:
    """Whether a forward of `module` in training updates state of its own: norms' running statistics, spectral
    norm's vectors (its parametrization's, or the older hook's)."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm

    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:  # BatchNorm, InstanceNorm
            return True
        if parametrize.is_parametrized(m) and any(
            isinstance(f, _SPECTRAL) for p in m.parametrizations.values() for f in p
        ):
            return True  # its power iteration; orthogonal's and a mask's buffers are constants
        if any(isinstance(hook, SpectralNorm) for hook in m._forward_pre_hooks.values()):
            return True
    return False


def choose(units: list, mode: str) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the blocks `mode` checkpoints, the blocks left alone because their forward updates state)."""
    blocks = _blocks(units)
    refused = [b for b in blocks if _keeps_statistics(b)]
    every = 1 if mode in MODES else int(mode)
    allowed = [b for b in blocks if not _keeps_statistics(b)]
    return [b for i, b in enumerate(allowed) if i % every == 0], refused


def apply(model: nn.Module, units: list, mode: str) -> list[nn.Module]:
    """Checkpoint the blocks `mode` chooses among the units' modules (in place); the blocks checkpointed."""
    chosen, _ = choose(units, mode)
    forward = _selective_forward if mode == "ops" else _full_forward
    for block in chosen:
        block.forward = types.MethodType(forward, block)  # bound to the block: a deep copy binds to its copy
    return chosen


def _full_forward(self: nn.Module, *args, **kwargs):
    if not torch.is_grad_enabled():
        return type(self).forward(self, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def _selective_forward(self: nn.Module, *args, **kwargs):
    if not torch.is_grad_enabled():
        return type(self).forward(self, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        type(self).forward, self, *args, use_reentrant=False, context_fn=_keep_products, **_hooks_see(), **kwargs
    )


@functools.cache
def _hooks_see() -> dict:
    """Where torch can (2.13+), the products `ops` keeps go through saved_tensors_hooks like any saved tensor (an
    offload to the host, the bench's count of held bytes); before, they bypass them."""
    import inspect

    known = "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    return {"respect_saved_tensors_hooks": True} if known else {}


@functools.cache
def _kept_ops() -> frozenset:
    """The ops whose outputs `ops` mode keeps: matrix products and fused attention (those present in this torch)."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_products():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def _nth(k: int) -> str:
    """K as an ordinal: 'single' for 1 (every single block), else '2nd', '3rd', '4th', '11th', '22nd'."""
    if k == 1:
        return "single"
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def describe(model: nn.Module, units: list, mode: str) -> str:
    """The start line's note: what is checkpointed, by name."""
    chosen, refused = choose(units, mode)
    names = {id(m): name for name, m in model.named_modules()}
    shown = ", ".join(repr(names[id(b)]) for b in chosen[:3]) + (f" ... ({len(chosen)} in all)" if chosen[3:] else "")
    if mode == "full":
        how = "each recomputed whole in the backward"
    elif mode == "ops":
        how = "recomputed in the backward except their matrix products and attention (op-level selective)"
    else:
        how = f"every {_nth(int(mode))} block, recomputed whole in the backward"
    line = f"activation checkpointing ({mode}): {len(chosen)} block(s), {shown or 'none'}: {how}"
    if refused:
        why = "a recomputed forward would update their running statistics or spectral norm's vectors twice"
        line += f"; not {', '.join(repr(names[id(b)]) for b in refused)} ({why})"
    return line
