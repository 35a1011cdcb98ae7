"""The model wrapped for data parallelism (SyncBatchNorm on request, then DistributedDataParallel; sharding is
fsdp.py's), and the one way the loop keeps a backward's gradients local while it accumulates micro-batches."""

from __future__ import annotations

import contextlib

import torch


def wrap(model: torch.nn.Module, dist_info, sync_bn: bool = False, **ddp_options) -> torch.nn.Module:
    """SyncBatchNorm (on request) and DistributedDataParallel, in a distributed run; the model as is otherwise."""
    if not dist_info.enabled:
        return model
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [dist_info.device] if dist_info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, **ddp_options
    )


def accumulating(model: torch.nn.Module):
    """A context in which a backward pass does not reduce gradients across ranks (the step's last micro-batch
    does): DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync(False)` (no reduce-scatter before the last
    micro-batch); a model with no reducer of its own needs nothing."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
