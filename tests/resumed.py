"""A resumed run started where its checkpoint says, and took only the steps the checkpoint lacked: read from the
run's own log (training/state.py writes the two lines). Training is deterministic, so a silent fresh restart ends
bit-identical to a resume; these lines tell them apart."""

from __future__ import annotations

import re
from pathlib import Path

from ddp_tricks.storage import checkpoint

RESUMED = re.compile(
    r"^resumed from (?P<path>.+): epoch (?P<epoch>\d+) done, (?P<step>\d+) step\(s\) into epoch (?P<next>\d+), "
    r"global step (?P<global_step>\d+)$",
    re.MULTILINE,
)
TOOK = re.compile(
    r"^(?P<steps>\d+) optimizer step\(s\) in this process \(global steps (?P<first>\d+) -> (?P<last>\d+)\)$",
    re.MULTILINE,
)


def saved_state(saved: dict | str | Path) -> dict:
    """A checkpoint's state: `saved` itself, or read from a last.pt/best.pt file or a sharded folder (last.dcp)."""
    if isinstance(saved, dict):
        return saved
    path = Path(saved)
    return checkpoint.load(path, "fsdp" if path.is_dir() else "ddp")


def took(output: str) -> tuple[int, int, int]:
    """A training run's (optimizer steps this process took, the global step it began at, the one it ended at), from
    its one 'optimizer step(s) in this process' line."""
    lines = list(TOOK.finditer(output))
    assert len(lines) == 1, f"not one 'optimizer step(s) in this process' line in the output:\n{output[-3000:]}"
    return int(lines[0]["steps"]), int(lines[0]["first"]), int(lines[0]["last"])


def final_step(run_dir: str | Path) -> int:
    """The global step of a finished run's last checkpoint (last.pt, or sharded last.dcp): the run's total steps."""
    run_dir = Path(run_dir)
    return saved_state(run_dir / "last.pt" if (run_dir / "last.pt").exists() else run_dir / "last.dcp")["global_step"]


def assert_resumed(output: str, saved: dict | str | Path, total_steps: int) -> None:
    """`output` (a resumed process's stdout, or its train.log) says it resumed from the checkpoint `saved` (its
    state, read BEFORE the resume overwrote it, or a copy's path): its first step is the checkpoint's (epoch, step in
    the epoch, global step), and it took `total_steps` minus the checkpoint's global step optimizer steps, ending at
    global step `total_steps` (the run's total; for a resumed run stopped again, the step its next checkpoint says)."""
    state = saved_state(saved)
    resumed = list(RESUMED.finditer(output))
    assert len(resumed) == 1, f"not one 'resumed from' line in the output:\n{output[-3000:]}"
    start = {k: int(resumed[0][k]) for k in ("epoch", "step", "next", "global_step")}
    expected = {"epoch": state["epoch"], "step": state.get("step_in_epoch", 0), "next": state["epoch"] + 1}
    assert start == expected | {"global_step": state["global_step"]}, (start, resumed[0][0])
    steps = took(output[resumed[0].end() :])  # after the resume, in the same process
    assert steps == (total_steps - state["global_step"], state["global_step"], total_steps), steps
