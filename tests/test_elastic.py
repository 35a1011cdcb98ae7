"""torchrun elastic on one machine: two agents (`--nnodes=1:2`, one process each, c10d rendezvous on 127.0.0.1). A
node that dies mid-epoch (its agent's process group and its worker killed with -9) leaves the other to re-form the
job alone and finish it from the last checkpoint, with no change to the command; a node that joins a running
one-node job is taken in at the next restart. Each agent runs in a session of its own, as on a machine of its own."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from multiproc import REPO, free_port, launch
from resumed import assert_resumed, final_step

from ddp_tricks.storage import checkpoint

# 180 steps an epoch at the global batch 8: a kill lands well inside an epoch, a few steps after a checkpoint.
FLAGS = ["--epochs", "2", "--batch-size", "4", "--checkpoint-every-steps", "20", "--no-progress"]
# A node that stops sending heartbeats is dropped after 3 missed 1 s beats (default 3 x 5 s); a round that has
# its minimum of nodes waits 3 s more for others (default 30 s). Together: a survivor re-forms in about 5 s.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
# torch's default shares the agent's rendezvous store with the workers; a round that takes in a new node then waits
# for a key that no agent writes (the node that stays group rank 0 does not publish its address again) until the
# store's 60 s read timeout, and both agents fail. Without sharing, each round's rank-0 worker starts its own store.
ENV = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TIMING = {"epoch_seconds", "samples_per_second"}
BN_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def weights(run_dir):
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


def workers(run_dir) -> dict:
    """workers.json (rank 0 writes it after the checkpoint is restored); {} while absent or half-written."""
    try:
        return json.loads((run_dir / "workers.json").read_text())
    except (OSError, ValueError):
        return {}


def ranks(run_dir) -> int:
    return len(workers(run_dir).get("pids", []))


def restarts(run_dir) -> int:
    """torchrun's restart count when the job's workers last started (a node joining does not count)."""
    return int(workers(run_dir).get("restart", 0))


def wait_for(predicate, timeout: float, what: str, nodes=()) -> None:
    """Until `predicate()`; fails after `timeout` seconds, or as soon as an agent of `nodes` has ended (with its
    log's end)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for node in nodes:
            if node.poll() is not None:
                raise AssertionError(f"waiting for {what}, an agent ended (exit {node.returncode}):\n{tail(node.log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def sigterm_pending(pid: int) -> bool:
    """SIGTERM sent to `pid` and not yet delivered (the process is stopped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            pending = next(line for line in f if line.startswith("ShdPnd:"))
    except (OSError, StopIteration):
        return False
    return bool(int(pending.split()[1], 16) & 1 << (signal.SIGTERM - 1))


def written_since(path, moment: float) -> bool:
    return path.exists() and path.stat().st_mtime >= moment


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the agent's workers: torchrun starts each in a session of its own, so
    they are not in the agent's process group)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its agent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def agent(args: list[str], port: int, hosts_store: bool, log: Path) -> subprocess.Popen:
    """One node: `torchrun --nnodes=1:2 --nproc_per_node=1 ... run.py ARGS` in a session of its own. Both agents see
    127.0.0.1 as their own address, so which would host the rendezvous store is a race: `is_host` decides it (the
    node that hosts it must outlive the job: the c10d backend keeps the job's state there)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic",
        f"--rdzv-conf={RDZV_CONF},is_host={int(hosts_store)}",
        str(REPO / "run.py"),
        *args,
    ]
    with open(log, "w") as out:  # the child keeps its own copy of the file descriptor
        node = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    node.log = log
    return node


def kill_node(node: subprocess.Popen) -> None:
    """A machine dies: its agent (with its process group) and its workers, all with -9."""
    node_workers = children(node.pid)  # before the agent goes: orphaned workers get another parent
    for group in (node.pid, *node_workers):  # each worker leads a process group of its own
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait(timeout=30)


def tail(path, chars: int = 3000) -> str:
    """An agent's log for a failure message: the run's own error lines, then the log's end."""
    text = path.read_text(errors="replace")
    errors = dict.fromkeys(line for line in text.splitlines() if line.startswith("error:"))
    return "\n".join(errors) + "\n...\n" + text[-chars:]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = launch([*FLAGS, "-n", "full", "--runs-dir", str(runs)])
    assert result.returncode == 0, result.stderr[-3000:]
    return runs / "full"


@pytest.fixture(scope="module")
def lost_node(tmp_path_factory):
    """Two nodes train; one is killed mid-epoch, a few steps after a checkpoint; the other finishes alone. Returns
    the run folder, a copy of it as the survivor found it (holding the checkpoint it resumed from), and that
    checkpoint's state."""
    root = tmp_path_factory.mktemp("elastic")
    run_dir, copy = root / "runs" / "lost", root / "by_hand" / "lost"
    args = [*FLAGS, "-n", "lost", "--runs-dir", str(root / "runs"), "--resume", "auto"]
    port = free_port()
    start = time.monotonic()
    survivor, lost = agent(args, port, True, root / "a.log"), agent(args, port, False, root / "b.log")
    try:
        wait_for(lambda: ranks(run_dir) == 2, 120, "the job to start on 2 nodes", (survivor, lost))
        started = (run_dir / "workers.json").stat().st_mtime
        wait_for(lambda: written_since(run_dir / "last.pt", started), 120, "a checkpoint", (survivor, lost))
        old_workers = children(survivor.pid)
        killed = time.monotonic()
        kill_node(lost)
        # The survivor's worker fails in its next collective (gloo: connection reset by peer) and exits.
        wait_for(lambda: not any(alive(pid) for pid in old_workers), 60, "the survivor's worker to fail")
        failed = time.monotonic()
        # Nothing writes the run folder until the survivor's agent has re-formed the job (6 s at the least) and its
        # new worker has started: this copy holds the checkpoint that worker resumes from.
        shutil.copytree(run_dir, copy)
        resumed_from = checkpoint.load(copy / "last.pt")
        wait_for(lambda: restarts(run_dir) > 0, 120, "the survivor to resume", (survivor,))
        resumed = time.monotonic()
        code = survivor.wait(timeout=300)
        done = time.monotonic()
    finally:
        for node in (survivor, lost):
            if node.poll() is None:
                kill_node(node)
    assert resumed_from["step_in_epoch"] > 0  # written mid-epoch, by 2 ranks
    assert code == 0, tail(survivor.log)
    timings = {
        "start to kill": killed - start,
        "kill to the survivor's worker gone": failed - killed,
        "kill to resumed on 1 node": resumed - killed,
        "kill to done": done - killed,
    }
    print("lost node:", ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return run_dir, copy, resumed_from


@pytest.mark.xdist_group("elastic")  # on one worker: the module's runs are made once
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_node_killed_mid_epoch_leaves_the_other_to_finish_the_run_with_its_global_batch(uninterrupted, lost_node):
    run_dir, _, resumed_from = lost_node
    finished = workers(run_dir)
    assert len(finished["pids"]) == 1 and finished["restart"] == "1"  # alone, after one restart
    log = (run_dir.parent.parent / "a.log").read_text(errors="replace")  # the survivor's: a lost peer is not a bug
    assert_resumed(log, resumed_from, final_step(uninterrupted))  # from the checkpoint it found, the steps it lacked
    assert re.search(r"error: on rank \d: another process of the job is gone \(killed, or its node lost: ", log), log[
        -3000:
    ]
    assert 'run.py", line' not in log  # no traceback of run.py's
    full, elastic = rows(uninterrupted), rows(run_dir)
    assert [r["epoch"] for r in elastic] == [r["epoch"] for r in full]  # metrics.csv continued, not duplicated
    assert [r["step"] for r in elastic] == [r["step"] for r in full]  # the same optimizer steps
    assert [float(r["global_batch"]) for r in elastic] == [float(r["global_batch"]) for r in full]
    # Parameters equal up to the order of float sums. BatchNorm's running statistics are left out: under DDP they
    # follow rank 0's micro-batches only (rank 0's buffers are broadcast), on one process every micro-batch's.
    a, b = weights(run_dir), weights(uninterrupted)
    assert a.keys() == b.keys()
    worst = max(relative_difference(a[k].double(), b[k].double()) for k in a if not k.endswith(BN_RUNNING))
    assert worst < 1e-4, worst


@pytest.mark.xdist_group("elastic")
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_the_survivor_ends_bit_identical_to_its_checkpoint_resumed_by_hand_on_one_process(lost_node):
    run_dir, copy, resumed_from = lost_node  # the run folder as the survivor found it
    by_hand = launch([*FLAGS, "-n", "lost", "--runs-dir", str(copy.parent), "--resume", "auto"], nproc=1)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert_resumed(by_hand.stdout, resumed_from, final_step(run_dir))
    assert rows(copy) == rows(run_dir)
    a, b = weights(copy), weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.xdist_group("elastic")
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_node_that_joins_a_running_job_is_taken_in_at_the_next_restart(uninterrupted, tmp_path):
    # One node trains at the global batch 8 (4 x accumulation 2); a second joins: the running agent stops its
    # worker with SIGTERM (which checkpoints mid-epoch and exits 143), and both resume as 2 ranks x 4.
    run_dir = tmp_path / "runs" / "joined"
    args = [*FLAGS, "--accum-steps", "2", "-n", "joined", "--runs-dir", str(tmp_path / "runs"), "--resume", "auto"]
    port = free_port()
    first, second = agent(args, port, True, tmp_path / "a.log"), None
    try:
        wait_for((run_dir / "last.pt").exists, 120, "a checkpoint of the first node", (first,))
        # One node trains the whole run in about as long as a second takes to start: the first one's worker is
        # held (SIGSTOP) until its agent, seeing the newcomer, has sent it SIGTERM, so that lands mid-epoch.
        (worker,) = children(first.pid)
        os.kill(worker, signal.SIGSTOP)
        joins = time.monotonic()
        second = agent(args, port, False, tmp_path / "b.log")
        wait_for(lambda: sigterm_pending(worker), 120, "the first agent to stop its worker", (first, second))
        os.kill(worker, signal.SIGCONT)
        wait_for(lambda: not alive(worker), 120, "the first node's worker to stop", (first, second))
        # nothing writes the run folder until the job has re-formed on 2 nodes and trained 20 steps
        resumed_from = checkpoint.load(run_dir / "last.pt")
        wait_for(lambda: ranks(run_dir) == 2, 120, "the job to resume on 2 nodes", (first, second))
        resumed = time.monotonic()
        codes = first.wait(timeout=300), second.wait(timeout=60)
    finally:
        for node in (first, second):
            if node is not None and node.poll() is None:
                kill_node(node)
    print(f"joined node: start of the second agent to resumed on 2 nodes {resumed - joins:.1f} s")
    assert codes == (0, 0), tail(first.log) + tail(second.log)
    assert re.search(r"preempted at epoch \d+, step \d+: last\.pt written", first.log.read_text())  # mid-epoch
    assert workers(run_dir)["restart"] == "0"  # a node joining is not a failure: it uses none of --max-restarts
    # the resumed job's rank 0 logs on either node: the two logs together hold one resume
    assert_resumed(first.log.read_text() + second.log.read_text(), resumed_from, final_step(uninterrupted))
    full, elastic = rows(uninterrupted), rows(run_dir)
    assert [r["step"] for r in elastic] == [r["step"] for r in full]
    assert [float(r["global_batch"]) for r in elastic] == [float(r["global_batch"]) for r in full]
    a, b = weights(run_dir), weights(uninterrupted)
    worst = max(relative_difference(a[k].double(), b[k].double()) for k in a if not k.endswith(BN_RUNNING))
    assert worst < 1e-4, worst
