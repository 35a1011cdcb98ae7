"""run.py as users launch it: torchrun, the legacy launcher, plain python; the run folder it writes."""

import csv
import json

import pytest
import torch
from multiproc import REPO, legacy_launch, python_run, torchrun

TIMING = {"epoch_seconds", "samples_per_second"}


def _metrics(run_dir, name="metrics.csv"):
    with open(run_dir / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """The same torchrun command, run twice (runs a and b): what both tests below look at."""
    runs = tmp_path_factory.mktemp("twice")
    results = {}
    for name in ("a", "b"):
        results[name] = torchrun(
            ["--epochs", "2", "-n", name, "--runs-dir", str(runs), "--no-progress", "--deterministic"]
        )
        assert results[name].returncode == 0, results[name].stderr[-3000:]
    return runs, results


@pytest.mark.xdist_group("e2e-twice")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_two_ranks_writes_a_complete_run_folder(twice):
    runs, results = twice
    result = results["a"]
    run_dir = runs / "a"
    for name in ("config.json", "metrics.csv", "train.log", "curves.png", "last.pt", "best.pt"):
        assert (run_dir / name).stat().st_size > 0, name
    rows = _metrics(run_dir)
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert list(rows[0]) == [
        "epoch",
        "step",
        "train_loss",
        "train_acc",
        "val_loss",
        "val_acc",
        "lr",
        "global_batch",
        "world_size",
        "accum_steps",
        "noise_scale",
        "grad_noise_trace",
        "grad_sq_norm",
        "epoch_seconds",
        "samples_per_second",
        "skipped_steps",
    ]
    assert float(rows[-1]["val_acc"]) > 0.9
    config = json.loads((run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["global_batch_size"] == 64
    # what a reader needs to reproduce the run, besides its flags
    assert config["task_info"] == {"in_channels": 1, "num_classes": 10}
    assert config["train_samples"] == 1438 and config["val_samples"] == 359 and config["torch_version"]
    assert config["command"] and config["started"] and "git_commit" in config
    last_line = result.stdout.strip().splitlines()[-1]
    assert "best val_loss" in last_line and str(run_dir) in last_line
    assert "epoch 2:" in (run_dir / "train.log").read_text()


@pytest.mark.xdist_group("e2e-twice")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_same_command_twice_gives_identical_metrics(twice):
    tmp_path, results = twice
    for result in results.values():
        assert "--deterministic: an op without a deterministic kernel warns once" in result.stdout  # said at start
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    strip = (
        [{k: v for k, v in row.items() if k not in TIMING} for row in a],
        [{k: v for k, v in row.items() if k not in TIMING} for row in b],
    )
    assert strip[0] == strip[1]  # every loss digit equal
    wa = torch.load(tmp_path / "a" / "last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "b" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_legacy_launcher_passes_local_rank_flag(tmp_path):
    result = legacy_launch(
        [
            "-n=legacy",
            "--epochs",
            "1",
            "--runs-dir",
            str(tmp_path),
            "--no-progress",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "legacy" / "config.json").read_text())["world_size"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_only_gives_the_same_numbers_at_any_world_size(tmp_path):
    one = python_run(["--eval-only", "-n", "w1", "--runs-dir", str(tmp_path)])
    two = torchrun(["--eval-only", "-n", "w2", "--runs-dir", str(tmp_path)])
    three = torchrun(["--eval-only", "-n", "w3", "--runs-dir", str(tmp_path)], nproc=3)
    for result in (one, two, three):
        assert result.returncode == 0, result.stderr[-3000:]
    rows = [_metrics(tmp_path / n, "eval.csv")[0] for n in ("w1", "w2", "w3")]
    # Identical weights everywhere; the loss agrees to float32 rounding (conv kernels block by batch size).
    assert rows[0]["val_acc"] == rows[1]["val_acc"] == rows[2]["val_acc"]
    for row in rows[1:]:
        assert float(row["val_loss"]) == pytest.approx(float(rows[0]["val_loss"]), rel=1e-6)
    assert not (tmp_path / "w1" / "last.pt").exists()  # evaluation only: nothing trained, nothing saved
    assert not (tmp_path / "w1" / "metrics.csv").exists() and not (tmp_path / "w1" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_flag_exits_2_on_every_rank_printed_once(tmp_path):
    result = torchrun(["--epochs", "0", "--runs-dir", str(tmp_path)])
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "--epochs: must be a positive integer, got '0'" in lines[0]
    assert "exitcode  : 2" in result.stderr
    assert f'File "{REPO / "run.py"}"' not in result.stderr  # torchrun's own report only, no trace of ours
    assert not any(tmp_path.iterdir())  # nothing written
