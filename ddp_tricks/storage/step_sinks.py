"""Where per-step rows go (step_log.py hands each the same row): steps.csv in the run's folder, TensorBoard scalars at
the global step (runs/<name>/tb/steps), Weights & Biases (`--wandb`, when installed), and the tqdm bar. A resumed
run continues each: steps.csv and TensorBoard drop what came after the checkpoint's step, W&B resumes its run.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from ddp_tricks.cli.step_flags import WANDB_MISSING
from ddp_tricks.errors import UserError


class CsvRows:
    """runs/<name>/steps.csv, one row per logged step; rows after `through_step` (a checkpoint's global step: they
    are about to be trained again) are dropped when it opens, so each step is in the file once."""

    def __init__(self, path: Path, columns: list[str], through_step: int):
        self.path, self.columns = Path(path), columns
        kept = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= through_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="nan", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        # opened at the first row and held (opening it per row cost 50 us); every row flushed, the file closed by
        # close() or when the sink goes
        self._file = self._writer = None

    def write(self, row: dict) -> None:
        """One row, flushed: the file holds it at once (a crash after it keeps it)."""
        if self._file is None:
            self._file = open(self.path, "a", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=self.columns, restval="nan", extrasaction="ignore")
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None


def csv_columns(path: Path) -> list[str]:
    """The columns of a steps.csv, from its header (CsvRows writes it as it opens, before StepLog.open makes the
    other sinks): what TensorBoard and W&B show, so that a row holds nothing there that the file lacks (a run of one
    parameter group: the row's `lr_0`, which only `lr` repeats)."""
    with open(path, newline="") as f:
        return next(csv.reader(f))


class TensorBoardRows:
    """Each numeric column of steps.csv as a scalar `steps/<column>` at the global step (a NaN left out), in
    runs/<name>/tb/steps (beside the per-epoch scalars in tb/, whose x axis is the epoch); a resumed run purges what
    followed its checkpoint. `columns`: steps.csv's (None: read from runs/<name>/steps.csv, `csv_columns`)."""

    def __init__(self, folder: Path, through_step: int, columns: list[str] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.columns = csv_columns(Path(folder).parent.parent / "steps.csv") if columns is None else columns
        self.writer = SummaryWriter(str(folder), purge_step=through_step + 1 if through_step else None)

    def write(self, row: dict) -> None:
        for key in self.columns:
            value = row.get(key)
            if key != "step" and isinstance(value, (int, float)) and not math.isnan(value):
                self.writer.add_scalar(f"steps/{key}", value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_module():
    """The wandb package, or one line saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise UserError(WANDB_MISSING) from None
    return wandb


class WandbRows:
    """The rows through Weights & Biases (rank 0), steps.csv's columns at the global step; `run_id` (kept in the
    checkpoint) resumes the same W&B run. WANDB_MODE=offline writes under `folder` (the run's) without a network.
    `columns`: steps.csv's (None: read from `folder`/steps.csv, `csv_columns`)."""

    def __init__(
        self,
        project: str,
        name: str,
        folder: Path,
        config: dict,
        run_id: str | None = None,
        columns: list[str] | None = None,
    ):
        wandb = wandb_module()
        self.columns = csv_columns(Path(folder) / "steps.csv") if columns is None else columns
        self.run = wandb.init(project=project, name=name, dir=str(folder), config=config, id=run_id,
                              resume="allow" if run_id else None)  # fmt: skip
        self.run_id = self.run.id

    def write(self, row: dict) -> None:
        values = {f"steps/{k}": row[k] for k in self.columns if k != "step" and isinstance(row.get(k), (int, float))}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def progress_bar(total: int, initial: int, description: str):
    """A tqdm bar on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)
