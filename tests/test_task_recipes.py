"""What docs/tasks.md says a task may do, run as a user runs it: activation checkpointing in the model trains under
DDP and FSDP to the metrics of the same model without it, a loss whose randomness is drawn per sample from a
generator seeded by the sample's index and the step trains the same at 1 and 2 processes, and the language model's
position table may be longer than its sequences (--positions)."""

import argparse
import importlib.util
import os

import pytest
from multiproc import REPO, launch

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
