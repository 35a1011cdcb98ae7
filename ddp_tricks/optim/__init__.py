"""The optimizer a run names (`build.py`). The optimizers themselves stand at the top of the repository, each
usable alone: lars.py, lamb.py, lookahead.py. Here: the names the command line offers, without importing torch.
"""

from __future__ import annotations

NAMES = ("sgd", "adam", "adamw", "lars", "lamb")  # --optimizer
