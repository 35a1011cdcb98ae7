"""Seeds for python, numpy and torch (and DataLoader workers), deterministic algorithms, and EarlyStopping, with the
names the original template used: `same_seeds(seed)`, `EarlyStopping(patience, verbose, delta)`.
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch


def same_seeds(seed: int) -> None:
    """Seed python's `random`, numpy and torch (every CUDA device too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# torch's warnings for an op that has no deterministic kernel, and for a cuBLAS workspace that is not deterministic
NONDETERMINISTIC = (r".* does not have a deterministic implementation", r"Deterministic behavior was enabled")


DETERMINISTIC_NOTE = (
    "--deterministic: an op without a deterministic kernel warns once, by name, instead of stopping the run; a run "
    "that uses one is not bit-reproducible"
)


def use_deterministic_algorithms(show_warnings: bool = True) -> None:
    """torch.use_deterministic_algorithms(True), with what CUDA needs for it (a cuBLAS workspace, no autotuning).

    An op without a deterministic kernel (on CUDA: the backward of AdaptiveAvgPool2d, bilinear interpolation and
    reflection padding, cross-entropy over 4-D outputs, ...) warns instead of ending the run, once per op
    (`show_warnings=False`: never, for the ranks that do not print); a run that uses one is not bit-reproducible.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    for message in NONDETERMINISTIC:  # torch warns at every call: a run would repeat it at every step
        warnings.filterwarnings("once" if show_warnings else "ignore", message=message, category=UserWarning)


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed python and numpy from the seed torch gave this worker.

    torch seeds each worker from the loader's generator; python's and numpy's generators would otherwise be
    copies of the parent's, so every worker would draw the same augmentations.
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


class EarlyStopping:
    """Stop when a monitored value has not improved by more than `delta` for `patience` calls.

    Called as in the original template::

        early_stopping(val_loss)
        if early_stopping.early_stop:
            break

    `mode="min"` watches a value that should fall (a loss), `"max"` one that should rise (an accuracy).
    In a distributed run, feed it a value reduced across ranks, so every rank stops after the same epoch.
    """

    def __init__(self, patience: int = 7, verbose: bool = False, delta: float = 0.0, mode: str = "min"):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if delta < 0:
            raise ValueError(f"delta must be >= 0, got {delta}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.patience = patience
        self.verbose = verbose
        self.delta = delta
        self.mode = mode
        self.best: float | None = None
        self.counter = 0
        self.early_stop = False

    def __call__(self, value: float) -> bool:
        """Record one value; return True when it is a new best."""
        value = float(value)
        if self.best is None or self._better(value, self.best):
            self.best = value
            self.counter = 0
            return True
        self.counter += 1
        if self.verbose:
            print(f"EarlyStopping counter: {self.counter} out of {self.patience}")
        if self.counter >= self.patience:
            self.early_stop = True
        return False

    def _better(self, value: float, best: float) -> bool:
        return value < best - self.delta if self.mode == "min" else value > best + self.delta

    def state_dict(self) -> dict:
        return {"best": self.best, "counter": self.counter, "early_stop": self.early_stop}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]
        self.counter = state["counter"]
        self.early_stop = state["early_stop"]
