"""fp16 on a rank that runs no micro-batch in a step (the plan's uneven shares, a traced step smaller than the world):
its GradScaler, which never scaled a loss, still steps with the scale every other rank has, and the loss scale the
noise scale divides by is that real scale, not 1. A one-process fp16 run at the global batch 16 resumed mid-epoch on
2 and on 3 processes (shares 1,0 and 1,0,0) ends where the uninterrupted run ends; a traced fp16 run whose steps leave
ranks idle measures on 3 and 4 processes the noise scale one process measures from the same micro-batches."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch
from multiproc import launch
from resumed import assert_resumed, final_step

from ddp_tricks.storage import checkpoint

TIMING = {"epoch_seconds", "samples_per_second"}


def rows(run_dir) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [
            {k: v for k, v in r.items() if k not in TIMING | {"world_size", "accum_steps"}} for r in csv.DictReader(f)
        ]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


# 90 steps an epoch of 16 (1437 samples: the last 13); SIGTERM after rank 0's 30th micro-batch: mid-epoch 1
RESUME_FLAGS = ["--task", "tests/rank_tasks.py:PreemptedTinyMLP", "-b", "16", "--amp", "fp16", "-e", "2",
                "--no-progress", "--log-interval", "5"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_at_global_batch_16_from_one_process_resumed_on_2_and_3_ends_as_the_uninterrupted_run(
    tmp_path, monkeypatch
):
    """The resumed ranks hold the step's one micro-batch on rank 0 (1,0 and 1,0,0): the others scale no loss, and
    their steps use the scaler's scale, made from the checkpoint's. The metrics of both epochs follow the
    uninterrupted one-process run, and every parameter (the summed gradient is rank 0's plus zeros: float order
    alone). Broken on purpose: Precision._scale_ready doing nothing (the scale made only by a scaled loss), the idle
    rank's first step finds no scale (in loss_scale(); past it, scaler.step()'s "_scale is None") and the resumed job
    ends with exit 1."""
    flags = [*RESUME_FLAGS, "--runs-dir", str(tmp_path)]
    whole = launch([*flags, "-n", "whole"], nproc=1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    monkeypatch.setenv("PREEMPT_AFTER", "30")
    stopped = launch([*flags, "-n", "on2"], nproc=1)
    monkeypatch.delenv("PREEMPT_AFTER")
    assert stopped.returncode == 143 and "preempted at epoch" in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    saved = checkpoint.load(tmp_path / "on2" / "last.pt")
    assert saved["epoch"] == 0 and saved["step_in_epoch"] > 0 and saved["scaler"]["scale"] > 0
    shutil.copytree(tmp_path / "on2", tmp_path / "on3")
    expected = checkpoint.load(tmp_path / "whole" / "last.pt")["model"]
    for world_size, shares in ((2, "1,0"), (3, "1,0,0")):
        name = f"on{world_size}"
        end = launch([*flags, "-n", name, "--resume", "auto"], nproc=world_size)
        assert end.returncode == 0, end.stderr[-3000:]
        assert f"global batch 16 as 1 micro-batches of 16 on {world_size} processes: {shares}" in end.stdout
        assert_resumed(end.stdout, saved, final_step(tmp_path / "whole"))
        a, b = rows(tmp_path / "whole"), rows(tmp_path / name)
        assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) == 2
        for x, y in zip(a, b):
            for column in x:
                if column.startswith(("train_", "val_")) or column == "skipped_steps":
                    assert float(y[column]) == pytest.approx(float(x[column]), rel=1e-5, abs=1e-7), (column, x["epoch"])
        got = checkpoint.load(tmp_path / name / "last.pt")
        assert got["scaler"]["scale"] == checkpoint.load(tmp_path / "whole" / "last.pt")["scaler"]["scale"]
        worst = max(relative_difference(got["model"][k], expected[k]) for k in expected)
        assert worst < 1e-5, (world_size, worst)


# At a learning rate of 1e-9 the weights stay where they start: each step's micro-batches of 16 are the same samples
# on any world size. The trace's steps of 32, 48 and 16 leave ranks idle from the first step on: 1,1,0 / 1,1,1 /
# 1,0,0 on 3 processes, 1,1,0,0 / 1,1,1,0 / 1,0,0,0 on 4. (On 2 a rank is idle only in a step of one micro-batch,
# which measures nothing: a noise scale needs two batch sizes.) GradScaler makes its scale at the first loss it
# scales, so the idle rank's first measured step is the one in question: the trace starts with one.
NOISE_FLAGS = ["--task", "tests/noise_tasks.py:PerceptronDigits", "-b", "16", "-l", "1e-9", "--momentum", "0",
               "--wd", "0", "--warmup-epochs", "0", "-e", "2", "--no-progress", "-s", "0", "--amp", "fp16"]  # fmt: skip
NOISE_COLUMNS = ("noise_scale", "grad_noise_trace", "grad_sq_norm")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The noise columns of the traced fp16 run on 1, 3 and 4 processes."""
    root = tmp_path_factory.mktemp("fp16-idle")
    trace = root / "trace.csv"
    trace.write_text("batchsize\n" + "32\n48\n16\n" * 70)
    measured = {}
    for world_size in (1, 3, 4):
        name = f"on{world_size}"
        run = launch([*NOISE_FLAGS, "--batch-trace", str(trace), "-n", name, "--runs-dir", str(root)],
                     nproc=None if world_size == 1 else world_size)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert "measured from each micro-batch's gradient (16 samples)" in run.stdout, run.stdout[-3000:]
        with open(root / name / "metrics.csv", newline="") as f:
            measured[world_size] = [{k: float(r[k]) for k in NOISE_COLUMNS} for r in csv.DictReader(f)]
    return measured


@pytest.mark.xdist_group("fp16-idle-ranks")
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [3, 4])
def test_an_idle_rank_s_noise_scale_sums_divide_by_the_real_loss_scale(traced, world_size):
    """The noise scale's squared norms are of the scaled loss's gradients, divided by the loss scale squared on
    every rank; each rank's moving averages enter the epoch's row (their mean over the ranks), so an idle rank that
    divided by 1 would put its averages 65536^2 times too large into it. Independent reference: one process, the
    same traced steps' micro-batches one after another (no idle rank). Broken on purpose: loss_scale() reading 1
    on a rank whose scaler has made no scale yet (its scale still made before the step), both world sizes fail
    (noise_scale 112.6 for the one process's 48.2)."""
    one, many = traced[1], traced[world_size]
    assert len(one) == len(many) == 2
    for a, b in zip(one, many):
        assert all(a[column] > 0 for column in NOISE_COLUMNS)
        for column in NOISE_COLUMNS:
            assert b[column] == pytest.approx(a[column], rel=1e-6), column
