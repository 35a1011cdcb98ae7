"""The optimizer a run names: torch's SGD / Adam / AdamW, LARS or LAMB, with LARSWrapper around it and Lookahead
on top when asked. Norm layers and biases can be kept out of LARS scaling and weight decay."""

from __future__ import annotations

from collections.abc import Collection

import torch

from ddp_tricks.optim import NAMES
from lamb import LAMB
from lars import LARS, LARSWrapper, parameter_groups
from lookahead import Lookahead


def build(
    model: torch.nn.Module,
    name: str,
    *,
    lr: float,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 1e-8,
    bn_bias_separately: bool = False,
    lars_wrap: bool = False,
    lookahead: bool = False,
    lookahead_k: int = 5,
    lookahead_alpha: float = 0.5,
    sparse: Collection[str] = (),
) -> torch.optim.Optimizer:
    """The optimizer `name` over the model's trainable parameters. `sparse`: the names of those that get sparse
    gradients (training/seam.py finds them); only SGD steps them, in a group of their own without weight decay
    (torch cannot add a dense decay to a sparse gradient) and without momentum (torch's buffer for a sparse
    gradient is never merged: it grows by every step's rows, 16 to 282 entries in 20 steps of a 50-row table)."""
    groups = parameter_groups(model, weight_decay, bn_bias_separately)
    if sparse:
        if name != "sgd":
            raise ValueError(f"sparse gradients ({', '.join(sparse)}) need SGD, not {name!r}")
        groups = _sparse_apart(model, groups, set(sparse))
    if name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    elif name == "adam":
        optimizer = torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)
    elif name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    elif name == "lars":
        optimizer = LARS(
            groups,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
        )
    elif name == "lamb":
        optimizer = LAMB(groups, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r} (one of {', '.join(NAMES)})")
    if lars_wrap:
        optimizer = LARSWrapper(optimizer, trust_coefficient=trust_coefficient, eps=eps)
    if lookahead:
        optimizer = Lookahead(optimizer, k=lookahead_k, alpha=lookahead_alpha)
    return optimizer


def _sparse_apart(model: torch.nn.Module, groups: list[dict], sparse: set[str]) -> list[dict]:
    """`groups` without the parameters named in `sparse`, and those in a plain-SGD group of their own."""
    tables = [p for name, p in model.named_parameters() if name in sparse]
    ids = {id(p) for p in tables}
    kept = [group | {"params": [p for p in group["params"] if id(p) not in ids]} for group in groups]
    plain = {"params": tables, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False, "lars": False}
    return [group for group in kept if group["params"]] + [plain]
