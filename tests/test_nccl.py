"""On a GPU (#48, NCCL's blind spots): the paths that only a CUDA device runs, each mirroring a CPU test. A hang in
evaluation found where nccl's host waits (its read of the all-reduce's result) and a stopped rank found, on nccl;
NCCL's own watchdog abort named as such; a kernel that refuses 0 rows on the GPU said at start; uneven shares with
fp16; model EMA under FSDP; gathered rows on nccl; evaluation with a rank's batch of 0 rows on CUDA. Marked `cuda`
and skipped without a CUDA device (`make gpu-check` runs them). nccl refuses two ranks on one GPU: the nccl tests
need two GPUs, and where one GPU must hold two ranks the ranks use gloo (which moves CUDA tensors too).
"""

import csv
import math
import os
import re
import subprocess

import pytest
import torch
from multiproc import REPO, python_run, run_ranks, torchrun, torchrun_command
from test_cuda import cuda_test, two_gpus

NCCL = ["--backend", "nccl", "--device", "cuda", "--no-progress"]
HANGS = ["--task", "tests/hang_tasks.py:Faulty", "--batch-size", "32", "--epochs", "1"]


def torchrun_with(args: list[str], nproc: int, timeout: float, **env) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N run.py ARGS` with extra environment variables."""
    environ = {**os.environ, **{k: str(v) for k, v in env.items()}}
    cmd = torchrun_command([str(a) for a in args], nproc)
    return subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=timeout)


def rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@cuda_test
@two_gpus
@pytest.mark.timeout(300)
def test_on_nccl_a_hang_in_evaluation_is_found_where_the_host_reads_the_all_reduce(tmp_path):
    """test_hangs' evaluation hang on nccl, where the all-reduce returns once queued and rank 0's host waits in the
    template's read of its result (collectives.sum_to_host): the job ends with HUNG within --hang-timeout 3 s and a
    few beats, naming both collectives, not after --dist-timeout."""
    flags = [*NCCL, *HANGS, "--runs-dir", tmp_path, "-n", "evalwait", "--hang-timeout", "3", "--dist-timeout", "300"]
    result = torchrun_with(flags, 2, 240, FAULT="evalwait", AT=1)
    err = result.stderr
    assert result.returncode != 0 and "the job hangs: no progress on any rank" in err, err[-3000:]
    assert "the ranks wait in different collectives (rank 0 in all_reduce, rank 1 in barrier)" in err, err[-3000:]
    assert re.search(r"error: rank 0: eval, waits in all_reduce at .*sum_to_host\(\)", err), err[-3000:]


@cuda_test
@two_gpus
@pytest.mark.timeout(300)
def test_on_nccl_a_stopped_rank_is_found_silent_with_the_live_rank_s_line(tmp_path):
    """test_hangs' stopped rank (SIGSTOP at its 30th step) on nccl: the heartbeat goes through the job's store, not
    nccl, so the job ends with HUNG within --heartbeat-timeout 5 s and a few beats, rank 1 said silent."""
    flags = [*NCCL, *HANGS, "--batch-size", "4", "--runs-dir", tmp_path, "-n", "stop", "--heartbeat-timeout", "5"]
    result = torchrun_with(flags, 2, 240, FAULT="stop", AT=30)
    err = result.stderr
    assert result.returncode != 0 and "error: the job hangs: rank 1 is silent: no heartbeat for 5 s" in err, err[-3000:]
    assert re.search(r"error: rank 1: silent for \d+ s \(its process is stopped\)", err), err[-3000:]


@cuda_test
@two_gpus
@pytest.mark.timeout(400)
def test_nccl_s_own_watchdog_abort_is_named_as_such_never_a_collective_mismatch(tmp_path):
    """At its 5th step rank 1 waits in a gloo barrier rank 0 never joins, and rank 0 goes on into nccl collectives
    rank 1 never joins: after --dist-timeout 20 s NCCL's watchdog aborts rank 0 (its stacks file says "Aborted", as
    gloo's mismatch does), and rank 1's barrier loses its peer. The job says NCCL's watchdog took a process down and
    where, never "a collective mismatch" (the CPU test of the wording: test_hangs.py)."""
    flags = [*NCCL, *HANGS, "--runs-dir", tmp_path, "-n", "side", "--dist-timeout", "20"]
    flags += ["--hang-timeout", "1000", "--hang-factor", "1000", "--heartbeat-timeout", "1000"]
    result = torchrun_with(flags, 2, 300, FAULT="side", AT=5)
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    assert "collective mismatch" not in err, err[-3000:]
    assert re.search(r"error: on rank 1: NCCL's watchdog", err), err[-3000:]
    assert "rank 0 aborted in" in err, err[-3000:]


@cuda_test
@pytest.mark.timeout(600)
def test_uneven_shares_with_fp16_on_cuda_train_on_and_measure_the_noise_scale(tmp_path):
    """test_uneven_shares on a GPU with fp16: one process at global batch 48 (3 micro-batches of 16), resumed on 2
    ranks (gloo over one GPU): the shares are 2 and 1, the reduction (its hooks, its buckets) runs on CUDA under the
    GradScaler, and epoch 2 trains to finite metrics with the noise scale measured."""
    common = ["--device", "cuda", "--amp", "fp16", "-b", "16", "--accum-steps", "3", "--no-progress"]
    common += ["--runs-dir", str(tmp_path), "-n", "r", "--bucket-cap-mb", "0.01"]
    first = python_run([*common, "-e", "1"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = torchrun([*common, "-e", "2", "--resume", "auto", "--backend", "gloo"], nproc=2, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "as 3 micro-batches of 16 on 2 processes: 2,1" in resumed.stdout + resumed.stderr
    last = rows(tmp_path / "r")[-1]
    assert last["epoch"] == "2" and math.isfinite(float(last["train_loss"])) and math.isfinite(float(last["val_loss"]))
    assert "noise_scale" in last, last  # measured on every uneven-shares step


@cuda_test
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
def test_model_ema_under_fsdp_on_cuda_trains_and_evaluates_its_weights(tmp_path, nproc):
    """--model-ema with --strategy fsdp on nccl: the EMA of the shards steps on the GPU, is evaluated (val_ema_*),
    and best.pt holds its whole weights."""
    flags = [*NCCL, "-e", "2", "--strategy", "fsdp", "--model-ema", "0.9", "--runs-dir", str(tmp_path), "-n", "r"]
    result = torchrun(flags, nproc=nproc, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    last = rows(tmp_path / "r")[-1]
    assert math.isfinite(float(last["val_ema_loss"])) and math.isfinite(float(last["val_loss"])), last
    best = torch.load(tmp_path / "r" / "best.pt", weights_only=True, map_location="cpu")
    assert best["ema"] is not None and best["ema"]["weights"].keys() == best["model"].keys()


@cuda_test
@two_gpus
@pytest.mark.timeout(600)
def test_gathered_rows_on_nccl_give_one_gpu_s_metric(tmp_path):
    """tests/user_tasks.py's Retrieval (gathered embeddings and labels, recall@1 over the whole split: 131 and 130
    rows on 2 ranks), one GPU's checkpoint evaluated (--eval-only) on one GPU and on two over nccl: the same recall,
    to one neighbour of 261 (the GPU's float order; test_whole_set_metrics is the CPU one)."""
    flags = [*NCCL, "--task", "tests/user_tasks.py:Retrieval", "-b", "8", "-e", "1", "--runs-dir", str(tmp_path)]
    trained = torchrun([*flags, "-n", "r"], nproc=1, timeout=540)
    assert trained.returncode == 0, trained.stderr[-3000:]
    for nproc in (1, 2):
        result = torchrun([*flags, "-n", "r", "--eval-only", "--resume", "auto"], nproc=nproc, timeout=540)
        assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "r" / "eval.csv", newline="") as f:
        one, two = list(csv.DictReader(f))
    assert float(two["val_recall_at_1"]) == pytest.approx(float(one["val_recall_at_1"]), abs=1.5 / 261)


def _evaluate(rank: int, world_size: int, device_type: str) -> dict:
    """The built-in digits model, seeded alike, evaluated on the 359 validation digits at --val-batch-size 1: 179
    rounds of one row per rank, then the leftover digit evaluated alike on both ranks and counted by rank 0 (on
    `device_type`)."""
    import tiny

    from ddp_tricks.data import images, loaders
    from ddp_tricks.schedules.curves import WarmupDecay
    from ddp_tricks.schedules.schedule import Schedule
    from ddp_tricks.training import loop
    from ddp_tricks.training.precision import Precision
    from ddp_tricks.training.state import Training

    device = torch.device(device_type)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = Schedule(WarmupDecay(optimizer, 0, 0))
    t = Training(model, optimizer, schedule, tiny.Classify(), ["acc"], Precision("off", device), device,
                 rank=rank, world_size=world_size)  # fmt: skip
    val = images.digits()[1]
    return loop.evaluate(t, loaders.val_loader(val, 1, rank, world_size, device))


@cuda_test
@pytest.mark.timeout(300)
def test_an_evaluation_with_a_leftover_batch_on_cuda_equals_the_cpu_s():
    """Two ranks on one GPU (gloo moves the CUDA tensors): the rounds and the leftover batch, evaluated alike on both
    ranks and counted once, go through the model, the loss and the metric sums on CUDA, and the evaluation equals the
    same one on the CPU (test_eval_lockstep's split)."""
    on_cuda = run_ranks(_evaluate, 2, "cuda", timeout=240)
    on_cpu = run_ranks(_evaluate, 2, "cpu", timeout=240)
    assert on_cuda[0] == on_cuda[1]
    for key, value in on_cpu[0].items():
        assert on_cuda[0][key] == pytest.approx(value, rel=1e-5), key
