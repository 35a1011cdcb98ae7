"""Learning-rate schedules, counted in optimizer steps: `curves.py` holds the per-step curves (WarmupDecay, the
original project's PolynomialWarmup), `schedule.py` the run's composition (warmup, then a decay or a plateau).
Here: the names the command line offers, without importing torch.
"""

from __future__ import annotations

KINDS = ("constant", "plateau", "poly", "cosine", "step")  # --scheduler: what follows warmup
DECAYS = tuple(kind for kind in KINDS if kind != "plateau")  # those a per-step curve draws alone


def decay_kind(scheduler: str, warmup_type: str = "linear") -> str:
    """What follows warmup: `--warmup-type cosine` (the original template's) means cosine decay after it."""
    if warmup_type == "cosine" and scheduler == "constant":
        return "cosine"
    return scheduler
