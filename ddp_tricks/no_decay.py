"""The exclusion rule: which parameters take no weight decay and no trust ratio (`excluded`: timm's
`param_groups_weight_decay` and nanoGPT's rule, with timm's `no_weight_decay()` convention), and `split` by it. Below
the optimizers: LARS (lars.py) and the optimizer's build (optim/build.py) both apply it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm, nn.RMSNorm)


def _listed(model: nn.Module, method: str, prefixed: bool = True) -> set[str]:
    """The names a model's `method()` (timm's `no_weight_decay()` / `no_weight_decay_keywords()`) gives, from the
    model and from each submodule that has one (`prefixed`: its names under the submodule's)."""
    found: set[str] = set()
    for prefix, module in model.named_modules():
        listing = getattr(module, method, None)
        if callable(listing):
            found |= {f"{prefix}.{name}" if prefix and prefixed else str(name) for name in listing()}
    return found


def excluded(model: nn.Module) -> set[int]:
    """The ids of the parameters the exclusion rule (--no-decay-1d, once --bn-bias-separately) keeps out of weight
    decay and the trust ratio: every parameter of one dimension or fewer (biases of any name, every norm's weight,
    0-d scalars), every parameter of a normalisation layer, every bias by name (`bias`, `in_proj_bias`, `bias_k`),
    and the names the model lists in `no_weight_decay()` or whose name holds a word of `no_weight_decay_keywords()`
    (timm's convention; a submodule's lists count, under its prefix). A tied parameter is kept out where any of its
    names is."""
    names = _listed(model, "no_weight_decay")
    keywords = _listed(model, "no_weight_decay_keywords", prefixed=False)
    apart = set()
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if (
                p.ndim <= 1
                or isinstance(module, NORM_LAYERS)
                or "bias" in name.split("_")
                or full in names
                or any(word in full for word in keywords)
            ):
                apart.add(id(p))
    return apart


def split(params: Iterable[torch.Tensor], apart: set[int]) -> tuple[list, list]:
    """`params` as (those the rule leaves in, those it keeps out), in their order."""
    params = list(params)
    return [p for p in params if id(p) not in apart], [p for p in params if id(p) in apart]
