"""Cached accumulation (GradCache, Gao et al. 2021): a step whose loss is over ALL its micro-batches at once (and,
through gather_with_grad, over every rank's), at the memory of one micro-batch. The other way to run a step, beside
loop.py's plain accumulation; a run chooses one when it is built (`choose`), never inside a step.

A step: (1) every micro-batch's outputs without a graph, each micro-batch's random state set and kept; (2) the task's
loss on their concatenation and its gradient with respect to those outputs (no model in that graph); (3) each
micro-batch again, its random state set again (the same dropout: cuDNN's RNN dropout too, `_reseed`), with a graph,
back-propagating its slice of that gradient; gradients reduced across ranks on the last backward only (DDP's no_sync,
FSDP's gradient sync off, before), as in plain accumulation.
Cost: a second forward of every micro-batch. Requires: a forward that changes no state but BatchNorm's running
statistics (those are put back after (1), so only (3) updates them, once per micro-batch as plain accumulation
does), and outputs whose tensors stack along their first dimension (samples).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ddp_tricks.distributed.wrap import accumulating
from ddp_tricks.errors import UserError
from ddp_tricks.plan import Step
from ddp_tricks.training.batches import describe, float_outputs, map_tensors, tensors_in
from ddp_tricks.training.loop import micro_batches
from ddp_tricks.training.state import Training


def choose(task, accum_steps: int, traced: bool, apex: bool) -> Callable | None:
    """The task's `cached_accumulation = True` with --accum-steps > 1: cached_accumulation; otherwise None (the
    plain accumulation: with one micro-batch per step the two are the same, without the second forward). What
    caching cannot do is one line, before any process group."""
    if not getattr(task, "cached_accumulation", False):
        return None
    why = "the task asks for cached accumulation (cached_accumulation = True)"
    if traced:
        raise UserError(
            f"{why}, which needs every rank to run the same micro-batches in a step; a --batch-trace run deals them "
            "unevenly: drop --batch-trace (or set cached_accumulation = False)"
        )
    if apex:
        raise UserError(f"{why}, which --amp-backend apex cannot scale: use --amp fp16 or --amp bf16")
    return cached_accumulation if accum_steps > 1 else None


def cached_accumulation(t: Training, step: Step, batches, units_of):
    """The step's gradient from one loss over all of this rank's micro-batches (see the module's docstring).
    Yields once: (the step's outputs, targets, loss, units, samples), for the epoch's sums."""
    fetched = list(micro_batches(t, step, batches, units_of))
    norms = [b for m in t.raw_model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]
    kept = [b.clone() for b in norms]
    states, outputs = [], []
    with torch.no_grad():
        for inputs, *_ in fetched:
            states.append(_reseed(t.device))
            with t.precision.autocast():
                outputs.append(float_outputs(t.model(inputs)))
        for buffer, value in zip(norms, kept):  # only the second forward updates BatchNorm's statistics
            buffer.copy_(value)

    reps = concat(outputs)
    leaves = [r.requires_grad_() for r in tensors_in(reps) if r.is_floating_point()]
    targets = concat([f[1] for f in fetched], [f[2] for f in fetched])
    samples, units = sum(f[2] for f in fetched), sum(f[3] for f in fetched)
    weight = samples / step.divisor if units_of is None else sum(f[4] for f in fetched)
    with torch.enable_grad():
        loss = t.task.loss(reps, targets)
        scaled = loss if type(weight) is float and weight == 1.0 else loss * weight
        if t.precision.scaler is not None:  # fp16: the gradients reach the parameters scaled, as a backward does
            scaled = t.precision.scaler.scale(scaled)
        grads = torch.autograd.grad(scaled, leaves, allow_unused=True)
    grads = [torch.zeros_like(r) if g is None else g for r, g in zip(leaves, grads)]

    starts = [0] * len(leaves)
    last = len(fetched) - 1
    for k, (inputs, *_) in enumerate(fetched):
        _set_rng_state(states[k], t.device)
        with contextlib.nullcontext() if k == last else accumulating(t.model):  # gradients reduced on the last
            with t.precision.autocast():
                again = float_outputs(t.model(inputs))
            mine, slices = [], []
            for i, out in enumerate(r for r in tensors_in(again) if r.is_floating_point()):
                if out.requires_grad:
                    mine.append(out)
                    slices.append(grads[i].narrow(0, starts[i], len(out)))
                starts[i] += len(out)
            torch.autograd.backward(mine, slices)
    yield map_tensors(torch.Tensor.detach, reps), targets, loss.detach(), units, samples


def concat(parts: list, samples: list[int] | None = None):
    """Structures of the same shape (a step's micro-batch outputs or targets) as one: each tensor concatenated
    along its first dimension, a list of one item per sample (its length the micro-batch's `samples`: a detector's
    dicts of boxes) joined into one list, leaves that are not tensors taken from the first."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return _cat(tuple(parts))
    if samples is not None and all(isinstance(p, list) and len(p) == n for p, n in zip(parts, samples)):
        return [item for part in parts for item in part]
    if isinstance(first, Mapping):
        if any(not isinstance(p, Mapping) or list(p) != list(first) for p in parts):
            _differ(parts)
        joined = {key: concat([p[key] for p in parts], samples) for key in first}
        try:
            return type(first)(joined)
        except TypeError:
            return joined
    if isinstance(first, (tuple, list)):
        if any(type(p) is not type(first) or len(p) != len(first) for p in parts):
            _differ(parts)
        columns = [concat(list(column), samples) for column in zip(*parts)]
        return type(first)(*columns) if hasattr(first, "_fields") else type(first)(columns)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(first, **{f: concat([getattr(p, f) for p in parts], samples) for f in fields})
    return first


def _differ(parts: list) -> None:
    shown = "; ".join(describe(p)[:120] for p in parts[:2])
    raise UserError(
        f"cached accumulation joins the step's micro-batch outputs and targets, and their structures differ ({shown}):"
        " give every micro-batch the same structure (a list of one item per sample is joined), or set "
        "cached_accumulation = False"
    )


def _cat(column: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if column[0].dim() == 0:
        raise UserError(
            "cached accumulation concatenates the model's outputs and the targets of a step's micro-batches along "
            "their first dimension (samples), and one of them is a scalar: give every output and target a batch "
            "dimension, or set cached_accumulation = False"
        )
    try:
        return torch.cat(column)
    except RuntimeError as error:
        shapes = ", ".join(str(tuple(c.shape)) for c in column)
        raise UserError(
            f"cached accumulation concatenates the step's micro-batch outputs and targets along their first dimension, "
            f"and these do not fit ({shapes}: {str(error).splitlines()[0][:80]}); pad them to one shape, or set "
            "cached_accumulation = False"
        ) from None


def _reseed(device: torch.device):
    """The random state a micro-batch's first forward runs with: read, and set again as the second forward sets it.
    Setting it is what counts for cuDNN's RNN dropout (nn.LSTM / nn.GRU with dropout, on CUDA), which keeps a dropout
    state of its own and draws it anew from torch's generator only after the generator's state is set (or seeded):
    with the state only read here, the first forward would drop other units than the second."""
    state = _rng_state(device)
    _set_rng_state(state, device)
    return state


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
