"""Files a run writes whole or not at all: atomic saves (temporary file, fsync, os.replace, the usual file
permissions) and reads that never run code from the file (`weights_only=True`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


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
