"""Whether a training step is running now: `in_training_step()`, for a task's loss() that keeps a statistic of the
step's batches (DINO's center) which its per-step hook applies. The start-up checks and the evaluation call the
same loss() outside any step. No torch import: a task imports it from the package at no cost.
"""

from __future__ import annotations

_running = 0  # training steps entered and not left (0 or 1)


def in_training_step() -> bool:
    """True inside a training step, around its micro-batches' forwards and losses (with cached accumulation, its
    forwards without a graph too), False in the start-up checks, in evaluation and in the per-step hook."""
    return _running > 0


class _Step:
    """A context manager without a generator (entered at every step: the cheapest kind)."""

    def __enter__(self) -> None:
        global _running
        _running += 1

    def __exit__(self, *error) -> None:
        global _running
        _running -= 1


_STEP = _Step()


def training_step() -> _Step:
    """The loop's: what runs inside is a training step's forwards and losses."""
    return _STEP
