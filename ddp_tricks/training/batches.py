"""Batches and outputs of any structure: a tensor, or dicts / tuples / lists / named tuples / dataclasses of tensors
(and leaves that are not tensors, passed through as they are). Moving to the device, casting the model's floating
outputs to float32, emptying a batch and describing a batch in a message all walk the structure; a plain tensor
takes a short path with no walk at all. A batch's samples are never counted from its structure: they are the
dataset items it was made of, which the plan (training) and the batch sampler (evaluation) know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

HALF = (torch.float16, torch.bfloat16)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value):
    """`value` with every tensor inside it replaced by fn(tensor), keeping each container's own type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):  # a dict, or a mapping of a library's own (a UserDict, a BatchEncoding)
        mapped = {key: map_tensors(fn, item) for key, item in value.items()}
        try:
            return type(value)(mapped)
        except TypeError:
            return mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple (torchvision's GoogLeNetOutputs)
        return type(value)(*(map_tensors(fn, item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: map_tensors(fn, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors inside a structure, in order (depth first)."""
    found: list[torch.Tensor] = []
    map_tensors(lambda tensor: found.append(tensor) or tensor, value)
    return found


def to_device(value, device: torch.device, channels_last: bool = False):
    """Every tensor to `device` (non-blocking: from pinned memory the copy overlaps the compute); with
    `channels_last`, 4-D floating tensors (images) in that memory format."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device, non_blocking=True)
        if channels_last and tensor.dim() == 4 and tensor.is_floating_point():
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    return move(value) if isinstance(value, torch.Tensor) else map_tensors(move, value)


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in HALF else tensor


def float_outputs(outputs):
    """The model's outputs with every half-precision tensor (autocast's) cast to float32, so the loss and the
    metrics compute in full precision; everything else as it is."""
    return _to_float32(outputs) if isinstance(outputs, torch.Tensor) else map_tensors(_to_float32, outputs)


def detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else map_tensors(torch.Tensor.detach, value)


def describe(value) -> str:
    """A batch in a message: `tensor (4, 1, 8, 8) float32`, `dict(tokens: tensor (4, 37) int64, ...)`."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        return "dict(" + ", ".join(f"{key}: {describe(item)}" for key, item in value.items()) + ")"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ", ".join(describe(item) for item in value) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}: {describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    return type(value).__name__
