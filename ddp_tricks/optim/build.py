"""The optimizer a run names: torch's SGD / Adam / AdamW, LARS or LAMB, with LARSWrapper around it and Lookahead
on top when asked. The exclusion rule (groups.py) can keep biases, norms, scalars and the model's no_weight_decay()
names out of weight decay and the trust ratio."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

import torch

import lars
from ddp_tricks.distributed import fsdp
from ddp_tricks.errors import UserError
from ddp_tricks.no_decay import excluded, split
from ddp_tricks.optim import NAMES, muon
from lamb import LAMB
from lars import parameter_groups
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
    betas: tuple[float, float] = (0.9, 0.999),
    adam_eps: float | None = None,
    trust_clip: bool = False,
    always_adapt: bool = True,
    bn_bias_separately: bool = False,
    lars_wrap: bool = False,
    lookahead: bool = False,
    lookahead_k: int = 5,
    lookahead_alpha: float = 0.5,
    sparse: Collection[str] = (),
    muon_momentum: float = 0.95,
    muon_nesterov: bool = True,
    ns_steps: int = 5,
    head: Sequence[str] = (),
    groups: Sequence[dict] = (),
    own: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `name` over the model's trainable parameters. `sparse`: the names of those that get sparse
    gradients (training/seam.py finds them); only SGD steps them, in a group of their own without weight decay
    (torch cannot add a dense decay to a sparse gradient) and without momentum (torch's buffer for a sparse
    gradient is never merged: it grows by every step's rows, 16 to 282 entries in 20 steps of a 50-row table).
    `groups`: the task's parameter groups by name (seam.param_groups), each with its LR multiplier and weight decay
    (its LR is `lr` x its multiplier, and the schedules keep that ratio); --bn-bias-separately splits each one.
    `eps` is LARS's trust-ratio epsilon; `betas` and `adam_eps` (None: each one's default) are Adam's, AdamW's and
    LAMB's; `trust_clip` and `always_adapt` LAMB's (as timm's Lamb). `own`: the task's `optimizer(param_groups)`,
    which builds the optimizer on the groups made here (each with its `lr`), in place of `name`'s. `muon`: Muon on the
    hidden matrices (muon.is_hidden: not embeddings, not the output head's parameters, named in `head`), AdamW
    (`betas`, `adam_eps`) on the rest.
    A model `fsdp.shard` sharded keeps its mesh: LARS's and LAMB's norms are summed over its shard dimension."""
    mesh = fsdp.mesh_of(model)
    shard_group = mesh.shard_group() if mesh is not None else None
    if groups:
        groups = task_groups(model, groups, lr, weight_decay, bn_bias_separately)
    else:
        groups = parameter_groups(model, weight_decay, bn_bias_separately)
    if sparse:
        if name != "sgd":
            raise ValueError(f"sparse gradients ({', '.join(sparse)}) need SGD, not {name!r}")
        groups = _sparse_apart(model, groups, set(sparse))
    with_lars = functools.partial(lars.lars_over, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                  trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                                  shard_group=shard_group)  # fmt: skip
    if own is not None:
        optimizer = own_optimizer(own, model, [group | {"lr": group.get("lr", lr)} for group in groups])
    elif name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    elif name in ("adam", "adamw"):
        adam = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        optimizer = adam(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=_or(adam_eps, 1e-8))
    elif name == "lars":
        optimizer = with_lars(groups)
    elif name == "lamb":
        optimizer = LAMB(groups, lr=lr, betas=betas, eps=_or(adam_eps, 1e-6), weight_decay=weight_decay,
                         trust_clip=trust_clip, always_adapt=always_adapt, shard_group=shard_group)  # fmt: skip
    elif name == "muon":
        apart = excluded(model) if bn_bias_separately else set()
        optimizer = muon.MuonAdamW(muon.muon_groups(model, groups, tuple(head), apart), lr=lr,
                                   weight_decay=weight_decay, momentum=muon_momentum, nesterov=muon_nesterov,
                                   ns_steps=ns_steps, betas=betas, eps=_or(adam_eps, 1e-8),
                                   shard_group=shard_group)  # fmt: skip
    else:
        raise ValueError(f"unknown optimizer {name!r} (one of {', '.join(NAMES)})")
    if lars_wrap:
        optimizer = with_lars(optimizer)
    if lookahead:
        optimizer = Lookahead(optimizer, k=lookahead_k, alpha=lookahead_alpha)
    return optimizer


TEMPLATE_KEYS = {"params", "lr", "lr_mult", "name", "weight_decay", "lars"}  # what any optimizer's groups may carry


def own_optimizer(make: Callable, model: torch.nn.Module, groups: list[dict]) -> torch.optim.Optimizer:
    """The task's own optimizer, `make(groups)`, checked: a torch.optim.Optimizer over every trainable parameter of
    the model, whose defaults know each key the task's groups set. A mistake is one line (UserError)."""
    optimizer = make(groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"the task's optimizer() gave {type(optimizer).__name__}, not a torch.optim.Optimizer: return one built on "
            "the param_groups it is given, e.g. torch.optim.RAdam(param_groups)"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        shown = ", ".join(map(repr, missing[:4])) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UserError(
            f"the task's optimizer() ({type(optimizer).__name__}) leaves out the parameter(s) {shown}: build it on "
            "every param_group it is given"
        )
    for group in groups:
        unknown = sorted(set(group) - TEMPLATE_KEYS - set(optimizer.defaults))
        if unknown:
            takes = ", ".join(map(repr, optimizer.defaults))
            raise UserError(
                f"the task's param_groups(), {group.get('name') or 'a group'!r}, has the key {unknown[0]!r}, which the "
                f"task's optimizer() ({type(optimizer).__name__}) lacks: it takes {takes}"
            )
    return optimizer


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def task_groups(
    model: torch.nn.Module, groups: Sequence[dict], lr: float, weight_decay: float, bn_bias_separately: bool
) -> list[dict]:
    """The optimizer's groups from the task's (by parameter name): each group's parameters, its LR (`lr` x its
    `lr_mult`, which the group keeps for the schedules), its weight decay (`weight_decay` where it names none) and the
    optimizer's own keys it sets ('lars': False, no trust ratio; 'betas', 'eps', 'momentum', ...);
    with `bn_bias_separately` the parameters the exclusion rule keeps out (no_decay.excluded: one dimension or fewer,
    norm layers, the model's no_weight_decay() names) in a group of their own (no weight decay, no trust ratio),
    with the same multiplier."""
    by_name = dict(model.named_parameters())
    apart = excluded(model) if bn_bias_separately else set()
    result = []
    for group in groups:
        mult = group.get("lr_mult", 1.0)
        options = {"lr": lr * mult, "lr_mult": mult, "name": group.get("name", "")}
        scaled, plain = split((by_name[name] for name in group["params"]), apart)
        own = {key: value for key, value in group.items() if key not in ("params", "lr_mult", "weight_decay", "name")}
        if scaled:
            decay = group.get("weight_decay", weight_decay)
            result.append({"params": scaled, "weight_decay": decay, "lars": True} | options | own)
        if plain:
            result.append({"params": plain} | options | own | {"weight_decay": 0.0, "lars": False})
    return result


def _sparse_apart(model: torch.nn.Module, groups: list[dict], sparse: set[str]) -> list[dict]:
    """`groups` without the parameters named in `sparse`, and those in a plain-SGD group of their own."""
    tables = [p for name, p in model.named_parameters() if name in sparse]
    ids = {id(p) for p in tables}
    kept = [group | {"params": [p for p in group["params"] if id(p) not in ids]} for group in groups]
    plain = {"params": tables, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False, "lars": False}
    return [group for group in kept if group["params"]] + [plain]
