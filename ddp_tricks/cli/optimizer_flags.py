"""The optimizer's own settings beyond flags.py's group: the exclusion rule (--no-decay-1d), added to the "optimizer"
group of the command line. No torch import here.
"""

from __future__ import annotations

import argparse


def add_optimizer_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--no-decay-1d",
        "--bn-bias-separately",
        dest="bn_bias_separately",
        action="store_true",
        help="the exclusion rule (timm's, nanoGPT's): every parameter of one dimension or fewer (biases of any name, "
        "every norm's weight, scalars), every norm layer's and the names the model lists in no_weight_decay() get no "
        "weight decay and no trust ratio (LARS, LAMB, --lars-wrap), under every optimizer",
    )
