"""Checkpoints: what one holds (`capture` and `restore` of a training state: weights, optimizer, schedule,
scaler, early stopping, AdaScale, counters, every rank's RNG and mid-epoch sums), atomic save (temporary file,
fsync, os.replace, the usual file permissions), safe load (`weights_only=True`), and which file `--resume` means.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from config import UserError
from distributed import gather_from_ranks, gather_objects


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write `state` to `path` atomically: a crash mid-write leaves the previous file intact. The file gets
    the permissions the umask gives any new file (mkstemp's own are 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0o022)  # reading the umask means setting it: put it back at once
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint without running any code from it; a bad file is a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"checkpoint {str(path)!r} does not exist: give the path of a last.pt/best.pt, or --resume auto"
        )
    not_ours = f"checkpoint {str(path)!r} is not a checkpoint written by this project"
    fix = "pick another file or start without --resume"
    try:
        with warnings.catch_warnings():  # torch warns about what it then refuses: the one line below says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # empty, truncated, random bytes, pickled code or classes: torch's text is no help here
        raise UserError(f"{not_ours} (or is corrupt); {fix}") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UserError(f"{not_ours} (it has no model/epoch entries); {fix}")
    return state


def resume_path(resume: str | None, run_dir: str | Path) -> Path | None:
    """`--resume auto` means run_dir/last.pt when it exists; a PATH is taken as given."""
    if resume is None:
        return None
    if resume == "auto":
        last = Path(run_dir) / "last.pt"
        return last if last.is_file() else None
    return Path(resume)


def capture(t, *, next_epoch: int, step_in_epoch: int, sums: torch.Tensor | None, early_stopping, best: dict,
            rank: int, world_size: int, config: dict) -> dict[str, Any] | None:  # fmt: skip
    """A training state, gathered from every rank (RNG states; mid-epoch, running sums); None except on rank 0.

    `t` is an engine.Training. Tensors and plain containers only, so `weights_only=True` can read it back.
    """
    rng = gather_objects(rng_state())
    all_sums = gather_from_ranks(sums.to(t.device)).cpu() if sums is not None else None
    if rank != 0:
        return None
    adascale = t.adascale
    return {
        "model": t.raw_model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "optimizer_name": describe_optimizer(t.optimizer),
        "schedule": t.schedule.state_dict(),
        "scaler": t.precision.state_dict(),
        "early_stopping": early_stopping.state_dict() if early_stopping is not None else None,
        "adascale": adascale.state_dict() if adascale is not None else None,
        "epoch": next_epoch - 1,  # epochs completed
        "step_in_epoch": step_in_epoch,  # optimizer steps already taken in epoch `epoch + 1`
        "epoch_sums": all_sums,  # each rank's running [loss, *metric sums, samples] of that epoch, mid-epoch only
        "global_step": t.global_step,
        "skipped_steps": t.skipped_steps,
        "best": dict(best),
        "rng": rng,
        "world_size": world_size,
        "config": {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool, type(None)))},
        "torch_version": str(torch.__version__),
    }


def restore_model(model: torch.nn.Module, state: dict, source: str) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError:
        saved = state.get("config", {}).get("model", "another model")
        raise UserError(
            f"checkpoint {source!r} holds weights of {saved!r} that do not fit this task's model; "
            "resume with the flags it was trained with"
        ) from None


def restore(state: dict, t, early_stopping, rank: int, world_size: int, source: str, best: dict) -> tuple:
    """Put the optimizer, schedule, scaler, AdaScale and counters back. Returns where to continue: the epoch,
    the steps already taken in it, this rank's running sums of it, and the best monitored value so far (`best`,
    this run's fresh one, where the checkpoint followed another metric or predates the monitored-metric format).
    Mid-epoch, the caller puts `state["rng"][rank]` back once the epoch's own seeding is done."""
    saved, ours = state.get("optimizer_name"), describe_optimizer(t.optimizer)
    if saved != ours:
        raise UserError(
            f"checkpoint {source!r} was trained with {saved}, these flags build {ours}; "
            "resume with the optimizer flags it was trained with"
        )
    try:
        t.optimizer.load_state_dict(state["optimizer"])
        t.schedule.load_state_dict(state["schedule"])
    except (ValueError, KeyError, RuntimeError) as error:
        raise UserError(
            f"checkpoint {source!r} holds an optimizer state that does not fit these flags "
            f"({str(error).splitlines()[0][:80]}); resume with the flags it was trained with"
        ) from None
    t.precision.load_state_dict(state.get("scaler"))
    same_metric = state.get("best", {}).get("metric") == best["metric"]
    if early_stopping is not None and state.get("early_stopping") and same_metric:
        early_stopping.load_state_dict(state["early_stopping"])
    if t.adascale is not None and state.get("adascale"):
        t.adascale.load_state_dict(state["adascale"])
    t.global_step = state["global_step"]
    t.skipped_steps = state.get("skipped_steps", 0)
    step_in_epoch = state.get("step_in_epoch", 0)
    if step_in_epoch and state.get("world_size") != world_size:
        raise UserError(
            f"checkpoint {source!r} was written mid-epoch by {state.get('world_size')} processes; "
            f"resume it with that many (this run has {world_size})"
        )
    sums = state["epoch_sums"][rank] if step_in_epoch else None
    return state["epoch"] + 1, step_in_epoch, sums, state["best"] if same_metric else best


def rng_state() -> dict:
    """This process's random generators, as tensors and plain values (safe for weights_only loading)."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`Lookahead(LARSWrapper(SGD))`: the optimizer and the wrappers around it."""
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ + (f"({describe_optimizer(inner)})" if inner is not None else "")
