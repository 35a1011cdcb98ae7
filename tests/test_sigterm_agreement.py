"""The SIGTERM agreement's pairing by step count (distributed/preemption.py), two ranks simulated by threads over one
store: every rank stops after the same step however far one rank's host runs ahead of the other's (nccl lets a host
run ahead of its device, and so of the other ranks), within 2K steps of the signal. The real ranks, the signal and
the checkpoint are test_resume.py's."""

from __future__ import annotations

import threading
import time
import types

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
    `_look` removed: rank 0 runs to the end, 400 steps)."""
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
