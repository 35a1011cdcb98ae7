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


class _AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d to `output_size` x `output_size`, whose backward has no deterministic CUDA kernel: under
    --deterministic on CUDA, where its windows tile the input (each side a multiple of `output_size`, as for the
    built-in data), the same means come from avg_pool2d, whose backward is deterministic. Elsewhere torch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = tiling_kernel(x.shape[-2:], self.output_size)
        if kernel is not None and x.is_cuda and torch.are_deterministic_algorithms_enabled():
            return nn.functional.avg_pool2d(x, kernel)
        return super().forward(x)


def tiling_kernel(size, output_size: int) -> tuple[int, int] | None:
    """The avg_pool2d kernel (its stride too) whose windows are adaptive pooling's to `output_size` x `output_size`
    on an input of `size` (height, width); None where a side is not a multiple of it (those windows overlap)."""
    if any(side % output_size for side in size):
        return None
    return tuple(side // output_size for side in size)


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
            *_conv_block(in_channels, width), *_conv_block(width, 2 * width), _AdaptiveAvgPool2d(2)
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
            *_conv_block(2 * width, 4 * width), _AdaptiveAvgPool2d(1),
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


# where training needs more than torchvision's min_size (which is for inference): Inception-v3's auxiliary head
# pools its 17x17 grid to 5x5 and convolves it with a 5x5 kernel, so it trains from 299x299 up (measured)
TRAINING_MIN_SIZE = {"inception_v3": (299, 299)}


def min_input_size(name: str) -> tuple[int, int]:
    """The smallest (height, width) a model trains on: torchvision's own `min_size` for its classifiers (or more,
    see TRAINING_MIN_SIZE), 1 x 1 for the toy CNNs (any size)."""
    if name in TOYS:
        return (1, 1)
    if name in TRAINING_MIN_SIZE:
        return TRAINING_MIN_SIZE[name]
    from torchvision import models as tv

    return tuple(next(iter(tv.get_model_weights(name))).meta.get("min_size", (1, 1)))


# torchvision classifiers whose training-mode output is a named tuple with auxiliary logits, and the weight each
# auxiliary loss gets: GoogLeNet's paper weighs its two by 0.3, Inception-v3's (PyTorch's fine-tuning tutorial) 0.4
AUX_WEIGHTS = {"GoogLeNetOutputs": 0.3, "InceptionOutputs": 0.4}


def main_and_aux(outputs) -> tuple[torch.Tensor, list[tuple[float, torch.Tensor]]]:
    """A classifier's logits and its auxiliary heads' (weight, logits): GoogLeNet and Inception-v3 return those
    as a named tuple in training mode; every other output is the logits alone."""
    weight = AUX_WEIGHTS.get(type(outputs).__name__)
    if weight is None:
        return outputs, []
    main, *aux = outputs
    return main, [(weight, logits) for logits in aux if logits is not None]


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
