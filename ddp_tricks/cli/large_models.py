"""The flags for models that outgrow one device's memory: activation checkpointing (ddp_tricks/activations.py),
HSDP's replicas (distributed/mesh.py) and meta-device initialisation (distributed/meta_init.py), as one more group
of the full command line (`build_parser`: flags.py's groups, then this one). No torch import here.
"""

from __future__ import annotations

import argparse

from ddp_tricks.cli.flags import build_parser as build_flags_parser
from ddp_tricks.cli.flags import positive_int
from ddp_tricks.cli.image_flags import add_image_flags
from ddp_tricks.cli.init_flags import add_init_flags

CHECKPOINTING = ("full", "ops")  # or an integer K: every K-th block


def checkpointing_mode(text: str) -> str | None:
    """--activation-checkpointing's value: none (None: off, the default), full, ops or a positive integer K (kept
    as text)."""
    if text == "none":
        return None
    if text in CHECKPOINTING:
        return text
    try:
        every = int(text)
    except ValueError:  # also what str.isdigit() lets through and int() refuses ('²')
        every = 0
    if every >= 1:
        return str(every)
    raise argparse.ArgumentTypeError(
        f"must be none, full, ops or a positive integer K (every K-th block), got {text!r}"
    )


def large_model_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--fsdp-replicas",
        type=positive_int,
        default=1,
        metavar="R",
        help="--strategy fsdp as HSDP: R replicas x world/R shards (shard within a node, replicate across nodes: "
        "R = the number of nodes); 1: sharded over every process",
    )
    g.add_argument(
        "--no-meta-init",
        dest="meta_init",
        action="store_false",
        help="--strategy fsdp builds the model on the CPU whole, then shards it (default: built on the meta "
        "device and materialised per shard, with the same initial weights)",
    )
    g.add_argument(
        "--activation-checkpointing",
        type=checkpointing_mode,
        default=None,
        metavar="MODE",
        help="recompute the blocks' activations in the backward instead of holding them (the FSDP units, "
        "DDP or FSDP): full (every block), ops (every block, keeping its matrix products and attention), K "
        "(every K-th block), or none",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full command line: flags.py's groups, then the large-model flags, the image recipe's and those that
    start from a checkpoint."""
    parser = build_flags_parser()
    large_model_flags(parser.add_argument_group("models larger than a device (FSDP, recomputation)"))
    add_image_flags(parser)
    add_init_flags(parser)
    return parser
