"""Any world size keeps the run's global batch: a step's micro-batches are the run's (its global batch and its
micro-batch), and a world size that does not divide them spreads them unevenly over the ranks (2, 1, 1 on 3; some
ranks none on 7), the ranks' gradients summed by hand with each micro-batch weighted by its samples (or the task's
units). A run of 64 from 2 ranks resumed mid-epoch on 3 and on 7 ends where the uninterrupted run ends, with and without
BatchNorm, and with a loss over tokens."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch
from multiproc import launch
from resumed import assert_resumed, final_step

from ddp_tricks import plan as planning
from ddp_tricks.errors import UserError
from ddp_tricks.storage import checkpoint

N_TRAIN = 150  # 2 steps of 64 and a short one of 22 (4 slots of 16: 6, 6, 5, 5 samples)


def resumed_plan(world_size: int, equal_shares: str = "") -> planning.Plan:
    """The plan of a run started as 16 x 2 processes x accumulation 2 (64), resumed on `world_size` processes with
    that command's flags."""
    return planning.make(num_train=N_TRAIN, world_size=world_size, micro_batch=16, accum_steps=2, epochs=1, seed=5,
                         base_lr=0.1, lr_scaling="keep", base_batch=64, warmup_epochs=0, run_batch=(64, 16),
                         equal_shares=equal_shares)  # fmt: skip


def steps_over_ranks(plan: planning.Plan, epoch: int = 2) -> list[list]:
    """Each step of the epoch as its micro-batches over every rank: (the micro-batch's samples, its weight: what its
    mean loss is multiplied by, samples / divisor)."""
    ranks = [plan.epoch(epoch, rank) for rank in range(plan.world_size)]
    assert len({len(steps) for steps in ranks}) == 1  # every rank takes every step, an idle one too
    return [
        sorted((tuple(m), len(m) / r[s].divisor) for r in ranks for m in r[s].micro_batches)
        for s in range(len(ranks[0]))
    ]


@pytest.mark.parametrize("world_size, shares", [(3, [2, 1, 1]), (7, [1, 1, 1, 1, 0, 0, 0])])
def test_an_uneven_world_size_runs_the_run_s_micro_batches_each_weighted_by_its_samples(world_size, shares):
    """Broken on purpose: the divisor of DDP's average (the step's samples / world size) kept under the manual sum
    (each weight 3x or 7x too large: both fail); rank 0's two micro-batches of a step re-cut (their samples dealt
    alternately: the 3-rank case fails, the 7-rank one, with no rank holding two, passes)."""
    whole = resumed_plan(2)  # the run as it started: DDP averages the 2 ranks, each weighs samples / (B / 2)
    uneven = resumed_plan(world_size)
    assert (uneven.micro_batch, uneven.global_batch, uneven.shares()) == (16, 64, shares)
    assert uneven.uneven_shares and uneven.manual_reduction and not whole.manual_reduction
    assert uneven.steps_per_epoch == whole.steps_per_epoch == 3
    a, b = steps_over_ranks(whole), steps_over_ranks(uneven)
    # the same samples in the same micro-batches (BatchNorm's groups), step by step
    assert [[m for m, _ in step] for step in a] == [[m for m, _ in step] for step in b]
    for step in b:  # summed by hand: each micro-batch's weight is its samples over the step's, summing to 1
        samples = sum(len(m) for m, _ in step)
        assert [w for _, w in step] == [len(m) / samples for m, _ in step]
        assert sum(w for _, w in step) == pytest.approx(1.0)
    for step in a:  # DDP divides the sum by 2
        assert sum(w for _, w in step) == pytest.approx(2.0)
    assert [len(step) for step in b] == [4, 4, 4] and [sum(len(m) for m, _ in s) for s in b] == [64, 64, 22]
    assert f"global batch 64 as 4 micro-batches of 16 on {world_size} processes: {','.join(map(str, shares))}" in (
        uneven.describe()
    )
    assert f"spread {','.join(map(str, shares))}" in uneven.relayout


def test_a_world_size_that_divides_the_micro_batches_keeps_ddp_and_its_weights():
    four = resumed_plan(4)  # 4 micro-batches of 16 on 4: one each, DDP as today
    assert four.shares() == [1, 1, 1, 1] and not four.manual_reduction
    assert all(
        w == pytest.approx(len(m) / (sum(len(x) for x, _ in s) / 4)) for s in steps_over_ranks(four) for m, w in s
    )


def test_what_needs_equal_shares_is_refused_in_one_line_naming_the_fix():
    """Without the refusal, FSDP on uneven shares aborts in a gloo collective mismatch, said as a lost process
    (tests/test_world_sizes.py's run, broken on purpose by equal_shares ignoring --strategy fsdp)."""
    from ddp_tricks.training import preflight

    def reason(setup=preflight.Setup(3), task=object(), sparse=(), global_loss=False):
        return preflight.equal_shares(setup, task, list(sparse), global_loss)

    class Cached:
        cached_accumulation = True

    assert reason() == ""  # DDP: uneven shares are fine
    fsdp = reason(preflight.Setup(3, strategy="fsdp"))
    assert fsdp.startswith("--strategy fsdp") and reason(preflight.Setup(3, sync_bn=True)).startswith("--sync-bn")
    assert "gather_with_grad" in reason(global_loss=True) and "cached accumulation" in reason(task=Cached())
    assert "sparse gradients" in reason(sparse=["table.weight"])
    with pytest.raises(UserError) as error:
        resumed_plan(3, equal_shares=fsdp)
    message = str(error.value)
    assert "\n" not in message and message.startswith("the run's global batch 64 cannot be kept on 3 processes")
    assert "--strategy ddp takes uneven shares" in message and "launch a number of processes that divides it" in message


# ---------------------------------------------------------------- real runs: 64 from 2 ranks, resumed on 3 and 7

# global batch 64 = 16 x 2 x 2: 4 micro-batches of 16 a step; the digits: 23 steps an epoch (1437: the last 29), the
# language model (a loss over tokens, weighted by the task's units()): 5 (270 sequences: the last 14)
FLAGS = ["-l", "0.05", "--batch-size", "16", "--accum-steps", "2", "--epochs", "2", "--no-progress",
         "--log-interval", "5"]  # fmt: skip
LM = ["--max-sequences", "300", "--max-length", "24", "--width", "8", "--depth", "1", "--heads", "2"]
# (task flags, rank 0's micro-batch after which SIGTERM comes: 2 a step, mid-epoch 1, BatchNorm or not)
CASES = {
    "batchnorm": (["--task", "tests/rank_tasks.py:PreemptedTinyBN"], 2 * 9, True),
    "no-batchnorm": (["--task", "tests/rank_tasks.py:PreemptedTinyMLP"], 2 * 9, False),
    "tokens": (["--task", "tests/rank_tasks.py:PreemptedLM", *LM], 2 * 2, False),
}
BN_RUNNING = ("running_mean", "running_var", "num_batches_tracked")
# Each parameter tensor, relative (L2) to the uninterrupted run's. Measured on a 2-core CPU: the order of float sums
# (a manual sum in place of DDP's buckets) 4e-8 to 1.8e-7; the breaks below 2.5e-3 (equal weights per micro-batch,
# no BatchNorm) to 0.73 (weights by the rank count).
TOLERANCE = 1e-4


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def assert_same_run(whole_dir, run_dir, world_size: int, accum_steps: int, batchnorm: bool) -> float:
    """The resumed run ended as the uninterrupted one: its steps, global batches and epoch metrics (train: exact up
    to float order; validation too without BatchNorm, whose running statistics follow rank 0's micro-batches), and
    each parameter within TOLERANCE (relative, L2). Returns the worst relative difference."""
    a, b = rows(whole_dir), rows(run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["global_batch"] for r in a] == [r["global_batch"] for r in b]
    assert (b[-1]["world_size"], b[-1]["accum_steps"]) == (str(world_size), str(accum_steps))
    compared = [name for name in a[0] if name.startswith("train_") or (name.startswith("val_") and not batchnorm)]
    for x, y in zip(a, b):
        for name in compared:
            assert float(y[name]) == pytest.approx(float(x[name]), rel=1e-4, abs=1e-6), (name, x["epoch"])
    expected = checkpoint.load(whole_dir / "last.pt")["model"]
    got = checkpoint.load(run_dir / "last.pt")["model"]
    assert expected.keys() == got.keys()
    worst = max(relative_difference(got[k], expected[k]) for k in expected if not k.endswith(BN_RUNNING))
    assert worst < TOLERANCE, worst
    return worst


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", list(CASES))
def test_64_from_2_ranks_resumed_mid_epoch_on_3_and_on_7_equals_the_uninterrupted_run(tmp_path, model, monkeypatch):
    """Broken on purpose, each seen failing on its 3-rank resume (the epoch's training loss, before the parameters):
    weights by the rank count (DDP's divisor kept under the manual sum: parameters 0.66 to 0.73 apart; the tokens case
    weighs by units and passes); every micro-batch weighted alike instead of by its samples (the short last step's
    8, 7, 7, 7: 1.5e-2 with BatchNorm, 2.5e-3 without); rank 0's two micro-batches re-cut (BatchNorm only: 7.6e-2;
    without BatchNorm the gradient is the same and the test passes); the units' scale of DDP's average kept under
    the manual sum (the tokens case)."""
    task, after, batchnorm = CASES[model]
    flags = [*task, *FLAGS, "--runs-dir", str(tmp_path)]
    whole = launch([*flags, "-n", "whole"], nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    monkeypatch.setenv("PREEMPT_AFTER", str(after))
    stopped = launch([*flags, "-n", "on3"], nproc=2)
    monkeypatch.delenv("PREEMPT_AFTER")
    assert stopped.returncode == 143 and "preempted at epoch" in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    saved = checkpoint.load(tmp_path / "on3" / "last.pt")
    assert saved["epoch"] == 0 and saved["step_in_epoch"] > 0  # mid-epoch 1
    shutil.copytree(tmp_path / "on3", tmp_path / "on7")
    worst = {}
    for world_size, shares, accum_steps in ((3, "2,1,1", 2), (7, "1,1,1,1,0,0,0", 1)):
        name = f"on{world_size}"
        end = launch([*flags, "-n", name, "--resume", "auto"], nproc=world_size, timeout=400)
        assert end.returncode == 0, end.stderr[-3000:]
        log = end.stdout
        assert f"global batch 64 as 4 micro-batches of 16 on {world_size} processes: {shares}" in log, log[-3000:]
        assert_resumed(log, saved, final_step(tmp_path / "whole"))
        worst[world_size] = assert_same_run(tmp_path / "whole", tmp_path / name, world_size, accum_steps, batchnorm)
    print(f"{model}: worst relative parameter difference vs the uninterrupted run:", worst)
