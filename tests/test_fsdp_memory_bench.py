"""bench/fsdp_memory.py on a machine with fewer GPUs than its world sizes: it runs the world sizes the GPUs allow,
one GPU per rank, says which it skips, and a rank that dies ends the run within seconds (it waited 900 s)."""

import sys
import time
from types import SimpleNamespace

import pytest
import torch
from multiproc import REPO

sys.path.insert(0, str(REPO / "bench"))
import fsdp_memory  # noqa: E402
import plain_ranks  # noqa: E402  (spawned ranks import it, not this module and its torch)


@pytest.mark.parametrize(
    "device, gpus, runs, skipped",
    [("cuda", 1, [1], [2, 3]), ("cuda", 2, [1, 2], [3]), ("cuda", 8, [1, 2, 3], []), ("cpu", 0, [1, 2, 3], [])],
)
def test_world_sizes_are_those_the_gpus_allow(device, gpus, runs, skipped):
    assert fsdp_memory.world_sizes([1, 2, 3], device, gpus) == (runs, skipped)


def test_each_rank_gets_its_own_gpu_and_larger_worlds_are_skipped_and_said(monkeypatch, capsys):
    # Two GPUs faked: world sizes 1 and 2 run (rank r on cuda:r), 3 is skipped with a line that says why.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(sys, "argv", ["fsdp_memory.py", "--device", "cuda", "--width", "8"])
    ran = []

    def fake_run_world(world_size, args):
        ran.append((world_size, [str(fsdp_memory.device_for(rank, args.device)) for rank in range(world_size)]))
        row = {"bytes": {"parameters": 8, "gradients": 8, "optimizer": 16}, "step_seconds": 0.01}
        return {"ddp": row, "fsdp": row}

    monkeypatch.setattr(fsdp_memory, "run_world", fake_run_world)
    fsdp_memory.main()
    assert ran == [(1, ["cuda:0"]), (2, ["cuda:0", "cuda:1"])]
    out = capsys.readouterr().out
    assert "world size(s) 3 skipped: each rank needs a GPU of its own, and 2 are visible" in out
    assert str(fsdp_memory.device_for(1, "cpu")) == "cpu"


@pytest.mark.timeout(120)
def test_a_rank_that_dies_ends_the_run_within_seconds():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="world size 2: rank 1 exited with code 3 before rank 0 reported"):
        fsdp_memory.run_world(2, SimpleNamespace(), target=plain_ranks.dies_on_rank_1, timeout=900)
    assert time.monotonic() - start < 10  # rank 0 killed at once: it waited 900 s, then 10 s more, before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA: its ranks must fail")
@pytest.mark.timeout(120)
def test_cuda_ranks_that_cannot_start_end_the_bench_with_one_line(monkeypatch):
    # The case: --device cuda where a rank cannot use its GPU. One GPU is faked in the parent only, so
    # world size 1 starts and its rank fails in torch.cuda.set_device; the parent says so within seconds.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["fsdp_memory.py", "--device", "cuda", "--width", "8", "--steps", "1"])
    start = time.monotonic()
    with pytest.raises(SystemExit, match="^error: world size 1: rank 0 exited with code 1 before reporting"):
        fsdp_memory.main()
    assert time.monotonic() - start < 60
