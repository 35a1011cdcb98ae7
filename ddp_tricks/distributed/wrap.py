"""The model wrapped for data parallelism: SyncBatchNorm on request, then DistributedDataParallel."""

from __future__ import annotations

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
