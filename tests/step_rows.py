"""A run's steps.csv and metrics.csv as the tests read them (test_step_log.py, test_step_runs.py, test_detection.py,
test_group_of_one.py)."""

from __future__ import annotations

import csv
from pathlib import Path


def rows_of(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rows_through(folder: Path, step: int) -> bool:
    """Whether the run folder's steps.csv has a row at `step` or later (a cue to stop the run there)."""
    try:
        rows = rows_of(folder / "steps.csv")
    except (FileNotFoundError, ValueError):
        return False
    return bool(rows) and int(rows[-1]["step"]) >= step
