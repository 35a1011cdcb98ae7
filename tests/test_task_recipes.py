"""What docs/tasks.md says a task may do, run as a user runs it: activation checkpointing in the model trains under
DDP and FSDP to the metrics of the same model without it, a loss whose randomness is drawn per sample from a
generator seeded by the sample's index and the step trains the same at 1 and 2 processes, and the language model's
two-phase LAMB recipe (recipes/lm-lamb-phase{1,2}.toml) runs end to end, phase 2 from phase 1."""

import argparse
import csv
import importlib.util
import json
import os

import pytest
from multiproc import REPO, launch, python_run
from sweep_harness import load_tool

from ddp_tricks import UserError


def _last_row(run_dir):
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    row = dict(zip(lines[0].split(","), lines[-1].split(",")))
    return {k: float(row[k]) for k in ("train_loss", "train_acc", "val_loss", "val_acc")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_activation_checkpointing_in_a_task_s_model_trains_as_without_it_under_ddp_and_fsdp(tmp_path):
    """2 epochs on 2 ranks: with torch.utils.checkpoint on the hidden block, DDP and FSDP end with the metrics of DDP
    without it. Broken on purpose: a checkpointed block whose recompute in backward sees another input (x + 1)
    fails it (a recomputed output merely scaled does not: backward uses the saved activations, not the output)."""
    flags = ["--task", "tests/recipe_tasks.py:Checkpointed", "-e", "2", "--no-progress", "--runs-dir", str(tmp_path)]
    runs = {"plain": ({"NO_CHECKPOINT": "1"}, []), "ddp": ({}, []), "fsdp": ({}, ["--strategy", "fsdp"])}
    for name, (env, extra) in runs.items():
        result = launch([*flags, *extra, "-n", name], env=os.environ | env)
        assert result.returncode == 0, (name, result.stderr[-3000:])
    expected = _last_row(tmp_path / "plain")
    for name in ("ddp", "fsdp"):
        assert _last_row(tmp_path / name) == pytest.approx(expected, rel=1e-6), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_loss_s_randomness_seeded_by_sample_index_and_step_is_the_same_at_any_world_size(tmp_path):
    """Logit noise drawn per sample from a generator seeded by (index, step): one process at -b 64 and 2 at -b 32
    end 2 epochs with the same losses. Broken on purpose: the noise from torch's global generator
    ($GLOBAL_NOISE=1, each rank its own stream) fails it."""
    flags = ["--task", "tests/recipe_tasks.py:NoisyLoss", "-e", "2", "--no-progress", "--runs-dir", str(tmp_path)]
    one = launch([*flags, "-b", "64", "-n", "one"], nproc=None)
    two = launch([*flags, "-b", "32", "-n", "two"])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert _last_row(tmp_path / "two") == pytest.approx(_last_row(tmp_path / "one"), rel=1e-6)


TINY_LM = ["--max-sequences", "60", "--width", "16", "--depth", "1", "--heads", "2", "--log-interval", "1"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_two_phase_recipe_runs_phase_2_from_phase_1_at_step_0_with_its_own_warmup(tmp_path):
    """The two recipes at tiny sizes (typed flags over the files): phase 1 trains 32-byte sequences with the
    128-position table phase 2 needs, so phase 2 (128 bytes) `--init-from` it loads every tensor and re-initialises
    none, then trains global steps 0 -> 8 from its own warmup's first LR, up to its peak and down;
    tools/plot_phases.py draws the two. Broken on purpose: phase 1 with `--positions 32` (a table of its own length)
    leaves phase 2's position table re-initialised."""
    common = [*TINY_LM, "--runs-dir", str(tmp_path), "--no-progress"]
    first = python_run(
        ["--config", "recipes/lm-lamb-phase1.toml", *common, "-b", "8", "--max-steps", "4", "-n", "p1"], 60
    )
    assert first.returncode == 0, first.stderr[-3000:]
    p1 = json.loads((tmp_path / "p1" / "config.json").read_text())
    assert (p1["max_length"], p1["positions"], p1["optimizer"], p1["scheduler"]) == (32, 128, "lamb", "poly")
    argv = ["--config", "recipes/lm-lamb-phase2.toml", *common, "-b", "4", "--max-steps", "8", "-n", "p2"]
    second = python_run([*argv, "--init-from", str(tmp_path / "p1"), "--init-optimizer"], 60)
    out = second.stdout + second.stderr
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"started from the weights of checkpoint {str(tmp_path / 'p1' / 'last.pt')!r}" in out, out
    # embedding, positions, final norm (2), head and one block's 12: every one loaded, none re-initialised
    assert "17 of 17 tensors loaded" in out and "re-initialised" not in out and "global steps 0 -> 8" in out, out
    p2 = json.loads((tmp_path / "p2" / "config.json").read_text())
    assert (p2["max_length"], p2["positions"], p2["global_batch_size"]) == (128, None, 4)
    with open(tmp_path / "p2" / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    lrs = [float(r["lr"]) for r in rows]  # 0.25 warmup epochs of about 26 steps: the first 6 or 7 steps
    assert 0 < lrs[0] < lrs[1] < lrs[2] and lrs[0] <= p2["effective_lr"] / 2  # its own warmup, from its first step
    assert max(lrs) == pytest.approx(p2["effective_lr"]) and lrs[-1] < max(lrs)  # then the decay
    figure = tmp_path / "phases.png"
    assert load_tool("plot_phases").main([str(tmp_path / "p1"), str(tmp_path / "p2"), "-o", str(figure)]) == 0
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_the_language_model_s_position_table_is_at_least_max_length():
    """--positions below --max-length is one sentence (a sequence would index past the table); left out, the table
    has --max-length rows, as before the flag."""
    spec = importlib.util.spec_from_file_location("language_model", REPO / "examples" / "language_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sizes = {"max_sequences": 60, "max_length": 32, "width": 16, "depth": 1, "heads": 2, "tie_weights": False}
    with pytest.raises(UserError, match="--positions 16 is shorter than --max-length 32"):
        module.PythonSourceLM(argparse.Namespace(**sizes, positions=16))
    for positions, rows in ((None, 32), (128, 128)):
        model = module.PythonSourceLM(argparse.Namespace(**sizes, positions=positions)).model()
        assert model.position.weight.shape == (rows, 16)
