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

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, restval="nan", extrasaction="ignore").writerow(row)

    def close(self) -> None:
        pass


class TensorBoardRows:
    """Every numeric field of a row as a scalar `steps/<field>` at the global step, in runs/<name>/tb/steps (beside
    the per-epoch scalars in tb/, whose x axis is the epoch); a resumed run purges what followed its checkpoint."""

    def __init__(self, folder: Path, through_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=through_step + 1 if through_step else None)

    def write(self, row: dict) -> None:
        for key, value in row.items():
            if key not in ("step", "slowest_rank") and isinstance(value, (int, float)) and not math.isnan(value):
                self.writer.add_scalar(f"steps/{key}", value, row["step"])
        self.writer.add_scalar("steps/slowest_rank", row["slowest_rank"], row["step"])
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
    """The rows through Weights & Biases (rank 0), at the global step; `run_id` (kept in the checkpoint) resumes the
    same W&B run. WANDB_MODE=offline writes under `folder` without a network."""

    def __init__(self, project: str, name: str, folder: Path, config: dict, run_id: str | None = None):
        wandb = wandb_module()
        self.run = wandb.init(project=project, name=name, dir=str(folder), config=config, id=run_id,
                              resume="allow" if run_id else None)  # fmt: skip
        self.run_id = self.run.id

    def write(self, row: dict) -> None:
        values = {f"steps/{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def progress_bar(total: int, initial: int, description: str):
    """A tqdm bar on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)
