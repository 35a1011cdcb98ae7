"""--eval-every-steps K: the exact evaluation every K optimizer steps as well as at each epoch's end, run after the
step (the loop's `after_step`, in front of the checkpoints'); the monitored metric then drives best.pt, early
stopping and ReduceLROnPlateau at each evaluation (plateau's patience counted in evaluations), on every rank alike.
"""

from __future__ import annotations

import logging
import time

from ddp_tricks.storage.run_folder import describe
from ddp_tricks.training import loop
from ddp_tricks.training.state import Training

log = logging.getLogger("ddp_tricks")


def metrics_row(t: Training, val_loader) -> dict:
    """An evaluation's metrics.csv row where the run stands: epoch, step, LR, the validation metrics (and the EMA
    weights')."""
    row = {"epoch": t.progress.epoch, "step": t.progress.global_step, "lr": t.lr} | loop.evaluate(t, val_loader)
    return row | loop.evaluate_ema(t, val_loader)  # --model-ema: the EMA's weights, the same way


class StepEvaluations:
    """`__call__(t)` after every optimizer step (every rank): on a multiple of `every` that is not the epoch's last
    step (the epoch's own evaluation follows there), evaluate, let the monitored metric decide, append the row to
    metrics.csv, and write best.pt on a new best (and the checkpoint when early stopping ends the run); then the
    checkpoints' own `after_step`. True: the epoch stops here (preempted, or stopped early: `t.stopped_early`)."""

    def __init__(self, every: int, val_loader, folder, checkpoints, rows):
        self.every = every  # 0: only at epoch ends
        self.val_loader = val_loader
        self.folder = folder  # storage.run_folder.RunFolder
        self.checkpoints = checkpoints  # storage.checkpoint.Checkpoints
        self.rows = rows  # training.step_log.StepLog: its epoch's last step, and its window without the evaluation

    def __call__(self, t: Training) -> bool:
        if self.every and t.progress.global_step % self.every == 0 and t.progress.global_step != self.rows.end_step:
            start = time.perf_counter()
            self.rows.settle()  # this step's row (its non-finite check) before evaluating its weights
            row = metrics_row(t, self.val_loader)
            improved = t.after_evaluation(row)
            t.model.train()  # the evaluation left the model in eval mode
            self.folder.append(row)
            if improved or t.stopped_early:
                self.checkpoints.save(t, also_best=improved)
            log.info("step %d: %s%s", t.progress.global_step, describe(row), " (early stop)" if t.stopped_early else "")
            self.rows.exclude(time.perf_counter() - start)
        return self.checkpoints.after_step(t) or t.stopped_early
