"""Nothing is lost: exact resume (epoch boundary and mid-epoch), preemption by SIGTERM, restart after a killed
worker, non-finite losses, a dead rank, two nodes on one machine, and atomic checkpoint writes."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from multiproc import REPO, Job, free_port, launch, run_ranks, torchrun_command
from resumed import assert_resumed, final_step, took

from ddp_tricks.storage import checkpoint

TIMING = {"epoch_seconds", "samples_per_second"}
# Small batches: ~180 steps per epoch, so a signal lands while training.
FLAGS = ["--batch-size", "4", "--warmup-epochs", "0.5", "--no-progress", "--log-interval", "5"]


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def weights(run_dir):
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


def assert_same_run(a, b):
    assert rows(a) == rows(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = launch([*FLAGS, "--epochs", "2", "-n", "full", "--runs-dir", str(runs)])
    assert result.returncode == 0, result.stderr[-3000:]
    return runs / "full"


def _wait_for(predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting")


@pytest.mark.xdist_group("resume-uninterrupted")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_after_an_epoch_is_bit_identical(uninterrupted, tmp_path):
    # A run stopped after epoch 1 (its constant-after-warmup schedule does not depend on --epochs), resumed.
    part = launch([*FLAGS, "--epochs", "1", "-n", "p", "--runs-dir", str(tmp_path)])
    assert part.returncode == 0, part.stderr[-3000:]
    saved = checkpoint.load(tmp_path / "p" / "last.pt")
    rest = launch([*FLAGS, "--epochs", "2", "-n", "p", "--runs-dir", str(tmp_path), "--resume", "auto"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_resumed(rest.stdout, saved, final_step(uninterrupted))  # broken on purpose: `state = None` in run.py
    assert_same_run(uninterrupted, tmp_path / "p")


def _torchrun(args, extra=()):
    """The real launcher, for what it does: forward a signal to every worker, restart a job."""
    cmd = torchrun_command(args, extra=extra)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _pids(run_dir):
    return json.loads((run_dir / "workers.json").read_text())["pids"]


@pytest.mark.xdist_group("resume-uninterrupted")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_one_worker_stops_all_and_resume_is_exact(uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone, early in the run: every rank stops at the same step and ends with 143, the
    checkpoint of that step written, and a resume finishes the run bit-identical to the uninterrupted one. Broken on
    purpose: a SIGTERM handler that does nothing, or a rank that got the signal not adding its flag to the store
    (preemption.py's `_look` adding 1 alone): the run then finishes its epoch (the message says "after epoch")."""
    run_dir = tmp_path / "pre"
    with Job([*FLAGS, "--epochs", "2", "-n", "pre", "--runs-dir", str(tmp_path)]) as job:
        _wait_for(lambda: (run_dir / "workers.json").exists())
        os.kill(_pids(run_dir)[1], signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    assert job.exitcodes == [143, 143], (job.exitcodes, err[-3000:])
    assert "preempted at epoch" in out, out[-3000:]
    saved = checkpoint.load(run_dir / "last.pt")
    total = final_step(uninterrupted)
    assert 0 < saved["global_step"] < total
    assert took(out) == (saved["global_step"], 0, saved["global_step"])  # it stopped at the step it saved
    resumed = launch([*FLAGS, "--epochs", "2", "-n", "pre", "--runs-dir", str(tmp_path), "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, saved, total)
    assert_same_run(uninterrupted, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_stops_at_the_same_step_with_the_default_agreement(tmp_path):
    """SIGTERM to rank 1 alone, the ranks adding to and reading the store every K steps (the default K = 8; not the
    K = 1 of the tests' preempting tasks): both end with 143, each having trained the same number of steps (counted
    by each rank's task), the step rank 0 saved. Small watchdog thresholds, so a disagreement that deadlocks ends in
    seconds. Broken on purpose: the signalled rank stopping on its own flag (preemption.py's `_look` returning
    `self.requested or ...`) fails it: the other rank trains on alone, and the job ends as hung (exit 4), not
    preempted. Ranks whose hosts run apart (nccl's): test_sigterm_agreement.py."""
    run_dir = tmp_path / "k"
    task = ["--task", "tests/rank_tasks.py:StepsPerRank", "--checkpoint-every-steps", "20"]
    flags = [*FLAGS, "--epochs", "3", "-n", "k", "--runs-dir", str(tmp_path), *task]
    flags += ["--hang-timeout", "10", "--hang-factor", "3", "--heartbeat-timeout", "10"]
    with Job(flags, env={**os.environ, "STEPS_DIR": str(tmp_path)}) as job:
        _wait_for(lambda: (run_dir / "last.pt").exists())  # step 20 or later, of 540: rank 0 has timed its steps
        os.kill(_pids(run_dir)[1], signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    assert job.exitcodes == [143, 143], (job.exitcodes, err[-3000:])
    steps = [int((tmp_path / f"steps-rank{rank}.txt").read_text()) for rank in (0, 1)]
    saved = checkpoint.load(run_dir / "last.pt")
    assert steps[0] == steps[1] == saved["global_step"] > 0, (steps, saved["global_step"])
    assert took(out) == (saved["global_step"], 0, saved["global_step"])


@pytest.mark.xdist_group("resume-uninterrupted")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mid_epoch_checkpoint_resume_skips_exactly_the_consumed_batches(uninterrupted, tmp_path):
    run_dir = tmp_path / "mid"
    proc = _torchrun(
        [*FLAGS, "--epochs", "2", "-n", "mid", "--runs-dir", str(tmp_path), "--checkpoint-every-steps", "50"]
    )
    _wait_for(lambda: (run_dir / "last.pt").exists())
    os.kill(proc.pid, signal.SIGTERM)  # to the launcher, which forwards it to every worker
    proc.communicate(timeout=120)
    state = checkpoint.load(run_dir / "last.pt")
    resumed = launch([*FLAGS, "--epochs", "2", "-n", "mid", "--runs-dir", str(tmp_path), "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert state["step_in_epoch"] > 0  # written mid-epoch (SIGTERM lands soon after the step-50 checkpoint)
    assert_resumed(resumed.stdout, state, final_step(uninterrupted))  # the consumed batches skipped, no more
    assert_same_run(uninterrupted, run_dir)


@pytest.mark.xdist_group("resume-uninterrupted")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_restarts_after_kill_9_and_finishes_like_the_uninterrupted_run(uninterrupted, tmp_path):
    run_dir = tmp_path / "elastic"
    proc = _torchrun(
        [
            *FLAGS,
            "--epochs",
            "2",
            "-n",
            "elastic",
            "--runs-dir",
            str(tmp_path),
            "--resume",
            "auto",
            "--checkpoint-every-steps",
            "40",
        ],
        extra=("--max-restarts=1",),
    )
    _wait_for(lambda: (run_dir / "last.pt").exists())
    first = _pids(run_dir)
    os.kill(first[1], signal.SIGKILL)
    _wait_for(lambda: not _alive(first[0]))  # the first attempt is gone: nothing writes until the restart has trained
    shutil.copy(run_dir / "last.pt", tmp_path / "restarted-from.pt")  # 40 steps, seconds after it starts
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads((run_dir / "workers.json").read_text())["restart"] == "1"
    assert_resumed(out, tmp_path / "restarted-from.pt", final_step(uninterrupted))
    assert_same_run(uninterrupted, run_dir)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nonfinite_loss_stops_every_rank_and_keeps_the_last_good_weights(tmp_path):
    result = launch(
        [
            "--base-lr",
            "1e6",
            "--epochs",
            "1",
            "--checkpoint-every-steps",
            "1",
            "-n",
            "nan",
            "--runs-dir",
            str(tmp_path),
            "--no-progress",
            "--log-interval",
            "1",
        ],
        stop_others=False,
    )
    assert result.exitcodes == [3, 3], result.stderr[-3000:]  # every rank, by itself (no launcher stops one)
    line = next(line for line in result.stderr.splitlines() if line.startswith("error: non-finite loss or weights"))
    assert "epoch 1, found at step" in line and "on rank" in line
    saved = checkpoint.load(tmp_path / "nan" / "last.pt")
    bad_step = int(line.split("step ")[1].split(",")[0])
    assert saved["global_step"] < bad_step
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())


def _skip_nonfinite(rank, world_size):
    import tiny
    from torch import nn

    from ddp_tricks import plan
    from ddp_tricks.data import loaders as data
    from ddp_tricks.training.loop import train_one_epoch

    inputs = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    inputs[37, 0, 3, 3] = float("inf")  # one bad sample: whichever rank draws it, its step is skipped everywhere
    dataset = data.InMemoryDataset(inputs, torch.arange(64) % 10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = plan.make(num_train=64, world_size=world_size, micro_batch=8, accum_steps=1, epochs=1, seed=0,
                      base_lr=0.1, lr_scaling="keep", base_batch=8, warmup_epochs=0).epoch(1, rank)  # fmt: skip
    t = tiny.training(ddp, opt, on_nonfinite="skip")
    row = train_one_epoch(t, steps, tiny.loader_for(dataset, steps, rank))
    weights = [p.detach() for p in model.parameters()]
    return row["skipped_steps"], t.progress.global_step, t.schedule.per_step.last_epoch, weights


@pytest.mark.slow
def test_nonfinite_loss_skip_mode_skips_on_every_rank_and_counts():
    (skipped0, steps0, sched0, w0), (skipped1, steps1, sched1, w1) = run_ranks(_skip_nonfinite, 2)
    assert skipped0 == skipped1 == 1 and steps0 == steps1 == 4  # 64 samples / (2 ranks x 8)
    assert sched0 == sched1 == 3  # the schedule advanced only for the 3 steps taken
    assert all(torch.isfinite(p).all() and torch.equal(p, q) for p, q in zip(w0, w1))


def _one_rank_dies(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        os._exit(1)
    start = time.time()
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(1))
    except Exception as error:  # the survivor errors out instead of waiting forever
        return type(error).__name__, time.time() - start
    return "no error", time.time() - start


@pytest.mark.slow
def test_a_dead_rank_makes_the_others_fail_not_hang():
    # --dist-timeout sets this bound in run.py; here 10 s.
    ((outcome, seconds),) = run_ranks(_one_rank_dies, 2, reporting=[0], pg_timeout=10, timeout=60)
    assert outcome != "no error" and seconds < 30


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_worker_without_restarts_ends_the_job(tmp_path):
    """Rank 0 killed with -9: rank 1 ends by itself within seconds, saying why in one line, with no launcher to stop
    it (torchrun's agent would; a rank on another node has none that knows)."""
    run_dir = tmp_path / "dead"
    with Job([*FLAGS, "--epochs", "2", "-n", "dead", "--runs-dir", str(tmp_path)], stop_others=False) as job:
        _wait_for(lambda: (run_dir / "workers.json").exists())
        os.kill(_pids(run_dir)[0], signal.SIGKILL)
        killed = time.time()
        _, err = job.communicate(timeout=120)  # no hang
    assert job.exitcodes[0] == -signal.SIGKILL and job.exitcodes[1] == 1 and time.time() - killed < 30, err[-3000:]
    assert "error: on rank 1: another process of the job is gone" in err and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_on_one_machine_equal_one_node_with_two_processes(tmp_path):
    args = ["--epochs", "1", "--no-progress", "--runs-dir", str(tmp_path)]
    single = launch([*args, "-n", "single"])
    assert single.returncode == 0, single.stderr[-3000:]
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={r}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=twonodes",
                str(REPO / "run.py"),
                *args,
                "-n",
                "multi",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for node in nodes:
        node.communicate(timeout=240)
        assert node.returncode == 0
    assert_same_run(tmp_path / "single", tmp_path / "multi")


WRITER = """
import sys, io, torch
sys.path[:0] = [{repo!r}, {tests!r}]
from killed_writes import kill_torch_save_after
from ddp_tricks.storage import checkpoint
state = {{"model": {{"w": torch.arange(1_000_000, dtype=torch.float32)}}, "epoch": 1}}
whole = io.BytesIO()
torch.save(state, whole)
limit = max(1, int({fraction} * len(whole.getvalue())))
print(limit, flush=True)  # the byte it dies at
kill_torch_save_after(limit)
checkpoint.save(state, {path!r})
print("saved", flush=True)
"""


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    """A writer that SIGKILLs itself in the middle of saving a checkpoint over the previous one (early, half way,
    near the end: killed_writes.py): what it wrote is left in a temporary file, exactly that many bytes, and the
    previous checkpoint loads whole. Broken on purpose: torch.save straight to the target (files.py) leaves a torn
    last.pt and no temporary file."""
    path = tmp_path / "last.pt"
    checkpoint.save({"model": {"w": torch.zeros(3)}, "epoch": 0}, path)
    for fraction in (0.0001, 0.5, 0.99):
        before = set(tmp_path.iterdir())
        script = WRITER.format(repo=str(REPO), tests=str(REPO / "tests"), fraction=fraction, path=str(path))
        writer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert writer.returncode == -signal.SIGKILL, writer.stderr[-3000:]
        limit = int(writer.stdout.split()[0])
        assert "saved" not in writer.stdout
        state = checkpoint.load(path)  # never a torn file
        assert state["epoch"] == 0 and torch.equal(state["model"]["w"], torch.zeros(3))
        left = set(tmp_path.iterdir()) - before  # the killed write's temporary file, half-written
        assert [p.stat().st_size for p in left] == [limit], (limit, left)
