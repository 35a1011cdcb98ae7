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
