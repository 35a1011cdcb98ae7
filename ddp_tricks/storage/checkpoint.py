"""Checkpoints: when they are written (`Checkpoints`: after every epoch, every K steps, on an agreed SIGTERM), atomic
save (temporary file, fsync, os.replace, the usual file permissions), safe load (`weights_only=True`), and which
file `--resume` means. What one holds is the training state's `state_dict()` (training/state.py).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ddp_tricks.errors import UserError


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


def restore_model(model: torch.nn.Module, state: dict, source: str) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError:
        saved = state.get("config", {}).get("model", "another model")
        raise UserError(
            f"checkpoint {source!r} holds weights of {saved!r} that do not fit this task's model; "
            "resume with the flags it was trained with"
        ) from None


class Checkpoints:
    """Where and when a run writes `last.pt` (and `best.pt`): after every epoch, every `every_steps` optimizer
    steps mid-epoch, and when every rank has agreed to stop after SIGTERM. Every rank calls; rank 0 writes."""

    def __init__(self, folder: Path, is_main: bool, every_steps: int, preemption, config: dict):
        self.folder = Path(folder)
        self.is_main = is_main
        self.every_steps = every_steps
        self.preemption = preemption
        self.config = {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool, type(None)))}

    def save(self, t, also_best: bool = False) -> None:
        """The training state `t` into last.pt (atomically), and best.pt too; never non-finite weights over the
        last good ones."""
        t.raise_if_nonfinite(check_weights=True)
        state = t.state_dict() | {"config": self.config, "torch_version": str(torch.__version__)}
        if self.is_main:
            save(state, self.folder / "last.pt")
            if also_best:
                save(state, self.folder / "best.pt")

    def after_step(self, t) -> bool:
        """After every optimizer step: the mid-epoch checkpoint when due, and the stop every rank agrees on after
        SIGTERM (True: stop now, last.pt written)."""
        stop = self.preemption.agreed()
        if stop or (self.every_steps and t.global_step % self.every_steps == 0):
            self.save(t)
        return stop
