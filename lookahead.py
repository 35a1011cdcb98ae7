"""Lookahead over any optimizer (Zhang, Lucas, Hinton & Ba, 2019, https://arxiv.org/abs/1907.08610)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ddp_tricks.shards import local
from ddp_tricks.wrapped_optimizer import WrappedOptimizer


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
        capturable: count steps on the parameters' device and decide "is this step k, 2k, ...?" there, so
            a CUDA graph of ``step()`` replays the schedule exactly (the inner optimizer must be capturable
            too). It costs two passes over the weights on every step instead of every k-th step, so leave
            it off (default False) unless you capture the step.
    """

    capturable = False  # class defaults: a Lookahead pickled before these existed still steps
    _device_step: torch.Tensor | None = None

    def __init__(self, optimizer: Optimizer, k: int = 5, alpha: float = 0.5, *, capturable: bool = False):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"Invalid k: {k} (must be an integer >= 1)")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"Invalid alpha: {alpha} (must be in (0, 1])")
        super().__init__(optimizer)
        self.k = k
        self.alpha = alpha
        self.lookahead_step = 0
        self.slow = [p.detach().clone() for p in self._params()]
        self.capturable = capturable
        if capturable:
            devices = {p.device for p in self._params()}
            if len(devices) != 1:
                raise ValueError(
                    f"capturable Lookahead needs its parameters on one device, got {sorted(map(str, devices))}"
                )
            self._device_step = torch.zeros((), dtype=torch.int64, device=devices.pop())

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = self.optimizer.step(closure)
        self.lookahead_step += 1
        if self.capturable:
            self._sync_on_device()
        elif self.lookahead_step % self.k == 0:
            fast, slow = [local(p) for p in self._params()], [local(s) for s in self.slow]  # sharded: the slices
            torch._foreach_lerp_(slow, fast, self.alpha)
            torch._foreach_copy_(fast, slow)
        return loss

    def _sync_on_device(self) -> None:
        """The branch above with the decision taken on the device: a lerp weight of 0 leaves a tensor as it
        is and a weight of 1 gives exactly the other one, so off-steps change nothing and sync steps do
        what the branch does."""
        self._device_step.add_(1)
        due = torch.remainder(self._device_step, self.k) == 0
        fast, slow = [local(p) for p in self._params()], [local(s) for s in self.slow]
        alpha, sync = {}, {}
        for p in fast:
            if p.dtype not in sync:  # lerp wants its weight in the tensor's dtype
                sync[p.dtype] = due.to(p.dtype)
                alpha[p.dtype] = sync[p.dtype] * self.alpha
        torch._foreach_lerp_(slow, fast, [alpha[p.dtype] for p in fast])
        torch._foreach_lerp_(fast, slow, [sync[p.dtype] for p in fast])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "slow"):
            self.slow.extend(p.detach().clone() for p in self._params()[len(self.slow) :])

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        state["lookahead"] = {
            "slow": [s.clone() for s in self.slow],
            "step": self._steps_taken(),
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
                local(slow).copy_(local(value))
        self.lookahead_step = int(saved["step"])
        if self._device_step is not None:
            self._device_step.fill_(self.lookahead_step)

    def _steps_taken(self) -> int:
        """Steps so far; a captured step that was replayed counts only on the device."""
        return int(self._device_step.item()) if self._device_step is not None else self.lookahead_step
