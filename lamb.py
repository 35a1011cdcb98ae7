"""LAMB, the layer-wise adaptive form of Adam (You et al., 2019, https://arxiv.org/abs/1904.00962, Alg. 2);
the original LARS project's `--base-op lamb`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer

from ddp_tricks.shards import local, shard_group, trust_ratios
from lars import trust_ratio


class LAMB(Optimizer):
    r"""LAMB: Adam's update, rescaled per parameter tensor by ||w|| / ||u||.

    For each parameter w with gradient g, at step t (from 1)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g^2
        m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)     (without bias_correction: m, v)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = ||w|| / ||u||   if ||w|| > 0 and ||u|| > 0, else 1     (r = 1 in a group with lars=False)
        r = min(r, 1)                                           (trust_clip)
        w = w - lr * r * u

    Args:
        params: parameters or parameter groups (a group may set ``lars=False``).
        lr: learning rate (default 1e-3).
        betas: coefficients of the running averages of g and g^2 (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-6).
        weight_decay: decoupled weight decay inside u (default 0.01).
        bias_correction: divide the moments by (1 - beta^t) (default True).
        trust_clip: the trust ratio at most 1 (timm's ``Lamb(trust_clip=True)``; default False).
        always_adapt: the trust ratio also in a group whose weight_decay is 0 (default True, the paper's; timm's
            ``Lamb`` defaults to False, which leaves such a group unscaled). A group with ``lars=False`` is never
            scaled.
        capturable: keep the step count t on the parameters' device, so a CUDA graph of ``step()`` replays
            with the right t (default False: t is a Python int, and the bias corrections cost no kernels).
        shard_group: the process group over which sharded (FSDP2) parameters' norms are summed, as the template
            gives it (its mesh's shard dimension); None finds it from the parameters' own mesh.

    The update is multi-tensor (``torch._foreach_*``, grouped by device and dtype); ``p.grad`` is never
    modified and the step makes no host sync.
    """

    shard_group = None  # the class default: torch pickles an optimizer without it, and the unpickled one finds it

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        *,
        trust_clip: bool = False,
        always_adapt: bool = True,
        capturable: bool = False,
        shard_group=None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (must be in [0, 1))")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]} (must be in [0, 1))")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
            lars=True,
            capturable=capturable,
        )
        super().__init__(params, defaults)
        self.shard_group = shard_group

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("capturable", False)
            group.setdefault("trust_clip", False)  # a state saved before these existed steps as it did
            group.setdefault("always_adapt", True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = []  # (group, and for each run of one device and dtype: its parameters, their local slices, their u)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients; use dense gradients")
                state = self.state[p]
                if "exp_avg" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = _step_in_mode(state["step"], group["capturable"], p.device)
                if not group["capturable"]:
                    state["step"] += 1
                params.append(p)
                grads.append(local(p.grad))
                exp_avgs.append(local(state["exp_avg"]))
                exp_avg_sqs.append(local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if params:
                updates += [(group, *sub) for sub in _adam_updates(params, grads, exp_avgs, exp_avg_sqs, steps, group)]
        work = [(group, params, shard_group(params, self.shard_group), sub, u) for group, params, sub, u in updates]
        ratios = trust_ratios(work, lambda item: [item[3], item[4]], _coefficients, _ratio, on=_adapts)
        for (group, _, _, sub, u), sub_ratios in zip(work, ratios):
            if sub_ratios is None:
                torch._foreach_add_(sub, u, alpha=-group["lr"])
                continue
            torch._foreach_mul_(u, (sub_ratios * group["lr"]).to(sub[0].dtype).unbind(0))
            torch._foreach_sub_(sub, u)
        return loss


def _adapts(group: dict) -> bool:
    """Whether a group takes the trust ratio: lars on, and (always_adapt) or a weight decay (timm's rule)."""
    return group.get("lars", True) and (group.get("always_adapt", True) or group["weight_decay"] != 0)


def _coefficients(group: dict) -> tuple:
    return 0.0, 1.0, 0.0, group.get("trust_clip", False)


def _ratio(weight_norm, update_norm, weight_decay, coefficient, eps, clip: bool) -> torch.Tensor:
    ratio = trust_ratio(weight_norm, update_norm, weight_decay, coefficient, eps)
    return ratio.clamp(max=1.0) if clip else ratio


def _step_in_mode(step, capturable: bool, device: torch.device):
    """The step count as the mode wants it: a 0-d float32 tensor on the device (capturable) or an int.

    A state saved in the other mode is converted once, on its first step here.
    """
    if capturable and not isinstance(step, torch.Tensor):
        return torch.full((), float(step), dtype=torch.float32, device=device)  # a fill: no host-to-device copy
    if not capturable and isinstance(step, torch.Tensor):
        return int(step.item())
    return step


def _adam_updates(params, grads, exp_avgs, exp_avg_sqs, steps, group) -> list[tuple[list, list, list]]:
    """Adam's moments updated in place, and for each run of parameters of one device and dtype, (the parameters,
    their local slices, u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w), before the trust ratio."""
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    slices = [local(p) for p in params]
    grouped = Optimizer._group_tensors_by_device_and_dtype([slices, grads, exp_avgs, exp_avg_sqs], with_indices=True)
    updates = []
    for (_device, _dtype), ((dev_params, dev_grads, dev_m, dev_v), indices) in grouped.items():
        dev_steps = [steps[i] for i in indices]
        if group["capturable"]:
            torch._foreach_add_(dev_steps, 1.0)
        torch._foreach_lerp_(dev_m, dev_grads, 1 - beta1)
        torch._foreach_mul_(dev_v, beta2)
        torch._foreach_addcmul_(dev_v, dev_grads, dev_grads, value=1 - beta2)
        denom = torch._foreach_sqrt(dev_v)
        if group["bias_correction"]:
            bc1 = _bias_corrections(beta1, dev_steps)
            bc2 = _bias_corrections(beta2, dev_steps)
            if group["capturable"]:
                torch._foreach_sqrt_(bc2)
            else:
                bc2 = [math.sqrt(c) for c in bc2]
            torch._foreach_div_(denom, bc2)  # sqrt(v_hat) = sqrt(v) / sqrt(1 - beta2^t)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(dev_m, denom)
        if group["bias_correction"]:
            torch._foreach_div_(u, bc1)  # m_hat / (sqrt(v_hat) + eps)
        if wd != 0:
            torch._foreach_add_(u, dev_params, alpha=wd)
        updates.append(([params[i] for i in indices], dev_params, u))
    return updates


def _bias_corrections(beta: float, steps: list) -> list:
    """1 - beta^t for each step count, as -expm1(t * ln(beta)): exact to float32 rounding where 1 - beta^t
    computed in float32 would lose digits (beta2 = 0.999 at t = 1 leaves 1e-3 with a 1e-5 relative error).
    Host floats for int steps; 0-d tensors (no host sync) for tensor steps."""
    if not steps or not isinstance(steps[0], torch.Tensor):
        return [-math.expm1(t * math.log(beta)) if beta > 0 else 1.0 for t in steps]
    if beta == 0:
        return [torch.ones_like(t) for t in steps]
    corrections = torch._foreach_mul(steps, math.log(beta))
    torch._foreach_expm1_(corrections)
    torch._foreach_neg_(corrections)
    return corrections
