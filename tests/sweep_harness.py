"""tools/sweep.py loaded as a module, and a sweep whose cells are recorded instead of run."""

from __future__ import annotations

import importlib.util
import subprocess

from multiproc import REPO


def load_sweep():
    spec = importlib.util.spec_from_file_location("sweep", REPO / "tools" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
