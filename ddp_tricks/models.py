"""The small default CNN and a three-block variant, which adapt to any input size and channel count, and
torchvision classifiers by name (random initialisation, `num_classes` from the dataset).
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks.errors import UserError


def _conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True)]  # fmt: skip


def _halve() -> nn.Module:
    return nn.MaxPool2d(2, ceil_mode=True)  # ceil: an odd side keeps its last row, a 1-pixel map stays 1 pixel


class _FeaturesHead(nn.Module):
    """`features` then a linear `head` on their flattened output."""

    features: nn.Sequential
    head: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class ToyCNN(_FeaturesHead):
    """Two conv blocks and a linear head; global average pooling makes it work at any image size."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(in_channels, width), *_conv_block(width, 2 * width), nn.AdaptiveAvgPool2d(2)
        )
        self.head = nn.Linear(8 * width, num_classes)


class ToyCNN3(_FeaturesHead):
    """`toy3`: three conv blocks (width, 2x, 4x channels) with 2x2 max-pooling between them, global average
    pooling and a linear head. The two later convolutions run at a half and a quarter of the resolution, so an
    epoch costs about half of `toy`'s at 14x14 while it learns more per step (docs/large-batch.md)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(in_channels, width), _halve(), *_conv_block(width, 2 * width), _halve(),
            *_conv_block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(4 * width, num_classes)


TOYS = {"toy": ToyCNN, "toy3": ToyCNN3}


def build(name: str, in_channels: int, num_classes: int, init: str = "default") -> nn.Module:
    """`toy`, `toy3` or any torchvision classification model by name."""
    if name in TOYS:
        model = TOYS[name](in_channels, num_classes)
    else:
        model = _torchvision_model(name, num_classes)
        if in_channels != 3:
            _adapt_first_conv(model, in_channels)
    if init == "he":
        he_init(model)
    return model


def check_name(name: str) -> None:
    """`toy`, `toy3` or a torchvision classification model; anything else is a UserError."""
    if name in TOYS:
        return
    from torchvision import models as tv

    if name not in tv.list_models(module=tv):
        raise UserError(
            f"--model {name!r} is unknown: use {', '.join(TOYS)} or a torchvision classifier such as resnet18, resnet50"
        )


def _torchvision_model(name: str, num_classes: int) -> nn.Module:
    from torchvision import models as tv

    check_name(name)
    return tv.get_model(name, weights=None, num_classes=num_classes)


def _adapt_first_conv(model: nn.Module, in_channels: int) -> None:
    """Replace the first 3-channel convolution so a grey-scale dataset fits an ImageNet architecture."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                setattr(
                    parent,
                    child_name,
                    nn.Conv2d(
                        in_channels,
                        child.out_channels,
                        child.kernel_size,
                        child.stride,
                        child.padding,
                        child.dilation,
                        child.groups,
                        child.bias is not None,
                    ),
                )
                return


def compiled(model: nn.Module) -> nn.Module:
    """torch.compile; where it cannot work, one warning and eager mode (now, or at the first failing call)."""
    import logging

    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph that fails to compile runs eagerly instead
    try:
        return torch.compile(model)
    except Exception as error:  # torch.compile refuses some platforms outright
        logging.getLogger("ddp_tricks").warning("warning: --compile is not available here (%s); eager mode", error)
        return model


def he_init(model: nn.Module) -> None:
    """Kaiming-normal weights for every conv and linear layer, zero biases."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(
                module.weight, mode="fan_out" if isinstance(module, nn.Conv2d) else "fan_in", nonlinearity="relu"
            )
            if module.bias is not None:
                nn.init.zeros_(module.bias)
