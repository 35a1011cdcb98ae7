"""An optimizer that wraps another and shares its `param_groups` and `state`, so LR schedulers, GradScaler,
`state_dict()` and pickling treat the wrapper exactly as they treat the optimizer inside it.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


class WrappedOptimizer(Optimizer):
    """Base of LARSWrapper and Lookahead: a real `torch.optim.Optimizer` over another one.

    `param_groups` and `state` are the inner optimizer's own objects (not copies): a scheduler that changes
    the wrapper's LR changes the inner optimizer's, and `GradScaler.unscale_` sees the same gradients.
    """

    def __init__(self, optimizer: Optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer to wrap, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        # Optimizer.__init__ sets up hooks and step profiling; it re-adds the inner groups in place (the same
        # dicts), and then we point groups and state back at the inner optimizer's objects.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._link()

    def _link(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "optimizer") or self.param_groups is not self.optimizer.param_groups:
            super().add_param_group(param_group)  # only while Optimizer.__init__ runs
        else:
            self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._link()  # the inner optimizer replaced its groups and state with new objects

    def __getstate__(self) -> dict[str, Any]:
        # An LR scheduler patches `step` onto the instance; like torch's own optimizers, leave it out.
        return {key: value for key, value in self.__dict__.items() if key not in ("step", "_opt_called")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
