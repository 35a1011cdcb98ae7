"""--batch-trace auto: the global batch grows at each epoch's start towards the measured gradient noise scale. Its
rule against the rule written out; the plan it makes; a real 2-rank run whose batch grows, its written trace replayed
with --batch-trace FILE bit-identically, and the run stopped by SIGTERM mid-epoch and resumed, bit-identically."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from multiproc import launch
from resumed import assert_resumed

from ddp_tricks import plan as planning
from ddp_tricks.storage import checkpoint
from ddp_tricks.traces.batch_trace import load_trace, next_batch

AUTO = ["--task", "tests/rank_tasks.py:PreemptedDigits", "-b", "8", "--batch-lr-rule", "linear", "-e", "4",
        "--no-progress", "-s", "0", "--batch-trace", "auto", "--max-global-batch", "64"]  # fmt: skip
COLUMNS = ("step", "train_loss", "val_loss", "val_acc", "noise_scale", "grad_sq_norm", "global_batch")


@pytest.mark.parametrize(
    "noise_scale, batch, unit, ceiling",
    [(math.nan, 32, 16, 512), (20.0, 32, 16, 512), (47.9, 32, 16, 512), (50.0, 32, 16, 512),
     (1000.0, 32, 16, 512), (1000.0, 384, 16, 512), (1000.0, 384, 16, 500), (70.0, 48, 24, 512)],
)  # fmt: skip
def test_the_batch_grows_to_the_noise_scale_at_most_twofold_never_shrinking(noise_scale, batch, unit, ceiling):
    if not noise_scale > batch:  # nothing measured yet, or a batch already as large as the noise scale
        expected = batch
    else:  # the noise scale, at most twice the batch and the ceiling, rounded down to the unit; never below
        expected = max(batch, unit * math.floor(min(noise_scale, 2 * batch, ceiling) / unit))
    assert next_batch(noise_scale, batch, unit, ceiling) == expected
    assert expected % unit == 0 or expected == batch


def test_a_grown_plan_keeps_the_steps_taken_and_goes_on_with_the_new_batch():
    start = planning.make(num_train=1000, world_size=2, micro_batch=16, accum_steps=1, epochs=3, seed=0,
                          base_lr=0.1, lr_scaling="keep", base_batch=32, warmup_epochs=0, trace=[32],
                          batch_lr_rule="linear", trace_end="repeat-last", max_global_batch=512)  # fmt: skip
    assert start.auto and start.total_steps == 3 * (1000 // 32)  # the schedule: in steps of the start batch
    first = start.grown(math.nan, 0)
    assert first.trace == (32,) and len(first.epoch(1, 0)) == 1000 // 32
    second = first.grown(100.0, 31)  # after an epoch of 31 steps of 32: the noise scale asks for 100, 64 it gets
    assert second.trace == (32,) * 31 + (64,) and second.rows(33) == [32] * 31 + [64, 64]
    steps = second.epoch(2, 0, first_trace_step=31)
    assert len(steps) == 1000 // 64 and all(s.batch == 64 for s in steps)
    assert all(len(s.micro_batches) == 2 and s.lr_factor == 2.0 and s.progress == 2.0 for s in steps)
    assert second.summary()["trace"] == list(second.trace)  # a checkpoint keeps it: a resume goes on from it


def test_auto_needs_two_micro_batches_a_step_and_no_adascale(tmp_path):
    common = ["--batch-trace", "auto", "-e", "1", "--no-progress", "--runs-dir", str(tmp_path)]
    cases = [
        ([], "start with --accum-steps 2 (or 2+ processes)"),
        (["--accum-steps", "2", "--batch-lr-rule", "adascale"], "--batch-trace auto takes --batch-lr-rule linear"),
        (["--accum-steps", "2", "--no-noise-scale"], "drop --no-noise-scale"),
        (["--accum-steps", "2", "--max-global-batch", "48"], "--max-global-batch 48 is below the start batch 64"),
    ]
    for flags, said in cases:
        result = launch([*common, *flags], nproc=None)
        assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = launch(["--max-global-batch", "64", "-e", "1", "--runs-dir", str(tmp_path)], nproc=None)
    assert result.returncode == 2 and "--batch-trace auto" in result.stderr, result.stderr[-2000:]


def metrics(run_dir) -> list[tuple]:
    with open(run_dir / "metrics.csv") as f:
        return [tuple(r[c] for c in COLUMNS) for r in csv.DictReader(f)]


def same_state(a, b) -> None:
    """Model, optimizer and noise-scale state bit-identical."""
    for part in ("model",):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), key
    assert torch.equal(a["noise"], b["noise"])
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for key in x:
            assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), key


@pytest.mark.slow
@pytest.mark.xdist_group("auto-batch")
@pytest.mark.timeout(600)
def test_an_auto_run_grows_its_batch_and_its_trace_replays_and_resumes_bit_identically(tmp_path, monkeypatch):
    whole = launch([*AUTO, "-n", "whole", "--runs-dir", str(tmp_path)])
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "global batch 16 growing with the gradient noise scale up to 64" in whole.stdout
    trace = load_trace(tmp_path / "whole" / "batch_trace.csv")
    rows = metrics(tmp_path / "whole")
    assert len(trace) == int(rows[-1][0])  # one row per optimizer step taken
    assert trace == sorted(trace) and trace[0] == 16 and len(set(trace)) >= 2, sorted(set(trace))
    assert all(b % 16 == 0 and b <= 64 for b in trace)  # whole micro-batches on both ranks, at most the ceiling
    assert "--batch-trace auto: global batch 16 -> " in whole.stdout

    # the trace replayed, as a user would: the same flags with --batch-trace FILE
    replay_flags = [*AUTO[:-4], "--batch-trace", str(tmp_path / "whole" / "batch_trace.csv")]
    replay = launch([*replay_flags, "-n", "replay", "--runs-dir", str(tmp_path)])
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert metrics(tmp_path / "replay") == rows
    last = checkpoint.load(tmp_path / "whole" / "last.pt", "ddp")
    same_state(checkpoint.load(tmp_path / "replay" / "last.pt", "ddp"), last)

    # SIGTERM in the third epoch (after the batch has grown), then --resume auto
    monkeypatch.setenv("PREEMPT_AFTER", str(89 + 40 + 10))  # rank 0's micro-batches: epoch 1 has 89 of them
    stopped = launch([*AUTO, "-n", "stopped", "--runs-dir", str(tmp_path)])
    monkeypatch.delenv("PREEMPT_AFTER")
    log = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143 and "preempted at epoch" in log, log[-3000:]
    at_stop = checkpoint.load(tmp_path / "stopped" / "last.pt", "ddp")
    assert at_stop["step_in_epoch"] > 0 and len(set(at_stop["plan"]["trace"])) >= 2  # mid-epoch, the batch grown
    resumed = launch([*AUTO, "-n", "stopped", "--resume", "auto", "--runs-dir", str(tmp_path)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, at_stop, last["global_step"])
    assert metrics(tmp_path / "stopped") == rows
    assert load_trace(tmp_path / "stopped" / "batch_trace.csv") == trace
    same_state(checkpoint.load(tmp_path / "stopped" / "last.pt", "ddp"), last)
