"""The optimizer's own settings beyond flags.py's group: the exclusion rule (--no-decay-1d), Adam's, AdamW's and LAMB's
--betas and --eps, LAMB's trust clipping and always-adapt (as timm's Lamb has them), Muon's momentum, Nesterov and
Newton-Schulz steps, added to the "optimizer" group of the command line; their checks, and the flags that act only
with their optimizer. No torch import here.
"""

from __future__ import annotations

import argparse

from ddp_tricks.errors import UserError

MOMENTS = ("adam", "adamw", "lamb", "muon")  # the optimizers with Adam's running moments (Muon's AdamW): --betas, --eps
EPS = {"lamb": 1e-6}  # --eps when it is not given: each optimizer's own (torch's Adam and AdamW: 1e-8)

# Flags that act only with their optimizer (checks.ONLY_WITH's form): given without it, they would be ignored.
ONLY_WITH = (
    (("betas", "eps"), lambda cfg: cfg.optimizer in MOMENTS, "--optimizer adamw, adam, lamb or muon"),
    (("trust_clip", "always_adapt"), lambda cfg: cfg.optimizer == "lamb", "--optimizer lamb"),
    (("muon_momentum", "muon_nesterov", "ns_steps"), lambda cfg: cfg.optimizer == "muon", "--optimizer muon"),
)


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
    g.add_argument(
        "--betas",
        type=float,
        nargs=2,
        default=[0.9, 0.999],
        metavar=("B1", "B2"),
        help="Adam's, AdamW's and LAMB's running averages of the gradient and its square (default: 0.9 0.999)",
    )
    g.add_argument(
        "--eps",
        type=float,
        default=None,
        help="Adam's, AdamW's and LAMB's term in the update's denominator (default: the optimizer's: Adam and AdamW "
        "1e-8, LAMB 1e-6); LARS's trust-ratio term is --epsilon",
    )
    add_muon_flags(g)
    g.add_argument(
        "--trust-clip",
        action="store_true",
        help="LAMB: the trust ratio at most 1 (timm's trust_clip)",
    )
    g.add_argument(
        "--no-always-adapt",
        dest="always_adapt",
        action="store_false",
        help="LAMB: no trust ratio in a group without weight decay (timm's always_adapt=False, its default; here the "
        "trust ratio is taken in every group but those the exclusion rule or a task's 'lars': False keeps out)",
    )


def add_muon_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--muon-momentum",
        type=float,
        default=0.95,
        metavar="M",
        help="--optimizer muon: the momentum of its matrices (default: 0.95, torch.optim.Muon's)",
    )
    g.add_argument(
        "--no-muon-nesterov",
        dest="muon_nesterov",
        action="store_false",
        help="--optimizer muon: plain momentum in place of Nesterov's (default: Nesterov's, torch.optim.Muon's)",
    )
    g.add_argument(
        "--ns-steps",
        type=int,
        default=5,
        metavar="K",
        help="--optimizer muon: Newton-Schulz iterations that orthogonalise each matrix (default: 5)",
    )


def check_optimizer_flags(cfg: argparse.Namespace) -> None:
    """Impossible values, one line each; --eps not given becomes the optimizer's own (config.json keeps it)."""
    if not all(0.0 <= beta < 1.0 for beta in cfg.betas):
        raise UserError(f"--betas must be two numbers in [0, 1), got {' '.join(f'{b:g}' for b in cfg.betas)}")
    if cfg.eps is None and cfg.optimizer in MOMENTS:
        cfg.eps = EPS.get(cfg.optimizer, 1e-8)
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise UserError(f"--muon-momentum must be in [0, 1), got {cfg.muon_momentum}")
    if not 0 <= cfg.ns_steps < 100:
        raise UserError(f"--ns-steps must be in [0, 100) (Newton-Schulz iterations), got {cfg.ns_steps}")
    if cfg.eps is not None and not cfg.eps >= 0:
        raise UserError(f"--eps must be >= 0, got {cfg.eps}")


def optimizer_flag_options(cfg: argparse.Namespace) -> dict:
    """optim.build.build's settings from these flags."""
    return {
        "betas": tuple(cfg.betas),
        "adam_eps": cfg.eps,
        "trust_clip": cfg.trust_clip,
        "always_adapt": cfg.always_adapt,
        "muon_momentum": cfg.muon_momentum,
        "muon_nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.ns_steps,
    }
