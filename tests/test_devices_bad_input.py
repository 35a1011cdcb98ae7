"""Device and backend mistakes on a machine without a GPU: one line on stderr, exit code 2, nothing written,
before any process group forms. The machine is made GPU-less here, so these run the same on a GPU machine."""

import pytest
import torch
from multiproc import free_port

import run

CASES = {  # flags, processes, what the line must say
    "device cuda without a GPU": (["--device", "cuda"], 1, "--device cuda"),
    "device cuda without a GPU, 2 processes": (["--device", "cuda"], 2, "--device cuda"),
    "backend nccl on 2 CPU processes": (["--backend", "nccl"], 2, "--backend nccl needs CUDA"),
    "sync-bn on 2 CPU processes": (["--sync-bn"], 2, "--sync-bn needs CUDA"),
}


@pytest.mark.parametrize("argv, processes, message", CASES.values(), ids=CASES.keys())
def test_device_mistake_is_one_line_and_exit_2(argv, processes, message, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if processes > 1:  # rank 0 of 2, as torchrun starts it: the mistake must be found before it waits for rank 1
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
    flags = [*argv, "-e", "1", "--runs-dir", str(tmp_path), "--no-progress", "--dist-timeout", "5"]
    assert run.main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "visible, local_rank, chosen",
    [(1, 0, "cuda:0"), (1, 1, "cuda:0"), (1, 7, "cuda:0"), (4, 0, "cuda:0"), (4, 3, "cuda:3"), (8, 5, "cuda:5")],
)
def test_each_process_takes_the_gpu_of_its_local_rank_or_the_one_it_sees(visible, local_rank, chosen, monkeypatch):
    # One GPU visible per process (SLURM --gpu-bind, one container per GPU): every rank uses it as cuda:0.
    from ddp_tricks.distributed.launch import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    for flag in ("auto", "cuda"):
        assert choose_device(flag, local_rank) == torch.device(chosen)
    assert choose_device("cpu", local_rank) == torch.device("cpu")


def test_more_local_ranks_than_visible_gpus_is_one_line_naming_the_rank(monkeypatch):
    from ddp_tricks.distributed.launch import choose_device
    from ddp_tricks.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="^local rank 2 has no GPU: only 2 visible") as raised:
        choose_device("auto", 2)
    assert raised.value.rank_specific


def test_two_ranks_on_one_gpu_under_nccl_are_refused_by_the_second(monkeypatch):
    # Two processes of a node that see the same single GPU both choose cuda:0; nccl cannot put two ranks on one
    # GPU, so the second to count itself on its id in the rendezvous store says so (one line, naming its rank).
    import torch.distributed as dist

    from ddp_tricks.distributed.launch import refuse_shared_gpu
    from ddp_tricks.errors import UserError

    store = dist.HashStore()
    refuse_shared_gpu(store, "GPU-aaaa", 0)
    refuse_shared_gpu(store, "GPU-bbbb", 1)  # its own GPU: fine
    with pytest.raises(UserError, match=r"^rank 2 shares its GPU \(GPU-aaaa\) with another rank") as raised:
        refuse_shared_gpu(store, "GPU-aaaa", 2)
    assert raised.value.rank_specific
