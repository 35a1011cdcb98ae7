"""--init-from: a new run's starting weights (and with --init-optimizer its optimizer's state) read from any source,
as torchtitan's `initial_load_path` / timm's `--initial-checkpoint`: a run folder, a last.pt/best.pt, a sharded
checkpoint folder written at any world size, or a plain state-dict file (torchvision's and timm's weights, a
`module.` prefix or a `state_dict`/`model` wrapper). Every file is read with `weights_only=True`. What does not fit
(another shape: a new head; missing; excluded) is left as the model builds it, and said.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ddp_tricks.errors import UserError
from ddp_tricks.shards import is_dtensor, local
from ddp_tricks.storage import sharded
from ddp_tricks.storage.checkpoint import LAST

PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers, in a file saved from the wrapped model


@dataclass
class Source:
    """What a source holds, as whole tensors on the CPU: the model's weights by name, the EMA's (or None), the
    optimizer's state as `state_dict()` gives it (or None) and the optimizer it was (`Lookahead(SGD)`)."""

    path: Path
    kind: str  # said at start: "checkpoint", "sharded checkpoint", "weights file"
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None = None
    optimizer: dict | None = None
    optimizer_name: str | None = None
    epochs: int = 0  # the epochs the source's run had done (0: a weights file)
    parameters: list[str] = field(default_factory=list)  # the optimizer's parameters by name, in its groups' order
    loaded: set[str] = field(default_factory=set)  # the model's tensors start() loaded from it


def read(path: str | Path, optimizer: bool = False) -> Source:
    """The source at `path`, or a UserError naming what is wrong with it (missing, corrupt, no tensors; with
    `optimizer`, --init-optimizer, no optimizer state)."""
    source = _read(path)
    if optimizer:
        check_optimizer(source)
    return source


def _read(path: str | Path) -> Source:
    path = Path(path)
    if not path.exists():
        raise UserError(
            f"--init-from {str(path)!r} does not exist: give a run folder, a last.pt/best.pt, a sharded checkpoint "
            "folder or a weights file"
        )
    if path.is_dir():
        if (path / ".metadata").exists():
            return _sharded(path)
        for name in (LAST["ddp"], LAST["fsdp"]):
            if (path / name).exists():
                return _read(path / name)
        runs = sorted(p.name for p in path.iterdir() if any((p / name).exists() for name in LAST.values()))
        hint = f" (it holds the runs {', '.join(runs[:3])}{' ...' if len(runs) > 3 else ''}: give one)" if runs else ""
        raise UserError(
            f"--init-from {str(path)!r} is a folder with no {LAST['ddp']}, {LAST['fsdp']} or .metadata{hint}: give a "
            "run folder, a checkpoint file or a sharded checkpoint folder"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # empty, truncated, random bytes, pickled code: torch's text is no help here
        raise UserError(
            f"--init-from {str(path)!r} cannot be read as weights (corrupt, truncated, or a pickle that would run "
            "code, which is refused); give a checkpoint or a file saved with torch.save(model.state_dict())"
        ) from None
    if isinstance(state, dict) and "model" in state and "epoch" in state:  # a checkpoint of this template
        return _ours(path, "checkpoint", state)
    return Source(path, "weights file", _weights(_unwrapped(state), path))


def _ours(path: Path, kind: str, state: dict) -> Source:
    """A checkpoint of this template (a file, or a sharded one's whole tensors) as a source."""
    ema = _weights(state["ema"]["weights"], path) if state.get("ema") else None
    return Source(path, kind, _weights(state["model"], path), ema, state.get("optimizer"), state.get("optimizer_name"),
                  int(state.get("epoch", 0)), list(state.get("optimizer_parameters") or []))  # fmt: skip


def _unwrapped(state):
    """A weights file's state dict, out of a `state_dict`, `model` or `module` wrapper (timm's and others')."""
    while isinstance(state, dict):
        inner = next((state[k] for k in ("state_dict", "model", "module") if isinstance(state.get(k), dict)), None)
        if inner is None:
            break
        state = inner
    return state


def _weights(state, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a state dict by name, without the wrappers' prefixes; none is a UserError."""
    if not isinstance(state, dict):
        state = {}
    weights = {}
    for name, value in state.items():
        if isinstance(name, str) and isinstance(value, torch.Tensor):
            for prefix in PREFIXES:
                name = name.removeprefix(prefix)
            weights[name] = value
    if not weights:
        raise UserError(
            f"--init-from {str(path)!r} holds no tensors by name: give a checkpoint or a file saved with "
            "torch.save(model.state_dict())"
        )
    return weights


def _sharded(path: Path) -> Source:
    """A sharded checkpoint's whole tensors, read by this process alone (any world size wrote it)."""
    import torch.distributed.checkpoint as dcp

    state = sharded.read(path)
    targets = {
        holder["__sharded__"]: torch.empty(holder["shape"], dtype=getattr(torch, holder["dtype"]))
        for holder in sharded._placeholders(state)
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(targets, checkpoint_id=str(path), no_dist=True)
    except BaseException as error:  # CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserError(f"--init-from {str(path)!r} cannot be read whole: a file of it is missing or damaged") from None
    state = sharded._join(state, targets)
    return _ours(path, "sharded checkpoint", state)


def matched(model: nn.Module, weights: dict[str, torch.Tensor], exclude: str | None) -> tuple[dict, list[str]]:
    """The weights that fit the model (same name and shape, not excluded), and the start lines that say what did
    not: the model's tensors left as built (`re-initialised: fc.weight [10, 512] (checkpoint [1000, 512])`), and the
    file's tensors the model lacks. Nothing that fits is a UserError: the wrong file."""
    mine = model.state_dict()
    fits, left, excluded = {}, [], []
    for name, value in mine.items():
        theirs = weights.get(name)
        if exclude is not None and re.search(exclude, name):
            excluded.append(name)
        elif theirs is None:
            left.append(f"{name} (not in the checkpoint)")
        elif tuple(theirs.shape) != tuple(value.shape):
            left.append(f"{name} {list(value.shape)} (checkpoint {list(theirs.shape)})")
        else:
            fits[name] = theirs
    if not fits and excluded:
        raise UserError(
            f"--init-exclude {exclude!r} leaves out every tensor of the model that the file holds: narrow it"
        )
    if not fits:
        raise UserError(
            f"--init-from: none of the model's {len(mine)} tensors is in the file by name and shape (the file has "
            f"{', '.join(list(weights)[:3])}{' ...' if len(weights) > 3 else ''}; the model "
            f"{', '.join(list(mine)[:3])}{' ...' if len(mine) > 3 else ''}): give the checkpoint of this task's model"
        )
    lines = []
    if left:
        lines.append(f"re-initialised (as the model builds them): {_listed(left)}")
    if excluded:
        lines.append(f"left as built by --init-exclude: {_listed(excluded)}")
    unused = [name for name in weights if name not in mine]
    if unused:
        lines.append(f"in the checkpoint, not in the model (not used): {_listed(unused)}")
    return fits, lines


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@torch.no_grad()
def load_weights(model: nn.Module, fits: dict[str, torch.Tensor]) -> None:
    """The fitting weights into the model (a whole one: loaded before it is sharded or wrapped)."""
    model.load_state_dict(fits, strict=False)


def check_optimizer(source: Source) -> None:
    """--init-optimizer, before any process group: the source must hold an optimizer state (a sharded run's best.pt
    holds weights only: its last.dcp has the state)."""
    if source.optimizer is None:
        where = "; its run's last.dcp or last.pt has it" if source.kind == "checkpoint" else ""
        raise UserError(f"--init-optimizer: {str(source.path)!r} is a {source.kind} with no optimizer state{where}")


def load_optimizer(optimizer: torch.optim.Optimizer, source: Source, header: dict) -> list[str]:
    """--init-optimizer: the source's optimizer state into `optimizer` (this run's groups and LR kept), parameter by
    parameter NAME (`header`: this run's checkpoint header, with the optimizer's name and its parameters' names in
    its groups' order; the source's header has its own), only for the tensors start() loaded and where the state has
    the parameter's shape; the start lines say what was carried and what starts fresh. A source of another optimizer
    is a UserError; one that does not name its parameters (written before they were kept) is mapped by place only
    where its groups are as long as this run's."""
    check_optimizer(source)
    ours, names = header["optimizer_name"], header["optimizer_parameters"]
    if source.optimizer_name != ours:
        theirs = source.optimizer_name or "an optimizer this template did not write"
        raise UserError(
            f"--init-optimizer: {str(source.path)!r} was trained with {theirs}, this run builds {ours}: give the "
            "optimizer flags it was trained with, or drop --init-optimizer"
        )
    saved, state = source.optimizer, optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    order = [i for group in saved["param_groups"] for i in group["params"]]
    place = {name: i for i, name in enumerate(source.parameters)}
    if not source.parameters:
        if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
            raise UserError(
                f"--init-optimizer: {str(source.path)!r} does not name its parameters (written before they were kept) "
                "and its parameter groups differ from this run's: drop --init-optimizer, or start from a newer one"
            )
        place = {name: i for i, name in enumerate(names)}
    carried, fresh, slow = {}, [], _slow(saved)
    for i, (param, name) in enumerate(zip(params, names)):
        old = saved["state"].get(order[place[name]]) if name in source.loaded and name in place else None
        if old is not None and all(_fits(v, param) for v in old.values()):
            carried[i] = {k: _as_param(v, param) for k, v in old.items()}
            if slow is not None and "lookahead" in state:
                state["lookahead"]["slow"][i] = _as_param(slow[place[name]], param)
        else:
            fresh.append(name)
    state["state"] = carried
    optimizer.load_state_dict(state)
    line = f"optimizer state carried for {len(carried)} of {len(params)} parameter(s), by name"
    return [line + (f"; fresh (not loaded, no state, or another shape): {_listed(fresh)}" if fresh else "")]


def _slow(saved: dict) -> list | None:
    """Lookahead's slow weights in a saved state, by the source's parameter order (None: not a Lookahead's)."""
    ahead = saved.get("lookahead")
    return ahead.get("slow") if isinstance(ahead, dict) else None


def _fits(value, param: torch.Tensor) -> bool:
    return not isinstance(value, torch.Tensor) or value.ndim == 0 or tuple(value.shape) == tuple(param.shape)


def _as_param(value, param: torch.Tensor):
    """A whole state tensor laid out as `param` is: a sharded parameter's slice of it (a collective)."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0 or not is_dtensor(param) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(local(param).device), param.device_mesh, param.placements)


def start(model: nn.Module, source: Source, ema: bool = False, exclude: str | None = None) -> list[str]:
    """The source's weights (its EMA's with `ema`: --init-from-ema) into the whole model before it is wrapped,
    sharded or given an optimizer (so the EMA and Lookahead start from them); the start lines that say so."""
    weights = source.model
    if ema:
        if source.ema is None:
            raise UserError(f"--init-from-ema: {str(source.path)!r} holds no EMA weights (its run had no --model-ema)")
        weights = source.ema
    fits, lines = matched(model, weights, exclude)
    if exclude is not None and not any(line.startswith("left as built by --init-exclude") for line in lines):
        lines.append(f"--init-exclude {exclude!r} matched none of the model's tensors")
    load_weights(model, fits)
    source.loaded = set(fits)
    whose = "EMA weights" if ema else "weights"
    done = f" (its run had done {source.epochs} epoch(s))" if source.epochs else ""
    first = f"started from the {whose} of {source.kind} {str(source.path)!r}{done}: {len(fits)} of "
    return [first + f"{len(model.state_dict())} tensors loaded; a new run from global step 0", *lines]
