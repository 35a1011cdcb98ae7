"""ddp-tricks' machinery, one module per concern; run.py tells the recipe, task.py what is trained.

A task file imports what it needs from here, the one stable place: `from ddp_tricks import InMemoryDataset,
UserError`, for a loss over the global batch `gather_with_grad, rank, world_size`, and `in_training_step` for a
loss() that keeps a statistic of the step's batches for its per-step hook. Importing this package does
not import torch (so `run.py --help` answers at once): the names that need it are imported on first use.

    cli/          the command line: flags by trick, --config files, --task loading, checks
    plan.py       numbers derived once: global batch, LR, steps, each epoch's per-step plan
    training/     THE loop and the exact evaluation, the training state, precision, precise BN
    distributed/  launch detection, process group, DDP wrapping, reductions, preemption, the watchdog, heartbeats
    data/         samplers and loaders, in-memory data, the built-in task's image readers
    storage/      the run folder and checkpoints
    schedules/    learning-rate schedules        optim/  the optimizer a run names
    wrapped_optimizer.py   the base of LARSWrapper and Lookahead: an optimizer over another one
    shards.py     sharded (DTensor) tensors for the optimizers: whole norms in one all-reduce
    errors.py     UserError and its one line      moved.py  where the old top-level modules went
    traces/       variable batch size from a trace, and the original trace API
    models.py     the small CNNs and torchvision models      plots.py  figures of runs
"""

from __future__ import annotations

from ddp_tricks import moved
from ddp_tricks.errors import UserError

moved.install()  # `import data` and the other old top-level modules fail with a line naming the new home

__all__ = ["InMemoryDataset", "UserError", "gather_with_grad", "rank", "world_size", "in_training_step"]
_RANKS = ("gather_with_grad", "rank", "world_size")  # distributed/collectives.py: a loss that uses the ranks


def __getattr__(name: str):
    if name == "InMemoryDataset":  # imported on first use: it needs torch
        from ddp_tricks.data.in_memory import InMemoryDataset

        return InMemoryDataset
    if name == "in_training_step":  # training/stepping.py: a loss() that keeps a statistic of the step's batches
        from ddp_tricks.training.stepping import in_training_step

        return in_training_step
    if name in _RANKS:
        from ddp_tricks.distributed import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'ddp_tricks' has no attribute {name!r}")
