"""Checkpoints: atomic save (temporary file, fsync, os.replace) with the usual file permissions, safe load
(`weights_only=True`), resume."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from config import UserError


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
