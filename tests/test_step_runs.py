"""Runs counted in steps: --max-steps N ends the run at global step N, its LR schedule N steps long, and a run stopped
by SIGTERM and resumed ends where an uninterrupted one does, with the same weights and each step's row once.
"""

import csv
import math
import shutil

import pytest
import torch
from multiproc import launch, preempted, python_run
from resumed import assert_resumed, final_step, saved_state

MAX_STEPS = ["-b", "16", "--log-interval", "5", "--no-progress", "--max-steps", "30"]


def rows_of(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_max_steps_ends_at_its_step_with_the_schedule_that_long(tmp_path):
    """One process, 90 steps an epoch: the run ends after 30, in its first epoch, and its cosine LR reaches --end-lr
    at step 30 (the formula in curves.py, written here). Broken on purpose: the schedule's length left at the
    epochs' (`total_steps = epochs * steps_per_epoch` in plan.make) fails it."""
    result = python_run([*MAX_STEPS, "--scheduler", "cosine", "--runs-dir", str(tmp_path), "-n", "m"])
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "m"
    assert final_step(folder) == 30
    epochs = rows_of(folder / "metrics.csv")
    assert [(int(r["epoch"]), int(r["step"])) for r in epochs] == [(1, 30)]
    rows = rows_of(folder / "steps.csv")
    assert [int(r["step"]) for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    for r in rows:  # the LR the next step uses: p = min(k + 1, 30) / 30 after k steps
        p = min(int(r["step"]) + 1, 30) / 30
        assert math.isclose(float(r["lr"]), 0.05 * (1 + math.cos(math.pi * p)) / 2, abs_tol=1e-12), r


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_max_steps_stopped_and_resumed_ends_as_one_run(tmp_path):
    """2 ranks, 45 steps an epoch, --max-steps 50 (into the second epoch): SIGTERM after step 20's row and --resume
    auto end at step 50 with the uninterrupted run's weights, and steps.csv holds each row once. Broken on purpose:
    plan.epoch not cutting the last epoch (`if self.max_steps:` as `if False:`) fails it (the run trains 90 steps)."""
    args = ["-b", "16", "--log-interval", "5", "--no-progress", "--max-steps", "50"]
    whole = launch([*args, "--runs-dir", str(tmp_path), "-n", "whole"], nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    folder = tmp_path / "cut"
    cut = [*args, "--runs-dir", str(tmp_path), "-n", "cut"]
    preempted(cut, folder / "last.pt", ready=lambda: _rows_through(folder, 20))
    shutil.copy(folder / "last.pt", tmp_path / "saved.pt")
    resumed = launch([*cut, "--resume", "auto"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, tmp_path / "saved.pt", 50)
    a, b = saved_state(tmp_path / "whole" / "last.pt"), saved_state(folder / "last.pt")
    assert a["global_step"] == b["global_step"] == 50
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    steps = [int(r["step"]) for r in rows_of(folder / "steps.csv")]
    assert steps == [int(r["step"]) for r in rows_of(tmp_path / "whole" / "steps.csv")]
    assert steps == [1, *range(5, 51, 5)]


def _rows_through(folder, step: int) -> bool:
    try:
        rows = rows_of(folder / "steps.csv")
    except (FileNotFoundError, ValueError):
        return False
    return bool(rows) and int(rows[-1]["step"]) >= step


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags, says",
    [
        (["--max-steps", "30", "-e", "3"], "--max-steps sets the run's length in place of --epochs: give one of them"),
        (["--max-steps", "-2"], "--max-steps must be >= 0"),
        (
            ["--max-steps", "30", "--batch-trace", "examples/traces/doubling.csv"],
            "--max-steps counts steps of one batch size",
        ),
    ],
)
def test_a_max_steps_mistake_is_one_line(flags, says, tmp_path):
    result = python_run([*flags, "--runs-dir", str(tmp_path)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
