"""Where the modules that once stood at the top of the repository went, so that an old import fails with one line
that names the new one (`import data` -> "import InMemoryDataset from ddp_tricks")."""

from __future__ import annotations

import importlib.abc
import sys

# old top-level module -> what to import instead
NEW_HOMES = {
    "config": "ddp_tricks.cli (UserError: from ddp_tricks import UserError)",
    "data": "ddp_tricks.data (InMemoryDataset: from ddp_tricks import InMemoryDataset)",
    "image_data": "ddp_tricks.data.images",
    "plan": "ddp_tricks.plan",
    "engine": "ddp_tricks.training (the loop: ddp_tricks.training.loop)",
    "distributed": "ddp_tricks.distributed",
    "checkpoint": "ddp_tricks.storage.checkpoint",
    "run_folder": "ddp_tricks.storage.run_folder",
    "precision": "ddp_tricks.training.precision",
    "precise_bn": "ddp_tricks.training.precise_bn",
    "schedulers": "ddp_tricks.schedules (PolynomialWarmup: from lars import PolynomialWarmup)",
    "batch_trace": "ddp_tricks.traces.batch_trace",
    "trace_api": "ddp_tricks.traces.original_api (CustomSampler, LinearRuleOptimizer, RootRuleOptimizer, "
    "AdaScaleOptimizer)",
    "models": "ddp_tricks.models",
    "optimizers": "ddp_tricks.optim",
    "optimizer_wrapper": "ddp_tricks.wrapped_optimizer",
    "plots": "ddp_tricks.plots",
}


def message(name: str) -> str:
    return f"module {name!r} moved into the ddp_tricks package: import {NEW_HOMES[name]}"


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: reached only when no other finder has the module, so a module of the user's own
    with one of these names still imports."""

    def find_spec(self, fullname, path=None, target=None):
        if path is None and fullname in NEW_HOMES:
            raise ModuleNotFoundError(message(fullname), name=fullname)
        return None


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
