"""Checkpoints: atomic save (temporary file, fsync, os.replace), safe load (`weights_only=True`), resume."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from config import UserError


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write `state` to `path` atomically: a crash mid-write leaves the previous file intact."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, random bytes, pickled code: all unreadable here
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise UserError(
            f"checkpoint {str(path)!r} is unreadable ({reason}); pick another file or start without --resume"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UserError(f"checkpoint {str(path)!r} was not written by run.py (no model/epoch entries)")
    return state


def resume_path(resume: str | None, run_dir: str | Path) -> Path | None:
    """`--resume auto` means run_dir/last.pt when it exists; a PATH is taken as given."""
    if resume is None:
        return None
    if resume == "auto":
        last = Path(run_dir) / "last.pt"
        return last if last.is_file() else None
    return Path(resume)
