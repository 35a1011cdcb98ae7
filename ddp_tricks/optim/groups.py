"""The optimizer's parameter groups as the start line counts them (which parameters the exclusion rule keeps apart:
ddp_tricks/no_decay.py).
"""

from __future__ import annotations

import torch


def describe(optimizer: torch.optim.Optimizer) -> str:
    """`optimizer AdamW (betas 0.9, 0.95, eps 1e-06): 2 groups: 4 tensors, 1,184 elements, wd 0.0005; 6 tensors,
    96 elements, wd 0, no trust ratio`: the optimizer a run steps (its class, inside any wrapper), its settings the
    flags reach and each group's tensors and elements, for the start line."""
    inner, wrappers = optimizer, []
    while hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):
        wrappers.append(type(inner).__name__)
        inner = inner.optimizer
    name = "".join(f"{w}(" for w in wrappers) + type(inner).__name__ + ")" * len(wrappers)
    settings = [f"{key} {_shown(inner.defaults[key])}" for key in SHOWN if key in inner.defaults]
    settings += [said for key, (when, said) in SWITCHES.items() if inner.defaults.get(key, not when) == when]
    trust = any(w == "LARSWrapper" for w in wrappers) or "lars" in inner.defaults
    parts = [describe_group(group, trust) for group in optimizer.param_groups]
    settings_line = f" ({', '.join(settings)})" if settings else ""
    return f"optimizer {name}{settings_line}: {len(parts)} group{'s' * (len(parts) != 1)}: {'; '.join(parts)}"


SHOWN = ("betas", "eps", "momentum", "ns_steps")  # the settings the start line shows
SWITCHES = {  # and the switches, when they are not the default: (the value, what the line says)
    "nesterov": (True, "nesterov"),
    "trust_clip": (True, "trust clip"),
    "always_adapt": (False, "no trust ratio without weight decay"),
}


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return ", ".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_group(group: dict, trust: bool) -> str:
    """`body: 4 tensors, 1,184 elements, LR x0.1, wd 0.01, no trust ratio`: one group of the optimizer."""
    params = group["params"]
    text = f"{len(params)} tensor{'s' * (len(params) != 1)}, {sum(p.numel() for p in params):,} elements"
    if group.get("name"):
        text = f"{group['name']}: {text}"
    if group.get("lr_mult", 1.0) != 1.0:
        text += f", LR x{group['lr_mult']:g}"
    if "muon" in group:
        text += ", Muon" if group["muon"] else ", AdamW"
    text += f", wd {group.get('weight_decay', 0.0):g}"
    if trust and not group.get("lars", True):
        text += ", no trust ratio"
    return text
