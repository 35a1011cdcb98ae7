"""The flags of per-step rows (steps.csv, TensorBoard, W&B: --log-interval, --peak-tflops, --wandb), their checks,
and what the step log takes from them. No torch import here.
"""

from __future__ import annotations

import argparse

from ddp_tricks.errors import UserError

WANDB_PROJECT = "ddp-tricks"  # --wandb without a project
WANDB_MISSING = "--wandb needs the wandb package: pip install wandb (or pip install -e '.[wandb]')"


def add_step_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("per-step rows (runs/<name>/steps.csv) and runs counted in steps")
    g.add_argument(
        "--max-steps",
        type=int,
        default=0,
        metavar="N",
        help="end the run after N optimizer steps, in place of --epochs (the epochs they need, the last cut short; "
        "the LR schedule's length is N); 0: --epochs",
    )
    g.add_argument(
        "--eval-every-steps",
        type=int,
        default=0,
        metavar="K",
        help="also evaluate every K optimizer steps (a metrics.csv row each; best.pt, early stopping and plateau "
        "follow each evaluation, their patience in evaluations); 0: at epoch ends only",
    )
    g.add_argument(
        "--log-interval",
        type=int,
        default=20,
        metavar="K",
        help="a row in steps.csv every K optimizer steps (and at the first and each epoch's last), the bar's update "
        "and the loss's non-finite check: the only host syncs in the loop; 0: no rows, the loss checked at epoch ends",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        metavar="TFLOPS",
        help="the device's peak TFLOP/s for the MFU column (0: from the table of known GPUs by name and dtype)",
    )
    g.add_argument(
        "--wandb",
        nargs="?",
        const=WANDB_PROJECT,
        default=None,
        metavar="PROJECT",
        help=f"also send the rows to Weights & Biases, project PROJECT (default: {WANDB_PROJECT}); needs wandb "
        "(pip install -e '.[wandb]'); WANDB_MODE=offline writes without a network",
    )


def check_step_flags(cfg: argparse.Namespace, given: set[str] | frozenset[str] = frozenset()) -> None:
    """Impossible values, --max-steps beside -e (`given`: the flags spelled out), --wandb without its package."""
    if cfg.max_steps < 0:
        raise UserError(f"--max-steps must be >= 0 (0: the run is --epochs long), got {cfg.max_steps}")
    if cfg.eval_every_steps < 0:
        raise UserError(f"--eval-every-steps must be >= 0 (0: at epoch ends only), got {cfg.eval_every_steps}")
    if cfg.max_steps and "epochs" in given:
        raise UserError("--max-steps sets the run's length in place of --epochs: give one of them")
    if cfg.log_interval < 0:
        raise UserError(f"--log-interval must be >= 0 (0: no per-step rows), got {cfg.log_interval}")
    if not cfg.peak_tflops >= 0:
        raise UserError(f"--peak-tflops must be >= 0 (0: from the table of known GPUs), got {cfg.peak_tflops}")
    if cfg.wandb is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError(
                "--wandb needs the wandb package: pip install wandb (or pip install -e '.[wandb]')"
            ) from None


def step_log_options(cfg: argparse.Namespace) -> dict:
    """training.step_log.StepLog's settings from the flags."""
    return {"interval": cfg.log_interval, "amp": cfg.amp, "peak_tflops": cfg.peak_tflops}


def step_sink_options(cfg: argparse.Namespace) -> dict:
    """StepLog.open's settings from the flags: the bar, TensorBoard, W&B."""
    return {"bar": not cfg.no_progress, "tensorboard": cfg.tensorboard, "wandb": cfg.wandb}
