"""A run is a folder: runs/<name>/ holds config.json, metrics.csv, train.log, workers.json and TensorBoard events
(beside the checkpoints and plots). Rank 0 writes; an existing run is never overwritten silently.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_tricks.errors import UserError

log = logging.getLogger("ddp_tricks")
RUN_FILES = ("metrics.csv", "last.pt", "best.pt", "last.dcp")  # what makes a folder hold a run
STARTED_FILES = ("config.json", "train.log", "workers.json")  # what a start writes before any of those


def check(path: Path, resume: bool, overwrite: bool) -> None:
    """Before any process group: the folder can be written, and holds no other run unless asked to."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise OSError(f"{existing} is not a folder")
        tempfile.TemporaryDirectory(dir=existing).cleanup()  # a real write: os.access lets root through anywhere
    except OSError:
        raise UserError(f"cannot write the run folder {str(path)!r}: choose a writable --runs-dir") from None
    if not resume and not overwrite and holds_run(path):
        raise UserError(
            f"{str(path)!r} already holds a run: continue it with --resume auto, start over with --overwrite "
            "(clears the folder), or choose another --name"
        )


def holds_run(path: Path) -> bool:
    """Metrics or a checkpoint: a run that got somewhere (a start that failed before its first epoch ended leaves
    neither, and its folder is reused)."""
    return any((path / name).exists() for name in RUN_FILES)


def validation_metrics(task) -> list[str]:
    """The metrics an evaluation reports: the loss and the task's, or only the task's where its score() evaluates
    (no validation loss)."""
    names = list(getattr(task, "better", {}))
    return names if hasattr(task, "score") else ["loss", *names]


def metric_columns(task, ema: bool = False) -> list[str]:
    """metrics.csv's columns: the task's reported metrics for training and validation (and with `ema`, --model-ema,
    the EMA weights' validation metrics), then the run's numbers."""
    names = ["loss", *getattr(task, "better", {})]
    val_names = validation_metrics(task)
    columns = ["epoch", "step", *(f"train_{n}" for n in names), *(f"val_{n}" for n in val_names), "lr", "global_batch",
               "world_size", "accum_steps", "noise_scale", "grad_noise_trace", "grad_sq_norm",
               "epoch_seconds", "samples_per_second", "skipped_steps"]  # fmt: skip
    return with_ema_columns(columns) if ema else columns


def with_ema_columns(columns: list[str]) -> list[str]:
    """`val_ema_<name>` for each `val_<name>` column, right after the last of them."""
    validation = [c for c in columns if c.startswith("val_") and not c.startswith("val_ema_")]
    at = columns.index(validation[-1]) + 1
    return columns[:at] + [f"val_ema_{c.removeprefix('val_')}" for c in validation] + columns[at:]


class RunFolder:
    """The files of one run; every method is a no-op on ranks other than 0 unless it says otherwise."""

    def __init__(self, path: Path, is_main: bool, columns: list[str]):
        self.path = Path(path)
        self.is_main = is_main
        self.columns = columns
        self._tensorboard = None

    def start(self, config: dict, completed_epochs: int, overwrite: bool, tensorboard: bool, new_run=True,
              through_step: int | None = None) -> None:  # fmt: skip
        """Send the log to stdout and train.log; for a run that trains (`new_run`), also clear the folder
        (--overwrite of a fresh run), write config.json, and keep metrics.csv rows through the checkpoint's epoch
        (given `through_step`, the checkpoint's global step: through it, so mid-epoch evaluations' rows stay)."""
        log.handlers.clear()
        log.propagate = False
        if not self.is_main:
            log.setLevel(logging.ERROR)
            return
        if new_run and overwrite and completed_epochs == 0 and self.path.exists():
            shutil.rmtree(self.path)
        elif new_run and completed_epochs == 0 and not holds_run(self.path):
            for name in STARTED_FILES:  # a run that failed before its first checkpoint: start it again, clean
                (self.path / name).unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        log.setLevel(logging.INFO)
        for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(self.path / "train.log")):
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
        if not new_run:
            return
        (self.path / "config.json").write_text(json.dumps(config | provenance(), indent=2))
        self._keep_metrics_through(completed_epochs, through_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.path / "tb"))

    def record_workers(self, pids: list[int]) -> None:
        """workers.json: each rank's process id (for operators, and the restart test)."""
        if self.is_main:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            (self.path / "workers.json").write_text(json.dumps({"pids": pids, "restart": restart}))

    def append(self, row: dict, name: str = "metrics.csv") -> None:
        if not self.is_main:
            return
        path = self.path / name
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="nan", extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)
        if self._tensorboard is not None:
            for key in self.columns[2:]:
                if key in row:
                    self._tensorboard.add_scalar(key, row[key], row["epoch"])
            self._tensorboard.flush()

    def _keep_metrics_through(self, last_epoch: int, last_step: int | None = None) -> None:
        """On resume, drop rows after the checkpoint (they are about to be trained and evaluated again)."""
        path = self.path / "metrics.csv"
        if not path.exists():
            return
        with open(path, newline="") as f:
            rows = [row for row in csv.DictReader(f) if kept(row, last_epoch, last_step)]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="nan", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


def kept(row: dict, last_epoch: int, last_step: int | None) -> bool:
    """A metrics.csv row a resume keeps: of an epoch it completed, or (--eval-every-steps) a mid-epoch evaluation's
    of the epoch it continues, through its step."""
    if int(row["epoch"]) <= last_epoch:
        return True
    return last_step is not None and int(row["epoch"]) == last_epoch + 1 and int(row["step"]) <= last_step


def describe(row: dict) -> str:
    """`train loss 0.1234 acc 0.9512 | val loss 0.2345 acc 0.9301`, from a metrics row."""
    parts = []
    for prefix in ("train", "val"):
        values = [f"{k[len(prefix) + 1 :]} {v:.4f}" for k, v in row.items() if k.startswith(prefix + "_")]
        if values:
            parts.append(f"{prefix} " + " ".join(values))
    return " | ".join(parts)


def epoch_line(row: dict, stopped_early: bool = False) -> str:
    """An epoch's log line: `epoch 3: train loss ... | val loss ... | lr 0.05 | 0.2s, 7000 samples/s`."""
    early = " (early stop)" if stopped_early else ""
    return (
        f"epoch {row['epoch']}: {describe(row)} | lr {row['lr']:.4g} | {row['epoch_seconds']:.1f}s, "
        f"{row['samples_per_second']:.0f} samples/s{early}"
    )


def task_metrics(task) -> dict[str, dict]:
    """The task's reported metrics besides the loss, for the tools that read a run folder (sweeps, plots): which way
    each improves, and how tables and figures show it (the task's optional `shown_as`: {name: (title, unit)})."""
    shown = getattr(task, "shown_as", {})
    return {
        name: {"better": mode, "title": shown.get(name, (name, ""))[0], "unit": shown.get(name, (name, ""))[1]}
        for name, mode in getattr(task, "better", {}).items()
    }


def read_config(run_dir: str | Path) -> dict:
    """A run's config.json."""
    return json.loads((Path(run_dir) / "config.json").read_text())


def headline(config: dict, metric: str | None = None) -> dict:
    """The validation metric a table or figure of a run shows: `metric` (a name the task reports), else the run's
    monitored one, or the task's first reported metric where the run monitors its loss (so a classification sweep
    shows accuracy). Returns {"name", "column" (metrics.csv's), "title", "unit", "better", "scale"}: a unit "%"
    shows a fraction times 100."""
    metrics = {"loss": {"better": "min", "title": "loss", "unit": ""}} | config.get("task_metrics", {})
    monitored = config.get("monitor", "val_loss")[len("val_") :]
    name = metric or (next(iter(config.get("task_metrics", {})), "loss") if monitored == "loss" else monitored)
    name = name[len("val_") :] if name.startswith("val_") else name
    ema = name.startswith("ema_") and name not in metrics and name[4:] in metrics  # --model-ema's `ema_<name>`
    if name not in metrics and not ema:
        raise ValueError(f"the run reports no metric {name!r}; it reports {', '.join(metrics)}")
    shown = dict(metrics[name[4:] if ema else name])
    if ema:
        shown["title"] = f"{shown['title']} (EMA)"
    return {"name": name, "column": f"val_{name}", **shown, "scale": 100.0 if shown["unit"] == "%" else 1.0}


def task_info(task) -> dict:
    """What the task found in its data (its plain public attributes: number of classes, input channels, ...)."""
    return {k: v for k, v in vars(task).items() if isinstance(v, (int, float, str, bool, tuple)) and k[0] != "_"}


def provenance() -> dict:
    """What a reader needs to reproduce a run besides its flags: the command, torch, the git commit, the time."""
    import torch

    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"command": sys.argv, "torch_version": str(torch.__version__), "git_commit": commit,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
