"""Precise BatchNorm statistics (`--precise-bn SAMPLES`): before an evaluation, every BatchNorm layer's running mean
and variance become the plain average of the batch statistics of a number of training micro-batches per rank,
computed with the current weights and averaged over the ranks.

Why: evaluation uses the running statistics, an exponential moving average (momentum 0.1) of the batch statistics
seen during training. After a few hundred steps that average describes the current weights. After 20 steps (a
large-batch run: one step per epoch at the full training set) 12 % of it is still the initial mean 0 and
variance 1, and most of the rest comes from weights that have since moved: the evaluated network is not the one
that was trained. Recomputing the statistics with the current weights removes the mismatch (Wu & Johnson,
"Rethinking 'Batch' in BatchNorm", 2021, call this precise BN).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ddp_tricks.distributed.collectives import all_reduce_sum, min_over_ranks


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm1d/2d/3d and SyncBatchNorm layers that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@torch.no_grad()
def recompute(
    model: nn.Module,
    inputs: Iterable[torch.Tensor],
    count: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> int:
    """Replace the running statistics of `model`'s BatchNorm layers by the average over the first `count` input
    batches (the same number on every rank), then average them over the ranks. Returns the batches used per
    rank; 0 (statistics untouched) when the model has no BatchNorm or some rank has no batch.

    The running variance is the average of each batch's unbiased variance, as BatchNorm itself keeps it.
    Parameters, the other buffers, `num_batches_tracked` and the train/eval mode are left as they were.
    """
    layers = batchnorm_layers(model)
    if not layers:
        return 0
    device = layers[0].running_mean.device
    count = min_over_ranks(count, device)  # SyncBatchNorm's forward is a collective: a rank with one more would hang
    if count < 1:
        return 0
    saved = [(m, m.momentum, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
             for m in layers]  # fmt: skip
    was_training = model.training
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after k batches, the mean of their k statistics
    model.train()
    used = 0
    try:
        for batch in itertools.islice(inputs, count):
            with autocast():
                model(batch)
            used += 1
    finally:
        model.train(was_training)
        for m, momentum, *_ in saved:
            m.momentum = momentum
    if used < count:  # fewer batches than promised: keep the old statistics rather than a partial average
        for m, _, mean, var, tracked in saved:
            m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(tracked)
        raise ValueError(f"precise BN: {used} input batches where {count} were needed")
    for m, _, _, _, tracked in saved:  # it counts training steps; the recomputation was not one
        m.num_batches_tracked.copy_(tracked)
    ones = torch.ones(1, device=device)  # its sum counts the ranks
    stats = all_reduce_sum(
        torch.cat([t for m in layers for t in (m.running_mean.float(), m.running_var.float())] + [ones])
    )
    stats /= stats[-1].clone()
    offset = 0
    for m in layers:
        n = m.running_mean.numel()
        m.running_mean.copy_(stats[offset : offset + n])
        m.running_var.copy_(stats[offset + n : offset + 2 * n])
        offset += 2 * n
    return used
