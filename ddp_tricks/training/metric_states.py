"""A task's metric states as the loop keeps and reduces them, and the reported metrics from a whole set's: sums of any
fixed shape (a count, a per-class count, a confusion matrix) laid out in one flat vector (one all-reduce), and, in
evaluation, rows gathered over the whole validation set (the states of score() that the task's `gathered` names:
scores for an AUC, detections for an mAP), concatenated across ranks once at its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddp_tricks.errors import UserError


@dataclass(frozen=True)
class Layout:
    """Which states a task's metric_sums() or score() gives: the summed ones in order, with their shapes (() for a
    scalar), and the gathered ones (rows, concatenated over the whole set)."""

    sums: tuple[tuple[str, tuple[int, ...]], ...] = ()
    gathered: tuple[str, ...] = ()

    @classmethod
    def of_states(cls, states: dict, gathered=()) -> Layout:
        return cls(tuple((k, tuple(v.shape)) for k, v in states.items() if k not in gathered), tuple(gathered))

    @classmethod
    def scalars(cls, names, shapes: dict | None = None) -> Layout:
        """Summed states `names`, scalars unless `shapes` gives a state's shape."""
        return cls(tuple((name, tuple((shapes or {}).get(name, ()))) for name in names))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.sums]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of the summed states that are not scalars."""
        return {name: shape for name, shape in self.sums if shape != ()}

    @property
    def width(self) -> int:
        """The summed states' elements: the flat vector's length."""
        return sum(math.prod(shape) for _, shape in self.sums)

    def flat(self, states: dict) -> list[torch.Tensor]:
        """The summed states, each flattened, in order (for one torch.cat)."""
        return [states[name].reshape(-1) for name, _ in self.sums]

    def unflat(self, values: list[float]) -> dict:
        """A whole set's summed states from their flat values: a scalar as a float, a shaped sum as a float64
        tensor (on the CPU) of its shape."""
        states, at = {}, 0
        for name, shape in self.sums:
            size = math.prod(shape)
            part = values[at : at + size]
            states[name] = part[0] if shape == () else torch.tensor(part, dtype=torch.float64).reshape(shape)
            at += size
        return states


def report(
    task,
    layout: Layout,
    prefix: str,
    values: list[float],
    count: float,
    gathered: dict | None = None,
    loss: bool = True,
) -> dict[str, float]:
    """`{prefix}_loss` (unless `loss` is False: a task that scores its evaluation itself) and `{prefix}_<metric>`
    from a set's states: `values` = [loss x units, *the summed states, flat], `gathered` = the whole set's rows;
    `count` = the set's units (samples unless the task counts others). The task's metrics() turns them into the
    reported values (default: each sum / count); a task that scores its evaluation and sums nothing in training
    reports only its training loss."""
    count = max(count, 1.0)  # an epoch with no step left (resumed at its very end) has no units
    states = layout.unflat(values[1:] if loss else values) | (gathered or {})
    if hasattr(task, "metrics") and (states or not hasattr(task, "score")):
        metrics = task.metrics(states, count)
    else:
        metrics = {k: v / count for k, v in states.items()}
    shown = {f"{prefix}_loss": values[0] / count} if loss else {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            where = "metrics()" if hasattr(task, "metrics") else "a state without metrics() (its sum / count)"
            raise UserError(
                f"the task reports {name!r} as a tensor of shape {tuple(value.shape)} from {where}: a reported metric "
                "is one number; compute it from the states in metrics(sums, count) (e.g. the mean of a per-class "
                "tensor)"
            )
        shown[f"{prefix}_{name}"] = float(value)
    return shown
