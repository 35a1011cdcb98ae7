"""Never a hang, always the true cause (#39): a rank that goes silent (SIGSTOP) and a stuck collective end the job
with exit code 4, one line per rank and the live ranks' stacks in the run folder; under torchrun --max-restarts the
job restarts and finishes bit-identical to an uninterrupted run; long legitimate work raises no alarm; a collective
mismatch that aborts a rank is said as one. Real processes (tests/hang_tasks.py), small thresholds, bounded waits."""

import csv
import json
import os
import re
import shutil
import subprocess
import time

import pytest
import torch
from multiproc import REPO, Job, launch, torchrun_command
from resumed import assert_resumed, final_step

from ddp_tricks import failures

TASK = ["--task", "tests/hang_tasks.py:Faulty", "--no-progress"]
SHORT = ["--batch-size", "32", "--epochs", "1"]  # 23 steps: seconds
TIMING = {"epoch_seconds", "samples_per_second"}


def env(**values) -> dict:
    return {**os.environ, **{k: str(v) for k, v in values.items()}}


def state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stopped_rank_ends_the_job_with_a_line_per_rank_and_the_live_stacks(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at its 30th step: within --heartbeat-timeout (5 s here) and a few seconds, the job
    ends with HUNG, saying rank 1 is silent and where each rank was, rank 0's stacks in the run folder, and no empty
    stacks file of the stopped rank (opened for an abort that never came). Broken on purpose: an observer that never
    finds a silent rank (heartbeat.py) fails it (the job runs until the timeout); so does end_silent() leaving the
    silent rank's empty stacks file."""
    args = [*TASK, "--batch-size", "4", "--epochs", "1", "--runs-dir", tmp_path, "-n", "stop"]
    with Job([*args, "--heartbeat-timeout", "5"], env=env(FAULT="stop", AT=30)) as job:
        wait_for(lambda: state(job.pids[1]) == "T" or job.poll() is not None, 120, "rank 1 to stop")
        stopped = time.monotonic()
        try:
            out, err = job.communicate(timeout=60)
        except subprocess.TimeoutExpired as late:
            raise AssertionError(f"still running 60 s after the stop:\n{late.stderr[-3000:]}") from None
        seconds = time.monotonic() - stopped
        codes = job.exitcodes
    assert codes[0] == failures.HUNG == 4, (codes, err[-3000:])
    assert seconds < 5 + 15, seconds  # the timeout, a beat or two, the ranks' answers
    assert "error: the job hangs: rank 1 is silent: no heartbeat for 5 s" in err, err[-3000:]
    assert re.search(r"error: rank 0: train step \d+, is at .*backward\(\)", err), err[-3000:]
    assert re.search(r"error: rank 1: silent for \d+ s \(its process is stopped\); last heard: ", err), err[-3000:]
    assert "another process of the job is gone" not in err
    stacks = (tmp_path / "stop" / "stacks-rank0.txt").read_text()
    assert "Thread MainThread" in stacks and "ddp_tricks-watchdog" in stacks and "_train_steps" in stacks
    assert not (tmp_path / "stop" / "stacks-rank1.txt").exists()


def test_a_rank_s_line_names_its_phase_and_step_in_words():
    """A rank's line says "train step 26", "in its first step, step 47" (it read "first step step 47"); other phases
    without a step.
    Broken on purpose: the old `phase + " step N"` fails it."""
    from ddp_tricks.distributed.heartbeat import describe

    beat = {"waits": "", "where": "run.py train()", "idle": 0.0, "step": 47}
    assert describe(beat | {"phase": "first step"}) == "in its first step, step 47, is at run.py train() (idle 0 s)"
    assert describe(beat | {"phase": "train", "step": 26}) == "train step 26, is at run.py train() (idle 0 s)"
    assert describe(beat | {"phase": "evaluate", "waits": "all_reduce"}).startswith("evaluate, waits in all_reduce")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_skipped_all_reduce_is_found_and_named(tmp_path):
    """At its 10th step rank 1 skips the loss's all_reduce and waits in a barrier: no rank makes progress, and after
    max(3 x the slowest step, 3 s) the job ends with HUNG naming the two collectives, each rank's line at the task's
    frame, and both ranks' stacks. Broken on purpose: a deadline of 1000 x --hang-timeout (heartbeat.py) fails it."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", "skip", "--hang-timeout", "3", "--hang-factor", "3"]
    result = launch(flags, env=env(FAULT="skip", AT=10), timeout=120)
    assert result.exitcodes == [4, 4], (result.exitcodes, result.stderr[-3000:])
    err = result.stderr
    assert re.search(r"error: the job hangs: no progress on any rank for \d+ s \(max\(--hang-factor 3 x", err), err
    assert (
        "a collective mismatch: the ranks wait in different collectives (rank 0 in all_reduce, rank 1 in barrier)"
        in err
    )
    assert re.search(r"error: rank 0: train step 10, waits in all_reduce at tests/hang_tasks.py:\d+ loss\(\)", err)
    assert re.search(r"error: rank 1: train step 10, waits in barrier at tests/hang_tasks.py:\d+ loss\(\)", err)
    for rank in (0, 1):
        assert "in loss" in (tmp_path / "skip" / f"stacks-rank{rank}.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_hang_in_evaluation_where_the_host_waits_in_a_read_is_found_and_named(tmp_path):
    """In evaluation (a phase of long legitimate work, judged by waiting in a collective), rank 1 stops at its first
    validation batch in a barrier rank 0 never joins, and rank 0 goes on to the evaluation's all-reduce of its sums,
    whose result it waits for in the template's host read, outside any torch.distributed call: nccl's way, which the
    template's reads take on gloo too (collectives.sum_to_host). After --hang-timeout 3 s the job ends with HUNG
    naming both collectives. Broken on purpose: stacks.collective without the template's marked reads
    (`_HOST_READS`) fails it: rank 0 then seems to work, and no verdict comes (the job runs on to the timeout)."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", "evalwait", "--hang-timeout", "3", "--dist-timeout", "300"]
    try:
        result = launch(flags, env=env(FAULT="evalwait", AT=1), timeout=90)
    except subprocess.TimeoutExpired as late:
        raise AssertionError(f"no verdict within 90 s:\n{(late.stderr or '')[-3000:]}") from None
    err = result.stderr
    assert result.exitcodes == [4, 4], (result.exitcodes, err[-3000:])
    assert re.search(r"error: the job hangs: no progress on any rank for \d+ s", err), err[-3000:]
    assert "the ranks wait in different collectives (rank 0 in all_reduce, rank 1 in barrier)" in err, err[-3000:]
    assert re.search(r"error: rank 0: eval, waits in all_reduce at .*sum_to_host\(\)", err), err[-3000:]
    assert re.search(r"error: rank 1: eval, waits in barrier at tests/hang_tasks.py:\d+ loss\(\)", err), err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_collective_mismatch_that_aborts_a_rank_is_said_as_one(tmp_path):
    """Rank 0 all-reduces 3 numbers and rank 1 five: gloo aborts the receiver ("Received data size doesn't match
    expected size"), whose stacks faulthandler writes; the other says a collective mismatch, naming the operation,
    the ranks and the task's frame, never "another process is gone ... resume it". Broken on purpose: a failure path
    that does not look for an aborted peer (failures.py) fails it."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", "size"]
    result = launch(flags, env=env(FAULT="size", AT=5), timeout=120)
    err = result.stderr
    assert result.returncode != 0
    said = re.search(r"error: on rank (\d): a collective mismatch: rank (\d) aborted in all_reduce at (\S+)", err)
    assert said, err[-3000:]
    assert said[1] != said[2] and said[3] == "tests/hang_tasks.py:" + said[3].split(":")[1]
    assert "this rank was in all_reduce at tests/hang_tasks.py" in err
    assert "another process of the job is gone" not in err and "--resume auto" not in err


# what torch's ProcessGroupNCCL raises or prints when its watchdog aborts (as torch 2.4 to 2.11 word it)
NCCL_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog "
    "caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLGATHER, NumelIn=1, NumelOut=4, "
    "Timeout(ms)=600000) ran for 600004 milliseconds before timing out."
)
NCCL_CUDA = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: CUDA error: an "
    "illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there was "
    "a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
    "process exiting prematurely."
)


@pytest.mark.timeout(30)
def test_nccl_s_own_abort_is_named_as_such_never_a_collective_mismatch():
    """NCCL's watchdog ends a process after a collective ran past --dist-timeout, or after an NCCL or a CUDA error;
    the ranks it did not end see their communicator aborted. Each such error is named as NCCL's abort with its cause,
    and a peer whose process aborted (its stacks file) is said within it, never as gloo's collective mismatch. A bug
    in the main thread (a CUDA error raised there, a shape error) and gloo's lost peer are not NCCL's abort. Broken on
    purpose: watchdog.nccl_abort that finds none (NCCL_ABORTS empty) fails it."""
    from torch.distributed import DistBackendError

    from ddp_tricks.distributed import watchdog

    said = {
        NCCL_TIMEOUT: "NCCL's watchdog: a collective ran past --dist-timeout ([PG ID 0",
        NCCL_CUDA: "NCCL's watchdog found a CUDA error ([PG ID 0",
        "NCCL communicator was aborted on rank 1.": "NCCL's watchdog aborted the communicator after a failure",
        NCCL_REMOTE: "an NCCL error (NCCL error in: ",
    }
    for text, cause in said.items():
        assert str(watchdog.nccl_abort(DistBackendError(text))).startswith(cause), text
    assert watchdog.nccl_abort(RuntimeError("CUDA error: device-side assert triggered")) is None  # the main thread's
    assert watchdog.nccl_abort(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert watchdog.nccl_abort(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection reset by peer")) is None
    assert watchdog.nccl_abort(ValueError(NCCL_TIMEOUT)) is None  # not a collective's

    try:
        raise DistBackendError("NCCL communicator was aborted on rank 0.")
    except DistBackendError as error:
        nccl = watchdog.nccl_abort(error)
        line = failures.nccl_aborted({1: "all_reduce at ddp_tricks/training/loop.py:350 evaluate()"}, error, nccl)
    assert line.startswith("NCCL's watchdog aborted the communicator after a failure on a rank (NCCL communicator")
    assert "; rank 1 aborted in all_reduce at ddp_tricks/training/loop.py:350 evaluate();" in line
    assert "mismatch" not in line and "gloo" not in line
    remote = RuntimeError(NCCL_REMOTE)  # a peer's abort seen by a rank whose error names no cause: said alike
    assert failures.nccl_aborted({0: "broadcast"}, remote, None).startswith("NCCL's watchdog took a process down (")


@pytest.mark.timeout(30)
def test_a_peer_that_aborted_in_a_template_read_names_the_collective_it_waited_for(tmp_path):
    """On nccl a rank aborts (NCCL's watchdog) while its host waits in the template's read of a collective's result,
    outside any torch.distributed call: its faulthandler stacks name the read, and its peer says the collective and
    the caller. Broken on purpose: stacks._aborted_at without the template's marked reads fails it ("a collective
    at ...collectives.py")."""
    from ddp_tricks.distributed import collectives, stacks

    read = collectives.sum_to_host.__code__.co_filename
    (tmp_path / "stacks-rank0.txt").write_text(
        f"{stacks.ABORTED}\n\nThread 0x00007f (most recent call first):\n"
        f'  File "{read}", line 38 in sum_to_host\n'
        f'  File "{stacks._PACKAGE / "training" / "loop.py"}", line 350 in evaluate\n'
        f'  File "{stacks._PACKAGE.parent / "run.py"}", line 128 in train\n'
    )
    found = stacks.aborted_peers(tmp_path, 1, 2, wait=1.0)
    assert found == {0: "all_reduce at ddp_tricks/training/loop.py:350 evaluate()"}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["eval", "first", "save", "figures"])
def test_long_legitimate_work_raises_no_alarm(tmp_path, fault):
    """Rank 0 spends 8 s in a slow evaluation, a first step that compiles, a checkpoint write, or its figures, while
    rank 1 waits (or has finished): far beyond --hang-timeout 2 x --hang-factor 2 and --heartbeat-timeout 4. The run
    ends normally, its stacks files gone. Broken on purpose: every phase judged as training (heartbeat.py) fails
    eval, first and save; a heartbeat that stops at a normal end without saying so fails figures."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", fault, "--checkpoint-every-steps", "5"]
    flags += ["--hang-timeout", "2", "--hang-factor", "2", "--heartbeat-timeout", "4"]
    result = launch(flags, env=env(FAULT=fault, SLOW=8), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hangs" not in result.stderr
    assert not list((tmp_path / fault).glob("stacks-rank*.txt"))


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_restarts_a_job_whose_rank_stopped_and_finishes_bit_identical(tmp_path):
    """Under `torchrun --max-restarts 1`, rank 1 stops at its 50th step: the watchdog ends rank 0 and kills the
    stopped rank, torchrun restarts the job, and `--resume auto` continues from the step-40 checkpoint to the same
    weights and metrics as an uninterrupted run. Broken on purpose: a stopped rank left to torchrun (no end_silent: its
    SIGTERM waits, its SIGKILL comes 30 s later) fails it."""
    flags = [*TASK, "--batch-size", "4", "--epochs", "1", "--checkpoint-every-steps", "20", "--runs-dir", tmp_path]
    reference = launch([*flags, "-n", "reference"], timeout=180)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "restarted"
    cmd = torchrun_command([*flags, "-n", "restarted", "--resume", "auto", "--heartbeat-timeout", "5"])
    cmd.insert(cmd.index("--standalone") + 1, "--max-restarts=1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(FAULT="stop", AT=50))  # fmt: skip
    try:
        wait_for(lambda: (run_dir / "workers.json").exists() or proc.poll() is not None, 120, "the workers")
        pids = json.loads((run_dir / "workers.json").read_text())["pids"]
        wait_for(lambda: state(pids[1]) == "T" or proc.poll() is not None, 120, "rank 1 to stop")
        stopped = time.monotonic()
        shutil.copy(run_dir / "last.pt", tmp_path / "restarted-from.pt")  # rank 0 waits for rank 1: no new one
        wait_for(lambda: state(pids[1]) != "T", 120, "the stopped rank to end")
        ended = time.monotonic() - stopped  # torchrun's own SIGKILL would come 30 s after its SIGTERM
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "error: the job hangs: rank 1 is silent" in err
    assert ended < 5 + 15, ended
    assert torch.load(tmp_path / "restarted-from.pt", weights_only=True)["global_step"] == 40
    assert_resumed(out, tmp_path / "restarted-from.pt", final_step(tmp_path / "reference"))
    assert rows(run_dir) == rows(tmp_path / "reference")
    a = torch.load(run_dir / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "reference" / "last.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("g++")), reason="torch.compile on CPU needs a C compiler")
def test_a_real_compile_raises_no_alarm(tmp_path):
    """`--compile` for real, 2 ranks, thresholds of 2 to 4 s: the first step compiles for seconds, and so does the
    epoch's last, shorter step (a recompile at step 23) and the first evaluation. The run ends normally. Broken on
    purpose: a compile not told apart from a hang (stacks.compiling) fails it at step 23."""
    flags = ["--no-progress", *SHORT, "--runs-dir", tmp_path, "-n", "compiled", "--compile"]
    flags += ["--hang-timeout", "2", "--hang-factor", "2", "--heartbeat-timeout", "4"]
    result = launch(flags, env=env(TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor"), timeout=360)  # compiles in full
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hangs" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ordinary_steps_slower_than_the_hang_timeout_raise_no_alarm(tmp_path):
    """Every training step from the 2nd to the 5th takes 3 s on both ranks, at --hang-timeout 1 --hang-factor 3: a
    healthy job whose ordinary steps are longer than --hang-timeout. The watchdog's deadline is max(3 x the slowest
    step seen, 1 s) = 9 s once a slow step has been timed, and before the first ordinary step has been timed a
    training step is judged as long legitimate work is; the run ends normally. Broken on purpose: a training step
    held to the deadline before an ordinary step is timed (heartbeat's `timed` without `slowest > 0`, the rule before
    this test) ends it as hung at step 2 (exit 4, "the slowest step 0 s")."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", "slow", "--hang-timeout", "1", "--hang-factor", "3"]
    result = launch([*flags, "--heartbeat-timeout", "6"], env=env(FAULT="slow", AT=5, SLOW=3), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hangs" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_step_slower_than_the_deadline_still_ends_as_hung(tmp_path):
    """Steps 2 to 7 take 1.5 s on both ranks, then rank 0 sleeps 40 s in step 8 while rank 1 waits in DDP's backward
    (a collective in C++, no torch.distributed call on its stack): at --hang-timeout 1 --hang-factor 3 the deadline is
    max(3 x 1.5 s, 1 s) = 4.5 s, and the job ends as hung within seconds of it, the slowest step it names measured.
    Broken on purpose: the slowest step never recorded (`_slowest` stays 0 in heartbeat.step) fails it: the stall is
    then judged as long legitimate work and the job runs on."""
    flags = [*TASK, *SHORT, "--runs-dir", tmp_path, "-n", "stall", "--hang-timeout", "1", "--hang-factor", "3"]
    started = time.monotonic()
    result = launch([*flags, "--heartbeat-timeout", "6"], env=env(FAULT="stall", AT=8, STEP=1.5, SLOW=40), timeout=180)
    seconds = time.monotonic() - started
    assert result.exitcodes == [4, 4], (result.exitcodes, result.stderr[-3000:])
    found = re.search(
        r"no progress on any rank for (\d+) s \(max\(--hang-factor 3 x the slowest step ([\d.]+) s", result.stderr
    )
    assert found, result.stderr[-3000:]
    assert 4.5 <= float(found[1]) < 15 and 1.5 <= float(found[2]) < 3, found.groups()
    assert seconds < 40, seconds  # ended by the watchdog, not by rank 0 waking up
    assert re.search(r"error: rank 0: train step 8, is at tests/hang_tasks.py:\d+ loss\(\)", result.stderr)
