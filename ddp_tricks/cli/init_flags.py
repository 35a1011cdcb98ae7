"""The flags that start a new run from another run's checkpoint or a weights file (--init-from, as timm's
--initial-checkpoint and torchtitan's initial_load_path: fine-tuning, a second training phase), their checks, and
what storage/init_from.py takes from them. No torch import here.
"""

from __future__ import annotations

import argparse
import re

from ddp_tricks.errors import UserError


def add_init_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("starting a new run from a checkpoint or weights file (fine-tuning, a second phase)")
    g.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="a NEW run (global step 0, its own plan, schedule and warmup) from the weights at PATH: a run folder "
        "(its last checkpoint), a last.pt/best.pt, a sharded checkpoint folder, or a plain state-dict file "
        "(torchvision's, timm's); tensors of another shape or missing are initialised as the model builds them, "
        "named at start. With --resume auto, a run that has its own checkpoint resumes it instead",
    )
    g.add_argument(
        "--init-optimizer",
        action="store_true",
        help="with --init-from: the optimizer's state too (moments, momentum, Lookahead's slow weights) where the "
        "parameters match; the LR is this run's schedule's",
    )
    g.add_argument(
        "--init-from-ema",
        action="store_true",
        help="with --init-from: start from the checkpoint's EMA weights (--model-ema) instead of its trained ones",
    )
    g.add_argument(
        "--init-exclude",
        default=None,
        metavar="REGEX",
        help="with --init-from: leave the weights whose names match REGEX (re.search) as the model builds them, "
        "e.g. '^fc\\.' for a new head",
    )


def check_init_flags(cfg: argparse.Namespace) -> None:
    """The --init-* flags without --init-from, --init-from beside a checkpoint named to --resume, a bad regex."""
    if cfg.init_from is None:
        given = [flag for flag, on in _followers(cfg).items() if on]
        if given:
            raise UserError(f"{given[0]} acts with --init-from PATH: add it, or drop {given[0]}")
        return
    if cfg.resume not in (None, "auto"):
        raise UserError(
            f"--init-from starts a new run and --resume {cfg.resume} continues one: give one of them (with --resume "
            "auto, --init-from starts the run only when it has no checkpoint of its own yet)"
        )
    if cfg.init_exclude is not None:
        try:
            re.compile(cfg.init_exclude)
        except re.error as error:
            raise UserError(f"--init-exclude {cfg.init_exclude!r} is not a regular expression ({error})") from None


def _followers(cfg: argparse.Namespace) -> dict[str, bool]:
    return {
        "--init-optimizer": cfg.init_optimizer,
        "--init-from-ema": cfg.init_from_ema,
        "--init-exclude": cfg.init_exclude is not None,
    }


def init_options(cfg: argparse.Namespace) -> dict:
    """storage.init_from.start's settings from the flags."""
    return {"ema": cfg.init_from_ema, "exclude": cfg.init_exclude}
