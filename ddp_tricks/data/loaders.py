"""Samplers and loaders: each epoch's training micro-batches as the plan lists them (a batch sampler), the exact
evaluation split (every validation sample on exactly one rank, none padded in twice), and their seeds. Their worker
processes leave SIGTERM and SIGINT to the rank's main process (workers.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ddp_tricks.data.in_memory import InMemoryDataset
from ddp_tricks.data.workers import Loader, worker_init
from ddp_tricks.errors import UserError


def _batch_as_is(batch):
    """collate_fn for InMemoryDataset, whose __getitems__ already returns a batch."""
    return batch


def validation_rounds(length: int, world_size: int, batch_size: int) -> list[range]:
    """The evaluation's global batches, in order: K = ceil(length / (world_size x batch_size)) ranges of the set, as
    equal as possible (the longer first). They depend on the global batch world_size x batch_size alone, so one
    process at that batch size holds the same global batches."""
    rounds = -(-length // (world_size * batch_size))
    size, longer = divmod(length, rounds)
    starts = [k * size + min(k, longer) for k in range(rounds + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(rounds)]


class EvalSampler(Sampler[list[int]]):
    """A batch sampler of this rank's validation batches: each global batch (validation_rounds) dealt out over the
    ranks, its sample i to rank i mod world_size. Every rank thus holds the same number of batches (`rounds`), each
    sample is on exactly one rank (no padding, none dropped), a batch's rows differ by at most one between the ranks
    (the lower ranks hold the extra ones), and a rank's batch is empty only where its global batch has fewer samples
    than there are ranks (a set smaller than rounds x world_size). Empty batches come last: the loader yields the
    non-empty ones and the evaluation runs the rest (`rounds - len(sampler)`) as batches of no sample."""

    def __init__(self, length: int, world_size: int, rank: int, batch_size: int):
        global_batches = validation_rounds(length, world_size, batch_size)
        self.rounds = len(global_batches)
        self.batches = [list(r[rank::world_size]) for r in global_batches if len(r) > rank]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class PlanSampler(Sampler[list[int]]):
    """A batch sampler that yields this rank's micro-batches of the current epoch's plan, from a given step on.

    `start(steps, first_step)` sets the epoch; a DataLoader built on it (with persistent workers too) then
    yields exactly the micro-batches of those steps, in order.
    """

    def __init__(self):
        self.micro_batches: list[list[int]] = []

    def start(self, steps, first_step: int = 0) -> None:
        self.micro_batches = [indices for step in steps[first_step:] for indices in step.micro_batches]

    def __iter__(self):
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


def seed_epoch(loader: DataLoader, epoch: int, seed: int, rank: int) -> None:
    """This epoch's randomness (augmentation, worker seeds) as a function of (seed, rank, epoch) alone, so a
    resumed run draws what the uninterrupted run drew."""
    epoch_seed = (seed * 1_000_003 + rank) * 1_009 + epoch
    loader.generator.manual_seed(epoch_seed)
    torch.manual_seed(epoch_seed)


def check_sizes(num_train: int, num_val: int, world_size: int) -> None:
    """Combinations the datasets make impossible, found before any process group exists."""
    if num_val < world_size:
        raise UserError(
            f"the validation set has {num_val} samples, fewer than the {world_size} processes; launch fewer processes"
        )
    if num_train < world_size:
        raise UserError(f"the training set has {num_train} samples, fewer than the {world_size} processes")


def _collate_fn(dataset: Dataset, collate: Callable | None) -> Callable:
    """The task's collate(), else an in-memory dataset's batch as is (its __getitems__ built it), else torch's."""
    if collate is not None:
        return collate
    return _batch_as_is if isinstance(dataset, InMemoryDataset) else default_collate


def batch_of(dataset: Dataset, indices: list[int], collate: Callable | None = None):
    """The batch a loader of this module builds from these samples (the same fetch and collate)."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]
    return _collate_fn(dataset, collate)(samples)


def _options(dataset: Dataset, workers: int, prefetch_factor: int, device: torch.device, seed: int, collate) -> dict:
    options = dict(
        num_workers=workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=worker_init,  # signals left to the rank's main process, then seed_worker
        collate_fn=_collate_fn(dataset, collate),
    )
    if workers > 0:
        options.update(persistent_workers=True, prefetch_factor=prefetch_factor)
    return options


def train_loader(
    dataset: Dataset,
    rank: int,
    device: torch.device,
    seed: int,
    workers: int = 0,
    prefetch_factor: int = 2,
    collate: Callable | None = None,
) -> DataLoader:
    """The training loader: its `batch_sampler` (a PlanSampler) is pointed at each epoch's steps by the loop.
    Workers get seed + rank, so augmentation differs between ranks. `collate`: the task's, when it has one."""
    options = _options(dataset, workers, prefetch_factor, device, seed + rank, collate)
    return Loader(dataset, batch_sampler=PlanSampler(), **options)


def val_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    device: torch.device,
    seed: int = 0,
    workers: int = 0,
    prefetch_factor: int = 2,
    collate: Callable | None = None,
) -> DataLoader:
    """Each validation sample on exactly one rank (no padding), so reduced sums are the exact totals, and the same
    number of batches on every rank (EvalSampler: `loader.batch_sampler.rounds`, its empty ones not yielded), so a
    collective that the task's loss() or metric_sums() calls once per batch meets every rank's."""
    sampler = EvalSampler(len(dataset), world_size, rank, batch_size)
    options = _options(dataset, workers, prefetch_factor, device, seed, collate)
    return Loader(dataset, batch_sampler=sampler, **options)


def batch_sizes(loader: DataLoader):
    """The samples of each batch the loader yields, in order: the dataset items its batch sampler puts in each
    (whatever structure the batch has: a list of dicts, labels concatenated over sequences)."""
    return (len(indices) for indices in loader.batch_sampler)


def both(
    train_set: Dataset,
    val_set: Dataset,
    dist,
    collate: Callable | None = None,
    *,
    val_batch_size: int,
    seed: int,
    workers: int = 0,
    prefetch_factor: int = 2,
) -> tuple[DataLoader, DataLoader]:
    """The run's training and validation loaders, for this rank of `dist` (launch.Dist: rank, world size, device)."""
    train = train_loader(train_set, dist.rank, dist.device, seed, workers, prefetch_factor, collate)
    val = val_loader(
        val_set, val_batch_size, dist.rank, dist.world_size, dist.device, seed, workers, prefetch_factor, collate
    )
    return train, val
