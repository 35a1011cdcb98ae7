"""Runs counted in steps: --max-steps N ends the run at global step N, its LR schedule N steps long, and a run stopped
by SIGTERM and resumed ends where an uninterrupted one does, with the same weights and each step's row once.
"""

import math
import shutil

import pytest
import torch
from multiproc import launch, preempted, python_run
from resumed import assert_resumed, final_step, saved_state
from step_rows import rows_of, rows_through

MAX_STEPS = ["-b", "16", "--log-interval", "5", "--no-progress", "--max-steps", "30"]


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
    for r in rows:  # the LR step k applied: p = k / 30
        p = int(r["step"]) / 30
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
    preempted(cut, folder / "last.pt", ready=lambda: rows_through(folder, 20))
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


EVAL_EVERY = ["-e", "1", "-b", "16", "--log-interval", "5", "--no-progress", "--scheduler", "constant"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """2 ranks, one epoch of 45 steps, --eval-every-steps 15; and the same run stopped by --max-steps 15."""
    runs = tmp_path_factory.mktemp("evals")
    every = launch([*EVAL_EVERY, "--eval-every-steps", "15", "--runs-dir", str(runs), "-n", "every"], nproc=2)
    assert every.returncode == 0, every.stderr[-3000:]
    args = [a for a in EVAL_EVERY if a not in ("-e", "1")]
    first = launch([*args, "--max-steps", "15", "--runs-dir", str(runs), "-n", "first"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("step-evaluations")
def test_eval_every_steps_gives_a_validation_row_per_evaluation_as_a_run_ending_there_would(evaluated):
    """Steps 15 and 30 mid-epoch, 45 at its end: 3 rows; step 15's validation equals that of a run that ends at step
    15 (--max-steps 15: the same weights, evaluated at its epoch's end). Broken on purpose: StepEvaluations skipping
    its evaluation (`self.every and` as `False and`) fails it (one row)."""
    rows = rows_of(evaluated / "every" / "metrics.csv")
    assert [(int(r["epoch"]), int(r["step"])) for r in rows] == [(1, 15), (1, 30), (1, 45)]
    (ended,) = rows_of(evaluated / "first" / "metrics.csv")
    assert int(ended["step"]) == 15
    assert (rows[0]["val_loss"], rows[0]["val_acc"]) == (ended["val_loss"], ended["val_acc"])
    assert rows[-1]["train_loss"] != "nan" and rows[0]["train_loss"] == "nan"  # mid-epoch rows: validation only


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("step-evaluations")
def test_eval_every_steps_stopped_and_resumed_writes_the_same_rows_once(evaluated, tmp_path):
    """SIGTERM after step 15's evaluation, then --resume auto: metrics.csv holds the uninterrupted run's three rows,
    each once, with its values. Broken on purpose: a resume dropping every row of the epoch it continues
    (`run_folder.kept` without its mid-epoch case) fails it (step 15's row is gone)."""
    folder = tmp_path / "cut"
    args = [*EVAL_EVERY, "--eval-every-steps", "15", "--runs-dir", str(tmp_path), "-n", "cut"]
    preempted(args, folder / "last.pt", ready=lambda: rows_through(folder, 20))
    shutil.copy(folder / "last.pt", tmp_path / "saved.pt")
    resumed = launch([*args, "--resume", "auto"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, tmp_path / "saved.pt", 45)
    assert 15 < saved_state(tmp_path / "saved.pt")["global_step"] < 45  # stopped mid-epoch, after step 15
    assert _values(rows_of(folder / "metrics.csv")) == _values(rows_of(evaluated / "every" / "metrics.csv"))


def _values(rows: list[dict]) -> list[dict]:
    """The rows' deterministic columns (not their timings)."""
    kept = ("epoch", "step", "lr")
    return [{k: v for k, v in r.items() if k in kept or k.startswith(("train_", "val_"))} for r in rows]


@pytest.mark.timeout(120)
def test_eval_every_steps_below_zero_is_one_line(tmp_path):
    result = python_run(["--eval-every-steps", "-1", "--runs-dir", str(tmp_path)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--eval-every-steps must be >= 0" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_best_and_early_stopping_follow_each_evaluation(tmp_path):
    """One process, 90 steps an epoch, an evaluation every 5 steps; no evaluation after the first can improve by
    --early-stop-delta 100, so patience 2 stops the run at the third, step 15, mid-epoch: its checkpoint written
    there, best.pt the evaluation with the lowest validation loss (best.pt follows the best value, early stopping its
    delta). Broken on purpose: StepEvaluations not reporting the stop (`or t.stopped_early` dropped) fails it."""
    args = ["-b", "16", "-e", "1", "--no-progress", "--eval-every-steps", "5", "--early-stop-patience", "2"]
    result = python_run([*args, "--early-stop-delta", "100", "--runs-dir", str(tmp_path), "-n", "stop"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "stop" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [5, 10, 15]
    assert "step 15: " in result.stdout and "(early stop)" in result.stdout
    assert saved_state(tmp_path / "stop" / "last.pt")["global_step"] == 15
    best = saved_state(tmp_path / "stop" / "best.pt")  # the lowest validation loss of the three evaluations
    lowest = min(rows, key=lambda r: float(r["val_loss"]))
    assert best["global_step"] == int(lowest["step"]) and best["best"]["value"] == float(lowest["val_loss"])


@pytest.mark.timeout(60)
def test_an_evaluation_mid_epoch_drives_the_plateau_and_leaves_the_epoch_open():
    """Training.after_evaluation (what each --eval-every-steps evaluation calls): ReduceLROnPlateau with patience 0
    halves the LR at the first evaluation that does not improve, and the epoch stays where it is (end_epoch alone
    completes it). Broken on purpose: after_evaluation not stepping the schedule fails it."""
    import tiny

    from ddp_tricks.schedules import schedule
    from ddp_tricks.training.state import Best

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    plateau = schedule.build(optimizer, total_steps=100, warmup_steps=0, kind="plateau", plateau_factor=0.5,
                             plateau_patience=0)  # fmt: skip
    t = tiny.training(model, optimizer, plateau, best=Best("val_loss", "min"))
    t.progress.epoch, t.progress.step_in_epoch = 1, 15
    assert t.after_evaluation({"val_loss": 1.0}) and t.lr == 0.4
    assert not t.after_evaluation({"val_loss": 1.0}) and t.lr == 0.2  # no improvement: cut at once
    assert (t.progress.completed_epochs, t.progress.step_in_epoch) == (0, 15)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_lr_column_is_the_lr_each_step_applied(tmp_path):
    """steps.csv's `lr` at step k is the LR step k trained with: in warmup base x k / W (the schedule's value before
    the step, not after it), and in a traced run with --batch-lr-rule linear the schedule's times the step's
    batch / the first batch (the rows showed the schedule's alone). Broken on purpose (the row reading the
    optimizer's LR after the scheduler's step): every warmup row is one step ahead."""
    import csv

    from multiproc import python_run

    base = ["--runs-dir", str(tmp_path), "--no-progress", "--log-interval", "1", "-e", "1"]
    result = python_run([*base, "-n", "warm", "--warmup-epochs", "1"], timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "warm" / "steps.csv")))
    warmup = 45  # 1438 / 32 steps: one epoch
    for row in rows:
        assert float(row["lr"]) == pytest.approx(0.05 * int(row["step"]) / warmup, rel=1e-9), row["step"]
    traced = ["--batch-trace", "examples/traces/doubling.csv", "-b", "16", "--batch-lr-rule", "linear"]
    result = python_run([*base, "-n", "traced", *traced, "--warmup-epochs", "0", "-e", "3"], timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "traced" / "steps.csv")))
    batches = [float(b["samples"]) - float(a["samples"]) for a, b in zip([{"samples": 0}, *rows], rows)]
    lrs = [float(row["lr"]) for row in rows]
    assert len(set(batches)) > 1  # the trace's batches differ, and so do their LRs
    assert lrs[0] == 0.05  # the schedule's at the trace's first batch, the run's reference
    for batch, lr in zip(batches, lrs):
        assert lr == pytest.approx(0.05 * batch / batches[0], rel=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_non_finite_loss_stops_the_run_before_a_step_evaluation_of_its_weights(tmp_path):
    """An LR that sends the loss to NaN, a row and an evaluation at every step: every rank stops with the non-finite
    loss (exit 3) at the step whose row finds it, before that step's evaluation, so metrics.csv has no row of that
    step (a row's check is read a step after the row; an evaluation first reads the row under way). Broken on
    purpose: StepEvaluations without its rows.settle() evaluates first and writes the found step's row."""
    args = ["--base-lr", "1e6", "-e", "1", "--eval-every-steps", "1", "--log-interval", "1", "--no-progress",
            "-n", "nan", "--runs-dir", str(tmp_path)]  # fmt: skip
    result = launch(args, nproc=2, stop_others=False)
    assert result.exitcodes == [3, 3], result.stderr[-3000:]
    line = next(line for line in result.stderr.splitlines() if line.startswith("error: non-finite loss or weights"))
    bad_step = int(line.split("step ")[1].split(",")[0])
    rows = rows_of(tmp_path / "nan" / "metrics.csv") if (tmp_path / "nan" / "metrics.csv").exists() else []
    assert rows and all(int(r["step"]) < bad_step for r in rows), (bad_step, [r["step"] for r in rows])
