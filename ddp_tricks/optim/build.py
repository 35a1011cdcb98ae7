"""The optimizer a run names: torch's SGD / Adam / AdamW, LARS or LAMB, with LARSWrapper around it and Lookahead
on top when asked. Norm layers and biases can be kept out of LARS scaling and weight decay."""

from __future__ import annotations

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
) -> torch.optim.Optimizer:
    groups = parameter_groups(model, weight_decay, bn_bias_separately)
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
