"""tools/sweep.py and tools/plot_runs.py loaded as modules; a sweep whose cells are recorded instead of run, and one
whose cells run on the tests' warm ranks."""

from __future__ import annotations

import importlib.util
import subprocess

from multiproc import REPO, launch, torchrun_command


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sweep():
    return load_tool("sweep")


def recording_sweep(monkeypatch):
    """(the sweep module, the list its cells' commands are appended to): no cell runs, no figure is drawn."""
    sweep, commands = load_sweep(), []
    monkeypatch.setattr(sweep, "summarise", lambda run_dir, metric, target=None: {})
    monkeypatch.setattr(sweep.run_folder, "read_config", lambda run_dir: {})
    monkeypatch.setattr(sweep, "over_seeds", lambda runs: {})
    monkeypatch.setattr(sweep, "write_results", lambda *a: None)
    monkeypatch.setattr(sweep.plots, "accuracy_vs_batch", lambda *a: None)
    monkeypatch.setattr(sweep.plots, "overlay", lambda *a: None)
    monkeypatch.setattr(
        sweep.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    return sweep, commands


def warm_sweep(monkeypatch):
    """The sweep module whose cells, the torchrun commands it builds, run on the tests' warm ranks (multiproc.launch)
    with that command's process count and arguments; anything else it runs, as it is. A cell's command must be,
    word for word, the torchrun command that other tests run for real (multiproc.torchrun)."""
    sweep, real_run = load_sweep(), subprocess.run

    def run(cmd, **kw):
        if cmd[1:3] != ["-m", "torch.distributed.run"]:
            return real_run(cmd, **kw)
        nproc = int(next(a for a in cmd if a.startswith("--nproc_per_node=")).split("=")[1])
        flags = cmd[cmd.index(str(REPO / "run.py")) + 1 :]
        assert cmd == torchrun_command(flags, nproc), cmd
        return launch(flags, nproc=nproc, cwd=kw.get("cwd"))

    monkeypatch.setattr(sweep.subprocess, "run", run)
    return sweep
