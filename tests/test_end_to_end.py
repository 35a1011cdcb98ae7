"""run.py as users launch it: torchrun and plain python (the legacy launcher: test_tricks.py); the run folder it
writes; the tests' warm ranks (multiproc.launch) give what torchrun gives."""

import csv
import json
import re
import subprocess
import sys

import pytest
import torch
from multiproc import PIDS, REPO, Job, launch, torchrun, torchrun_command, torchrun_environment

TIMING = {"epoch_seconds", "samples_per_second"}
# torchrun's own log lines, such as "W1125 22:16:17.106000 5492 torch/distributed/run.py:982] ..."
TORCHRUN_LOG = re.compile(r"[WIE]\d{4} [\d:.]+ \d+ torch/")


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
    said = {}
    for name, result in results.items():
        assert "--deterministic: an op without a deterministic kernel warns once" in result.stdout  # said at start
        out = re.sub(r"\d+\.\ds, \d+ samples/s", "(time)", result.stdout).replace(str(tmp_path / name), "(run)")
        err = [line for line in result.stderr.splitlines() if not TORCHRUN_LOG.match(line)]  # torchrun's own log
        said[name] = out, err
    assert said["a"] == said["b"]  # every line either printed, but the timings and the run's folder
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


PROBE = """
import json, os, signal, sys, threading
names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGCHLD")
handlers = {name: str(signal.getsignal(getattr(signal, name))) for name in names}
seen = {
    "environ": dict(os.environ), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "handlers": handlers,
    "session_leader": os.getsid(0) == os.getpid(), "threads": [t.name for t in threading.enumerate()],
    "stdio": [(s.encoding, s.errors, s.write_through) for s in (sys.stdout, sys.stderr)], "main": __name__,
}
with open(os.path.join(sys.argv[1], sys.argv[2] + "-" + os.environ.get("RANK", "") + ".json"), "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_warm_ranks_see_what_torchrun_s_workers_see(tmp_path):
    """One script under torchrun and on warm ranks (multiproc.Job): the variables torchrun adds to a worker's
    environment (torch's LocalElasticAgent), with their values but for the store's address and the run's id, argv,
    sys.path's first entry, the folder, the signal handlers, a session of its own, one thread, stdio as `python -u`
    sets it up. (What a fork of a warm server cannot show: the docstring of multiproc._run_script.)"""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    plain = subprocess.run([sys.executable, str(probe), str(tmp_path), "plain"], capture_output=True, timeout=60)
    real = subprocess.run(torchrun_command([str(tmp_path), "real"], script=probe), capture_output=True, text=True,
                          timeout=90)  # fmt: skip
    with Job([str(tmp_path), "warm"], script=probe) as job:
        _, warm_err = job.communicate(timeout=60)
    assert plain.returncode == 0 and real.returncode == 0 and job.returncode == 0, real.stderr[-3000:] + warm_err
    before = json.loads((tmp_path / "plain-.json").read_text())["environ"]  # what any child of this process has
    by_store = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # localhost / 127.0.0.1, a port, an id
    left_out = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", PIDS, *by_store}  # launchers' own
    for rank in (0, 1):
        seen = {name: json.loads((tmp_path / f"{name}-{rank}.json").read_text()) for name in ("real", "warm")}
        store = {}
        for name, what in seen.items():
            environ = what.pop("environ")
            store[name] = {k: environ[k] for k in by_store}
            what["added"] = {k: v for k, v in environ.items() if before.get(k) != v and k not in left_out}
            assert what["argv"].pop() == name  # the script's own argument: which launcher ran it
        assert seen["real"] == seen["warm"], (seen["real"], seen["warm"])
        warm = store["warm"] | seen["warm"]["added"]
        assert warm == torchrun_environment(rank, 2, int(warm["MASTER_PORT"]), warm["TORCHELASTIC_RUN_ID"])
