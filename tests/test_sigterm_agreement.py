"""The SIGTERM agreement's pairing by step count (distributed/preemption.py), two ranks simulated by threads over one
store: every rank stops after the same step however far one rank's host runs ahead of the other's (nccl lets a host
run ahead of its device, and so of the other ranks), within 2K steps of the signal; and under a real torchrun, each
worker's own exit code. The warm ranks' signal, checkpoint and resume are test_resume.py's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import types

import multiproc
import pytest
import torch.distributed as dist

from ddp_tricks.distributed import preemption


def _agreements(store) -> list[preemption.Preemption]:
    """Two ranks' agreements in this process, under one key as two processes' first agreements are."""
    made = [
        preemption.Preemption(types.SimpleNamespace(world_size=2, rank=rank, control_group=None, store=store))
        for rank in (0, 1)
    ]
    for agreement in made:
        agreement.prefix = made[0].prefix
    return made


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signalled", [0, 1])
def test_ranks_stop_after_the_same_step_with_one_host_far_ahead(signalled):
    """Rank 0 steps with no pause, rank 1 with 2 ms per step: without the wait for every rank's arrival at the key it
    reads, rank 0 reads the keys before rank 1 has added to them and trains on (broken on purpose: the `while` in
    `_arrived` removed: rank 0 runs to the end, 400 steps)."""
    agreements, signal_at = _agreements(dist.HashStore()), 13
    stopped: dict[int, int] = {}

    def rank(r: int, pause: float) -> None:
        for step in range(1, 400):
            if r == signalled and step == signal_at:
                agreements[r].requested = True  # what the SIGTERM handler sets
            if agreements[r].agreed():
                stopped[r] = step
                return
            time.sleep(pause)
        stopped[r] = 400

    threads = [threading.Thread(target=rank, args=(r, pause), daemon=True) for r, pause in ((0, 0.0), (1, 0.002))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        for agreement in agreements:
            agreement.close()
    assert stopped[0] == stopped[1], stopped
    assert signal_at < stopped[0] <= signal_at + 2 * preemption.MOST_STEPS, stopped


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_torchrun_each_worker_ends_with_its_own_143(tmp_path):
    """SIGTERM to one worker of a real torchrun job: both stop at the agreed step and each ends with its own 143, as
    torchrun reports them. Broken on purpose: a SIGTERM handler that does nothing (preemption.py's `_on_signal`): the
    job trains on and the wait for its end runs out. What `launch.cleanup`'s `ignore_sigterm()` prevents (the
    interpreter's end gives SIGTERM its default action back, and the SIGTERM torchrun sends the other worker once one
    has ended then ends it as -15) came in 7 of 9 runs of this scenario by hand, signalled later in the run, and in
    none of 7 under this test: the test checks the exit codes, it does not reproduce that race."""
    args = ["-n", "pre", "--runs-dir", str(tmp_path), "-e", "2000", "--no-progress", "-b", "32"]
    logs = tmp_path / "out.txt", tmp_path / "err.txt"  # files, as a scheduler's job writes them
    with logs[0].open("w") as out, logs[1].open("w") as err:
        job = subprocess.Popen(multiproc.torchrun_command(args), cwd=multiproc.REPO, stdout=out, stderr=err,
                               start_new_session=True)  # fmt: skip
        try:
            workers = tmp_path / "pre" / "workers.json"
            deadline = time.monotonic() + 150
            while not workers.exists() and time.monotonic() < deadline and job.poll() is None:
                time.sleep(0.05)
            time.sleep(2)  # training under way
            os.kill(json.loads(workers.read_text())["pids"][1], signal.SIGTERM)
            job.wait(timeout=60)
        finally:
            if job.poll() is None:  # the launcher, and its workers (each in a process group of its own)
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            for pid in json.loads(workers.read_text())["pids"] if workers.exists() else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    out, err = (path.read_text() for path in logs)
    assert "preempted" in out, (out[-2000:], err[-3000:])
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", err, re.M)  # torchrun's report, a line per worker
    assert sorted(codes) == ["143", "143"], err[-3000:]
