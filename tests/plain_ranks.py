"""Targets for freshly spawned test processes that need no torch: such a process starts in a fraction of a second
instead of the 5 s of CPU that importing torch costs (importing a test module that imports torch would)."""

from __future__ import annotations

import time


def dies_on_rank_1(rank, world_size, port, args, queue):
    """Rank 1 fails at once; rank 0 would wait for it far longer than the test allows (as in a collective)."""
    if rank == 1:
        raise SystemExit(3)
    time.sleep(600)
