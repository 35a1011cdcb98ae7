"""Files a run writes whole or not at all: atomic saves (temporary file, fsync, os.replace, the usual file
permissions) and reads that never run code from the file (`weights_only=True`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write `state` (torch.save) to `path` atomically: a crash mid-write leaves the previous file intact."""
    _write_atomically(path, "wb", lambda f: torch.save(state, f))


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically, as save does: a reader sees the old file or the new one, whole."""
    _write_atomically(path, "w", lambda f: f.write(text))


def _write_atomically(path: str | Path, mode: str, write: Callable[[IO], Any]) -> None:
    """A temporary file beside `path`, written, flushed and fsynced, then renamed over it (and the folder
    fsynced). The file gets the permissions the umask gives any new file (mkstemp's own are 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0o022)  # reading the umask means setting it: put it back at once
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": ""})) as f:
            write(f)
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
