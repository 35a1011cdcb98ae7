"""Samplers and loaders: each epoch's training micro-batches as the plan lists them (a batch sampler), the exact
evaluation split (equal rows on every rank in every batch, each validation sample counted once), and their seeds.
Their worker processes leave SIGTERM and SIGINT to the rank's main process (workers.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ddp_tricks.data.in_memory import InMemoryDataset
from ddp_tricks.data.mixing import batch_key
from ddp_tricks.data.workers import Loader, worker_init
from ddp_tricks.errors import UserError


def _batch_as_is(batch):
    """collate_fn for InMemoryDataset, whose __getitems__ already returns a batch."""
    return batch


def validation_rounds(length: int, world_size: int, batch_size: int) -> tuple[list[range], list[range]]:
    """The evaluation's global batches, in order: (rounds, leftovers). The first world_size x (length // world_size)
    samples make K = ceil((length // world_size) / batch_size) rounds, each of world_size x r_k samples (r_k as equal
    as possible, the longer first), so that every rank holds r_k rows of each; the last length mod world_size
    samples (fewer than the ranks) are the leftovers, in batches of at most batch_size, which every rank evaluates
    alike. One process: every sample in rounds, K = ceil(length / batch_size)."""
    per_rank = length // world_size
    rounds = -(-per_rank // batch_size)
    size, longer = divmod(per_rank, rounds)
    starts = [world_size * (k * size + min(k, longer)) for k in range(rounds + 1)]
    left = range(starts[-1], length)
    leftovers = [left[i : i + batch_size] for i in range(0, len(left), batch_size)]
    return [range(starts[k], starts[k + 1]) for k in range(rounds)], leftovers


def global_batches(length: int, world_size: int, batch_size: int) -> list[list[int]]:
    """The samples that `world_size` ranks evaluate together in each batch, the leftovers once: what one process
    evaluates to hold the same global batches (the reference for a loss or a metric over the global batch)."""
    rounds, leftovers = validation_rounds(length, world_size, batch_size)
    return [list(r) for r in rounds + leftovers]


class EvalSampler(Sampler[list[int]]):
    """A batch sampler of this rank's validation batches: each round (validation_rounds) dealt out over the ranks,
    its sample i to rank i mod world_size, so in every batch every rank holds the same number of rows (an equal-size
    collective, torch.distributed.nn.functional.all_gather, needs nothing more); then the leftovers (fewer samples
    than ranks), the same batches on every rank (`alike`: how many), counted by rank 0 alone. Every rank thus runs
    the same number of batches (`rounds`), none empty, and each sample counts exactly once (none padded in, none
    dropped)."""

    def __init__(self, length: int, world_size: int, rank: int, batch_size: int):
        rounds, leftovers = validation_rounds(length, world_size, batch_size)
        self.batches = [list(r[rank::world_size]) for r in rounds] + [list(r) for r in leftovers]
        self.alike = len(leftovers)
        self.counts_alike = rank == 0
        self.rounds = len(self.batches)

    def counted(self) -> list[bool]:
        """For each batch, whether this rank counts it: its own rows always, the leftovers on rank 0 alone."""
        return [k < len(self.batches) - self.alike or self.counts_alike for k in range(len(self.batches))]

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
        self.places: list[tuple[int, int]] = []  # each micro-batch's (step of the epoch, slot)
        self.epoch_seed = (0, 0)

    def start(self, steps, first_step: int = 0) -> None:
        self.micro_batches = [indices for step in steps[first_step:] for indices in step.micro_batches]
        self.places = [
            (first_step + s, slot)
            for s, step in enumerate(steps[first_step:])
            for slot in getattr(step, "slots", ()) or range(len(step.micro_batches))
        ]

    def seed(self, seed: int, epoch: int) -> None:
        self.epoch_seed = (seed, epoch)

    def keys(self) -> list[int]:
        """The batch transform's key of each micro-batch it yields: (seed, epoch, step of the epoch, slot)."""
        return [batch_key(*self.epoch_seed, step, slot) for step, slot in self.places]

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
    if hasattr(loader.batch_sampler, "seed"):  # the batch transform's keys (data.mixing)
        loader.batch_sampler.seed(seed, epoch)
    seed_augmentation = getattr(loader.dataset, "seed_augmentation", None)
    if seed_augmentation is not None:  # a dataset whose augmentation is a function of (seed, epoch, sample)
        seed_augmentation(seed, epoch)


def check_sizes(num_train: int, num_val: int, world_size: int) -> None:
    """Combinations the datasets make impossible, found before any process group exists."""
    if num_val < world_size:
        raise UserError(
            f"the validation set has {num_val} samples, fewer than the {world_size} processes; launch fewer processes"
        )
    if num_train < world_size:
        raise UserError(f"the training set has {num_train} samples, fewer than the {world_size} processes")


def _collate_fn(dataset: Dataset, collate: Callable | None) -> Callable:
    """The task's collate(), else the dataset's own (`collate`), else an in-memory dataset's batch as is (its
    __getitems__ built it), else torch's."""
    if collate is not None:
        return collate
    if hasattr(dataset, "collate"):
        return dataset.collate
    return _batch_as_is if isinstance(dataset, InMemoryDataset) else default_collate


def batch_of(dataset: Dataset, indices: list[int], collate: Callable | None = None):
    """The batch a loader of this module builds from these samples (the same fetch and collate), as the model sees
    it: finished by the dataset's `finish` where it has one (on the CPU)."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]
    batch = _collate_fn(dataset, collate)(samples)
    finish = getattr(dataset, "finish", None)  # what the Feed does to the loader's batches, done here
    return batch if finish is None else (finish(batch[0], torch.device("cpu")), batch[1])


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
    """Each validation sample counted on exactly one rank (no padding), so reduced sums are the exact totals, and
    the same number of batches on every rank, of the same number of rows (EvalSampler), so a collective that the
    task's loss() or metric_sums() calls once per batch meets every rank's, with the same shapes."""
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
    batch_transform: Callable | None = None,
    *,
    val_batch_size: int,
    seed: int,
    workers: int = 0,
    prefetch_factor: int = 2,
    channels_last: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """The run's training and validation loaders, for this rank of `dist` (launch.Dist: rank, world size, device);
    a dataset that finishes its batches on the device (`finish`: uint8 images) gets a Feed, which does it, and so
    does training with a `batch_transform` (the task's, or --mixup's: data.mixing), which the Feed runs after it."""
    train = train_loader(train_set, dist.rank, dist.device, seed, workers, prefetch_factor, collate)
    val = val_loader(
        val_set, val_batch_size, dist.rank, dist.world_size, dist.device, seed, workers, prefetch_factor, collate
    )
    describe = getattr(train_set, "describe", None)
    if describe is not None:  # the run's log says where its input is decoded (rank 0's log: the others are quiet)
        logging.getLogger("ddp_tricks").info("input: %s; %d loader worker(s) per rank", describe(), workers)
    return fed(train, dist.device, channels_last, batch_transform), fed(val, dist.device, channels_last)


def fed(loader: DataLoader, device: torch.device, channels_last: bool = False, batch_transform=None):
    """The loader as a Feed where its dataset finishes batches on the device (`finish`) or a `batch_transform`
    follows, else as it is."""
    from ddp_tricks.data.feed import Feed, moved

    finish = getattr(loader.dataset, "finish", None)
    if finish is None and batch_transform is None:
        return loader
    finish = moved if finish is None else functools.partial(finish, channels_last=channels_last)
    return Feed(loader, device, finish, batch_transform)
