"""LAMB, the layer-wise adaptive form of Adam (You et al., 2019, https://arxiv.org/abs/1904.00962, Alg. 2);
the original LARS project's `--base-op lamb`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer

from lars import trust_ratio


class LAMB(Optimizer):
    r"""LAMB: Adam's update, rescaled per parameter tensor by ||w|| / ||u||.

    For each parameter w with gradient g, at step t (from 1)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g^2
        m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)     (without bias_correction: m, v)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = ||w|| / ||u||   if ||w|| > 0 and ||u|| > 0, else 1     (r = 1 in a group with lars=False)
        w = w - lr * r * u

    Args:
        params: parameters or parameter groups (a group may set ``lars=False``).
        lr: learning rate (default 1e-3).
        betas: coefficients of the running averages of g and g^2 (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-6).
        weight_decay: decoupled weight decay inside u (default 0.01).
        bias_correction: divide the moments by (1 - beta^t) (default True).

    ``p.grad`` is never modified and the step makes no host sync.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
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
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, lars=True
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients; use dense gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
                bc2 = 1 - beta2**t if group["bias_correction"] else 1.0
                u = (v / bc2).sqrt_().add_(group["eps"])
                u = torch.div(m, u).div_(bc1)
                if group["weight_decay"] != 0:
                    u.add_(p, alpha=group["weight_decay"])
                if group["lars"]:
                    r = trust_ratio(p.norm(), u.norm(), 0.0, 1.0, 0.0).to(p.dtype)
                    p.addcmul_(u, r, value=-group["lr"])
                else:
                    p.add_(u, alpha=-group["lr"])
        return loss
