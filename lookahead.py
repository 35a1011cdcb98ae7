"""Lookahead over any optimizer (Zhang, Lucas, Hinton & Ba, 2019, https://arxiv.org/abs/1907.08610)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from optimizer_wrapper import WrappedOptimizer


class Lookahead(WrappedOptimizer):
    r"""Lookahead: the inner optimizer moves fast weights; every k steps slow weights follow them.

    Slow weights start as a copy of the parameters when Lookahead is created. After every k-th step of the
    inner optimizer (steps k, 2k, ...)::

        slow = slow + alpha * (fast - slow)
        fast = slow

    It is a real ``torch.optim.Optimizer`` sharing the inner optimizer's ``param_groups`` and ``state``, so
    LR schedulers, ``GradScaler.step`` (a skipped step does not count) and LARS/LARSWrapper/Adam inside all
    work. ``state_dict()`` is the inner optimizer's, plus a ``"lookahead"`` entry with the slow weights by
    parameter position and the step counter. Under DDP the fast weights are identical on every rank, so the
    slow weights stay identical too.

    Args:
        optimizer: the inner (fast) optimizer.
        k: steps between synchronisations (default 5).
        alpha: slow-weight step size, in (0, 1] (default 0.5).
    """

    def __init__(self, optimizer: Optimizer, k: int = 5, alpha: float = 0.5):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"Invalid k: {k} (must be an integer >= 1)")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"Invalid alpha: {alpha} (must be in (0, 1])")
        super().__init__(optimizer)
        self.k = k
        self.alpha = alpha
        self.lookahead_step = 0
        self.slow = [p.detach().clone() for p in self._params()]

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = self.optimizer.step(closure)
        self.lookahead_step += 1
        if self.lookahead_step % self.k == 0:
            fast = self._params()
            torch._foreach_lerp_(self.slow, fast, self.alpha)
            torch._foreach_copy_(fast, self.slow)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "slow"):
            self.slow.extend(p.detach().clone() for p in self._params()[len(self.slow) :])

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        state["lookahead"] = {
            "slow": [s.clone() for s in self.slow],
            "step": self.lookahead_step,
            "k": self.k,
            "alpha": self.alpha,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("lookahead", None)
        if saved is None:
            raise ValueError("state_dict has no 'lookahead' entry: it was not saved from a Lookahead optimizer")
        if len(saved["slow"]) != len(self.slow):
            raise ValueError(f"state_dict holds {len(saved['slow'])} slow weights, this optimizer has {len(self.slow)}")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for slow, value in zip(self.slow, saved["slow"]):
                slow.copy_(value)
        self.lookahead_step = int(saved["step"])
