"""LARS, layer-wise adaptive rate scaling (You, Gitman & Ginsburg, 2017, https://arxiv.org/abs/1708.03888):
`LARS` (standalone, Algorithm 1), `LARSWrapper` (over any optimizer) and `create_optimizer_lars`.

Sharded parameters (FSDP2's DTensors, each rank holding a slice of every tensor) work as whole ones: the trust
ratio needs the norm of each WHOLE tensor, so every step sums the squared norms of the local slices of all its
tensors in ONE all-reduce (ddp_tricks/shards.py: `whole_norms`), and updates the slices in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ddp_tricks.no_decay import excluded
from ddp_tricks.schedules.curves import PolynomialWarmup  # the original LARS project imported it from here
from ddp_tricks.shards import like, local, shard_group, trust_ratios
from ddp_tricks.wrapped_optimizer import WrappedOptimizer

__all__ = ["LARS", "LARSWrapper", "create_optimizer_lars", "PolynomialWarmup", "trust_ratio"]


def _check(name: str, value: float, low: float = 0.0, strict: bool = False) -> None:
    if not (value > low if strict else value >= low):
        raise ValueError(f"Invalid {name}: {value} (must be {'>' if strict else '>='} {low})")


def trust_ratio(
    weight_norm: torch.Tensor, grad_norm: torch.Tensor, weight_decay: float, trust_coefficient: float, eps: float
) -> torch.Tensor:
    """`tc * ||w|| / (||g|| + wd * ||w|| + eps)` where both norms are > 0, else 1; no host sync."""
    ratio = trust_coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)
    return torch.where((weight_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))


class LARS(Optimizer):
    r"""LARS with momentum, as paper Algorithm 1 and the official TensorFlow/MLPerf code.

    For each parameter :math:`w` with gradient :math:`g` in a group whose ``lars`` entry is True (default)::

        r = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)   if ||w|| > 0 and ||g|| > 0, else 1
        d = g + weight_decay * w
        v = momentum * v + lr * r * d          (v starts at 0)
        w = w - v                              (nesterov: w = w - (momentum * v + lr * r * d))

    In a group with ``lars=False`` the same lines run with r = 1 and that group's own weight_decay.

    Args:
        params: parameters or parameter groups (a group may set ``lars``, ``lr``, ``weight_decay``, ...).
        lr: learning rate (the global LR the trust ratio multiplies).
        momentum: momentum factor (default 0.9).
        weight_decay: L2 weight decay, inside the trust ratio and the update (default 0).
        trust_coefficient: the paper's eta (default 0.001).
        eps: added to the trust ratio's denominator (default 1e-8).
        nesterov: Nesterov momentum (default False).
        foreach: multi-tensor kernels; None picks them on CUDA and the per-tensor loop on CPU, where it is
            faster (see bench/optim_step.py).
        shard_group: the process group over which sharded (FSDP2) parameters' norms are summed, as the template
            gives it (its mesh's shard dimension); None finds it from the parameters' own mesh.

    ``p.grad`` is never modified; the update makes no host sync (the zero-norm guard is a ``torch.where``).
    """

    shard_group = None  # the class default: torch pickles an optimizer without it, and the unpickled one finds it

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        *,
        foreach: bool | None = None,
        shard_group=None,
    ):
        _check("learning rate", lr)
        _check("momentum value", momentum)
        _check("weight_decay value", weight_decay)
        _check("trust_coefficient value", trust_coefficient, strict=True)
        _check("eps value", eps)
        if nesterov and momentum <= 0:
            raise ValueError("Invalid nesterov: Nesterov momentum requires a momentum > 0")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            lars=True,
            foreach=foreach,
        )
        super().__init__(params, defaults)
        self.shard_group = shard_group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LARS does not support sparse gradients; use dense gradients")
            work.append((group, params, shard_group(params, self.shard_group)))
        coefficients = lambda g: (g["weight_decay"], g["trust_coefficient"], g["eps"])  # noqa: E731
        ratios = trust_ratios(work, _weights_and_grads, coefficients, trust_ratio)
        for (group, params, _), group_ratios in zip(work, ratios):
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            local_bufs = [local(b) if b is not None else None for b in bufs]
            p_local, g_local = [local(p) for p in params], [local(p.grad) for p in params]
            foreach = group["foreach"] if group["foreach"] is not None else p_local[0].is_cuda
            update = _lars_foreach if foreach else _lars_single_tensor
            update(p_local, g_local, local_bufs, group, group_ratios)
            if group["momentum"] > 0:
                for p, buf, new in zip(params, bufs, local_bufs):
                    self.state[p]["momentum_buffer"] = buf if buf is not None else like(p, new)
        return loss


def _weights_and_grads(item: tuple) -> list[list[torch.Tensor]]:
    params = item[1]
    return [[local(p) for p in params], [local(p.grad) for p in params]]


def _lars_single_tensor(params, grads, bufs, group, ratios) -> None:
    momentum, wd = group["momentum"], group["weight_decay"]
    scales = _step_scales(ratios, group, params[0], len(params))
    for i, (p, g, scale) in enumerate(zip(params, grads, scales)):
        d = torch.add(g, p, alpha=wd) if wd != 0 else g  # g + wd * w, scaled by lr * r where it is used
        if momentum == 0:
            p.sub_(d * scale)
            continue
        buf = bufs[i]
        if buf is None:
            bufs[i] = buf = d * scale
        else:
            buf.mul_(momentum).addcmul_(d, scale)  # one pass: v = momentum * v + lr * r * d
        if group["nesterov"]:
            p.sub_(d * scale).sub_(buf, alpha=momentum)
        else:
            p.sub_(buf)


def _lars_foreach(params, grads, bufs, group, ratios) -> None:
    momentum, wd = group["momentum"], group["weight_decay"]
    grouped = Optimizer._group_tensors_by_device_and_dtype([params, grads, bufs], with_indices=True)
    for (_device, _dtype), ((dev_params, dev_grads, dev_bufs), indices) in grouped.items():
        # Once every buffer exists, v = momentum * v + d is one pass as lerp(v, d / (1 - momentum), 1 - momentum),
        # with 1 / (1 - momentum) folded into the per-tensor scales: two fewer passes over memory per step.
        as_lerp = 0 < momentum and not group["nesterov"] and all(buf is not None for buf in dev_bufs)
        mine = None
        if ratios is not None:
            mine = ratios if len(indices) == len(params) else ratios[torch.tensor(indices, device=ratios.device)]
        scales = _step_scales(mine, group, dev_params[0], len(dev_params), 1 / (1 - momentum) if as_lerp else 1.0)
        d = torch._foreach_add(dev_grads, dev_params, alpha=wd) if wd != 0 else torch._foreach_mul(dev_grads, 1.0)
        torch._foreach_mul_(d, scales)
        if as_lerp:
            torch._foreach_lerp_(dev_bufs, d, 1 - momentum)
            torch._foreach_sub_(dev_params, dev_bufs)
            continue
        if momentum == 0:
            torch._foreach_sub_(dev_params, d)
            continue
        old = [j for j, buf in enumerate(dev_bufs) if buf is not None]
        for j, buf in enumerate(dev_bufs):
            if buf is None:
                dev_bufs[j] = bufs[indices[j]] = d[j].clone()
        if old:
            old_bufs = [dev_bufs[j] for j in old]
            torch._foreach_mul_(old_bufs, momentum)
            torch._foreach_add_(old_bufs, [d[j] for j in old])
        if group["nesterov"]:
            torch._foreach_add_(d, dev_bufs, alpha=momentum)
            torch._foreach_sub_(dev_params, d)
        else:
            torch._foreach_sub_(dev_params, dev_bufs)


def _step_scales(ratios, group, like: torch.Tensor, count: int, factor: float = 1.0) -> list[torch.Tensor]:
    """factor * lr * r for each of `count` parameters, as 0-d tensors of their dtype (r = 1 where lars is off)."""
    lr = group["lr"] * factor
    if ratios is None:
        return [torch.full((), lr, dtype=like.dtype, device=like.device)] * count
    return (ratios * lr).to(like.dtype).unbind(0)


class LARSWrapper(WrappedOptimizer):
    r"""LARS over any optimizer (SGD, Adam, AdamW, ...): the base optimizer sees a trust-scaled gradient.

    Each ``step()`` hands the base optimizer, for every parameter in a group whose ``lars`` entry is True
    (the default), the gradient ``r * (g + wd * w)`` with ``r`` as in :class:`LARS` and ``wd`` the group's
    weight decay; the base step runs with its own weight decay switched off, then ``p.grad`` and the group's
    ``weight_decay`` are put back as the caller left them. Groups with ``lars=False`` pass through unchanged.
    With an SGD base this is torchlars' formula.

    Wrapping Adam is not LAMB: Adam divides its update by the running root-mean-square of the gradient, so
    a per-layer factor on its input mostly cancels out (exactly, once the moments settle at a constant r).
    For the layer-wise adaptive form of Adam use :class:`lamb.LAMB`, which scales Adam's *output*.

    Args:
        optimizer: the base optimizer; its ``param_groups`` and ``state`` are shared, not copied.
        trust_coefficient: the paper's eta (default 0.001).
        eps: added to the trust ratio's denominator (default 1e-8).
        shard_group: as :class:`LARS`'s.
    """

    shard_group = None

    def __init__(self, optimizer: Optimizer, trust_coefficient: float = 0.001, eps: float = 1e-8, *, shard_group=None):
        _check("trust_coefficient value", trust_coefficient, strict=True)
        _check("eps value", eps)
        super().__init__(optimizer)
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.shard_group = shard_group

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"shard_group": None}  # a process group is this process's own

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        saved_decays: list[tuple[dict, float]] = []
        try:
            work = []
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not group.get("lars", True) or not params:
                    continue
                if any(p.grad.is_sparse for p in params):
                    raise RuntimeError("LARSWrapper does not support sparse gradients; use dense gradients")
                work.append((group, params, shard_group(params, self.shard_group)))
            coefficients = lambda g: (g.get("weight_decay", 0.0), self.trust_coefficient, self.eps)  # noqa: E731
            ratios = trust_ratios(work, _weights_and_grads, coefficients, trust_ratio)
            for (group, params, _), group_ratios in zip(work, ratios):
                wd = group.get("weight_decay", 0.0)
                p_local, g_local = [local(p) for p in params], [local(p.grad) for p in params]
                scaled = torch._foreach_add(g_local, p_local, alpha=wd) if wd != 0 else torch._foreach_mul(g_local, 1.0)
                torch._foreach_mul_(scaled, group_ratios.to(p_local[0].dtype).unbind(0))
                for p, new_grad in zip(params, scaled):
                    saved_grads.append((p, p.grad))
                    p.grad = like(p.grad, new_grad)
                if "weight_decay" in group:
                    saved_decays.append((group, wd))
                    group["weight_decay"] = 0.0
            self.optimizer.step()
        finally:
            for p, grad in saved_grads:
                p.grad = grad
            for group, wd in saved_decays:
                group["weight_decay"] = wd
        return loss


def create_optimizer_lars(
    model: nn.Module,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    bn_bias_separately: bool = True,
    epsilon: float = 1e-8,
    trust_coefficient: float = 0.001,
    nesterov: bool = False,
) -> LARS:
    """The original LARS project's factory.

    With ``bn_bias_separately``, every parameter the exclusion rule names (one dimension or fewer: biases of any
    name, every norm's weight, scalars; every parameter of a normalisation layer; the model's ``no_weight_decay()``
    names) goes into a group with ``lars=False`` and ``weight_decay=0``; the rest into a LARS group with
    ``weight_decay``.
    """
    return lars_over(
        parameter_groups(model, weight_decay, bn_bias_separately),
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        trust_coefficient=trust_coefficient,
        eps=epsilon,
        nesterov=nesterov,
    )


def lars_over(
    target: Iterable | Optimizer,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
    shard_group=None,
) -> Optimizer:
    """One set of LARS settings made an optimizer: `LARS` over `target`'s parameters or groups, or, where `target` is
    an optimizer, `LARSWrapper` around it (the trust ratio's settings only: the base keeps its own LR, momentum and
    weight decay; `shard_group`: the process group a sharded model's norms are summed over, None: found from the
    parameters). The one place they are handed on: `create_optimizer_lars` and the run's optimizer
    (ddp_tricks/optim/build.py, `--optimizer lars` and `--lars-wrap` alike) build through it."""
    if isinstance(target, Optimizer):
        return LARSWrapper(target, trust_coefficient=trust_coefficient, eps=eps, shard_group=shard_group)
    return LARS(target, lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                eps=eps, nesterov=nesterov, shard_group=shard_group)  # fmt: skip


def parameter_groups(model: nn.Module, weight_decay: float, bn_bias_separately: bool) -> list[dict[str, Any]]:
    """One group, or (bn_bias_separately) the rest vs. what the exclusion rule keeps out (`norms_and_biases`); each
    parameter once."""
    if not bn_bias_separately:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    apart = norms_and_biases(model)
    seen: set[int] = set()
    scaled, plain = [], []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (plain if id(p) in apart else scaled).append(p)
    groups = [{"params": scaled, "weight_decay": weight_decay, "lars": True}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0, "lars": False})
    return [g for g in groups if g["params"]]


def norms_and_biases(model: nn.Module) -> set[int]:
    """The ids of the parameters `bn_bias_separately` keeps out of LARS scaling and weight decay: the exclusion rule
    (ddp_tricks/optim/groups.py, `excluded`): every parameter of one dimension or fewer (biases of any name, every
    norm's weight, scalars), every parameter of a normalisation layer, and the names the model lists in
    `no_weight_decay()` (timm's convention)."""
    return excluded(model)
