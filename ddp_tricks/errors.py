"""User errors: what a user asked for that cannot be done, said as one line on stderr with exit code 2.

A task file raises `UserError` too (`from ddp_tricks import UserError`); a bug keeps its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path


class UserError(Exception):
    """A mistake in what the user asked for: run.py prints it as one line and exits with code 2.

    `rank_specific`: only this process is affected (say, its GPU), so it prints even when it is not rank 0.
    """

    def __init__(self, message: str, rank_specific: bool = False):
        super().__init__(message)
        self.rank_specific = rank_specific


def report(message: str, log_file: Path | None = None) -> None:
    """One line on stderr (and in the run's train.log when there is one)."""
    print(f"error: {message}", file=sys.stderr)
    if log_file is not None and log_file.exists():
        with open(log_file, "a") as f:
            f.write(f"error: {message}\n")
