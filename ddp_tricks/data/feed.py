"""A loader whose batches arrive on the device, finished: the dataset's `finish(inputs, device)` copies the inputs
(non-blocking, from pinned memory) and turns them into the model's input there (a uint8 image batch into normalised
floating point, channels-last or not; encoded JPEGs decoded on the GPU). On a GPU the next batch's copy and
conversion run on a side stream while the current batch trains, as timm's PrefetchLoader does. Everything else (the
batch sampler the loop points at each epoch's steps, the dataset, its collate_fn, the generator seed_epoch seeds)
is the wrapped DataLoader's; a batch made outside the loader (loaders.batch_of) is finished there.

A training Feed may also run a batch transform on the finished batch (a task's `batch_transform(inputs, targets)`,
or --mixup's), each micro-batch's under data.mixing.seeded with the key its batch sampler gives it: (seed, epoch,
step of the epoch, slot), so its draws are the same after a resume and at any world size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from ddp_tricks.data.mixing import seeded
from ddp_tricks.errors import UserError


def moved(inputs, device: torch.device, channels_last: bool = False):
    """The finish of a dataset without one, for a batch transform: a tensor batch on `device` (other structures as
    they are: the loop moves them)."""
    return inputs.to(device, non_blocking=True) if isinstance(inputs, torch.Tensor) else inputs


class Feed:
    """`loader`'s (inputs, targets) batches with the inputs finished on `device` by `finish(inputs, device)`. The time
    spent waiting on the loader (its workers) is the step log's to count: it times each `next()` of the loop."""

    def __init__(self, loader: DataLoader, device: torch.device, finish: Callable[..., torch.Tensor], transform=None):
        self.loader, self.device, self.finish, self.transform = loader, device, finish, transform

    def _keys(self):
        """The key of each batch of this iteration (its batch sampler's), where a transform runs; else None."""
        return None if self.transform is None else iter(self.loader.batch_sampler.keys())

    def _transformed(self, inputs, targets, keys):
        if keys is None:
            return inputs, targets
        with seeded(next(keys), self.device):
            return self.transform(inputs, targets)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def _next(self, batches):
        try:
            return next(batches)
        except UserError as error:  # a worker's: DataLoader re-raises it with the worker's traceback in its message
            line = str(error).strip().splitlines()[-1]
            raise UserError(line.removeprefix(f"{UserError.__module__}.UserError: ")) from None

    def __iter__(self):
        batches, keys = iter(self.loader), self._keys()
        if self.device.type != "cuda":
            while (batch := self._next_or_none(batches)) is not None:
                inputs, targets = batch
                yield self._transformed(self.finish(inputs, self.device), targets.to(self.device), keys)
            return
        yield from self._prefetched(batches, keys)

    def _next_or_none(self, batches):
        try:
            return self._next(batches)
        except StopIteration:
            return None

    def _prefetched(self, batches, keys):
        """One batch ahead on a side stream: its copy and conversion overlap the current batch's compute; the
        compute stream waits for the side stream before it uses a batch, and the batch's memory is recorded as used
        by the compute stream so the allocator does not hand it out while the compute still reads it."""
        side = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)

        def stage(batch):
            inputs, targets = batch
            side.wait_stream(compute)  # the side stream must not run ahead of memory the compute stream frees
            with torch.cuda.stream(side):
                inputs = self.finish(inputs, self.device)
                targets = targets.to(self.device, non_blocking=True)
                return self._transformed(inputs, targets, keys)

        ahead = self._next_or_none(batches)
        ahead = stage(ahead) if ahead is not None else None
        while ahead is not None:
            compute.wait_stream(side)
            inputs, targets = ahead
            for tensor in (inputs, targets):
                if isinstance(tensor, torch.Tensor):  # a structure without a finish of its own: the loop moves it
                    tensor.record_stream(compute)
            following = self._next_or_none(batches)
            ahead = stage(following) if following is not None else None
            yield inputs, targets
