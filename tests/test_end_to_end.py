"""run.py as users launch it: torchrun and plain python (the legacy launcher: test_tricks.py); the run folder it
writes; the tests' warm ranks (multiproc.launch) give what torchrun gives."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from multiproc import REPO, launch, torchrun, torchrun_environment

TIMING = {"epoch_seconds", "samples_per_second"}


def _metrics(run_dir, name="metrics.csv"):
    with open(run_dir / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """The same command twice (runs a and b): a under torchrun as a user types it, b on the warm ranks that most
    tests use (multiproc.launch). What both tests below look at: equal runs say the run is deterministic and the
    warm ranks are the launcher's."""
    runs = tmp_path_factory.mktemp("twice")
    results = {}
    for name, launcher in (("a", torchrun), ("b", launch)):
        results[name] = launcher(
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
def test_same_command_twice_gives_identical_metrics_under_torchrun_and_on_warm_ranks(twice):
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
def test_eval_only_gives_the_same_numbers_at_any_world_size(tmp_path):
    one = launch(["--eval-only", "-n", "w1", "--runs-dir", str(tmp_path)], nproc=None)
    two = launch(["--eval-only", "-n", "w2", "--runs-dir", str(tmp_path)])
    three = launch(["--eval-only", "-n", "w3", "--runs-dir", str(tmp_path)], nproc=3)
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


ENVIRONMENT = """
import json, os, sys
with open(os.path.join(sys.argv[1], os.environ.get("RANK", "plain") + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_warm_ranks_get_the_environment_torchrun_gives_its_workers(tmp_path):
    """What torchrun adds to a worker's environment (torch's LocalElasticAgent), against what multiproc gives the
    warm ranks: the same variables with the same values, but for the store's address and the run's id; nothing
    that torchrun adds is missing."""
    script = tmp_path / "env.py"
    script.write_text(ENVIRONMENT)
    plain = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert plain.returncode == 0 and result.returncode == 0, plain.stderr[-3000:] + result.stderr[-3000:]
    before = json.loads((tmp_path / "plain.json").read_text())  # what any child of this process starts with
    launcher_own = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}  # its error file and signal list
    for rank in (0, 1):
        real = json.loads((tmp_path / f"{rank}.json").read_text())
        added = {k: v for k, v in real.items() if before.get(k) != v and k not in launcher_own}
        warm = torchrun_environment(rank, 2, int(real["MASTER_PORT"]), real["TORCHELASTIC_RUN_ID"])
        assert added.keys() == warm.keys(), added.keys() ^ warm.keys()
        assert {k: v for k, v in added.items() if k != "MASTER_ADDR"} == {
            k: v for k, v in warm.items() if k != "MASTER_ADDR"
        }
        assert added["MASTER_ADDR"] == "localhost" and warm["MASTER_ADDR"] == "127.0.0.1"  # both this machine
