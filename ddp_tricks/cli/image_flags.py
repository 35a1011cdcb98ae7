"""The image recipe's flags, named as timm's train.py names them (a timm command line carries over): normalisation,
the crop, the flip, colour jitter, RandAugment / TrivialAugment / AutoAugment / AugMix (`--aa`, timm's strings),
random erasing, mixup and cutmix, repeated augmentation; their checks, and what the data room takes from them.
No torch import here (data/recipe.py reads timm's --aa strings; data/augment.py builds v2's transforms).
"""

from __future__ import annotations

import argparse

from ddp_tricks.data.recipe import AA_FORMS, ERASE_MODES, INTERPOLATIONS, MEAN, MIX_MODES, STD, parse_aa
from ddp_tricks.errors import UserError


def _floats(count: str):
    return {"type": float, "nargs": count, "metavar": "X"}


def add_image_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "image recipe, named as timm's train.py names them (image folders: the built-in --dataset imagefolder; "
        "each sample's augmentation a function of (seed, epoch, sample), the batch's of (seed, step, micro-batch))"
    )
    g.add_argument("--mean", default=MEAN, **_floats("+"), help="normalisation's mean, R G B (default: ImageNet's)")
    g.add_argument("--std", default=STD, **_floats("+"), help="normalisation's std, R G B (default: ImageNet's)")
    g.add_argument(
        "--crop-pct",
        type=float,
        default=0.875,
        metavar="F",
        help="validation: resize the shorter side to size / F, then the centre crop (224 / 256)",
    )
    g.add_argument("--scale", default=(0.08, 1.0), **_floats(2), help="RandomResizedCrop's area range")
    g.add_argument("--ratio", default=(3 / 4, 4 / 3), **_floats(2), help="RandomResizedCrop's aspect range")
    g.add_argument("--interpolation", choices=INTERPOLATIONS, default="bilinear", help="the crops' resize")
    g.add_argument("--hflip", type=float, default=0.5, metavar="P", help="horizontal flip probability")
    g.add_argument(
        "--color-jitter",
        type=float,
        default=0.0,
        metavar="F",
        help="brightness, contrast and saturation jitter (timm uses 0.4; as timm, not with --aa)",
    )
    g.add_argument("--aa", default=None, metavar="POLICY", help=f"automatic augmentation, timm's string: {AA_FORMS}")
    g.add_argument("--reprob", type=float, default=0.0, metavar="P", help="random erasing probability")
    g.add_argument(
        "--remode",
        choices=ERASE_MODES,
        default="pixel",
        help="random erasing's fill: const (the mean colour), rand (a colour), pixel (noise)",
    )
    g.add_argument("--recount", type=int, default=1, metavar="N", help="random erasing: up to N boxes")
    g.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA", help="mixup's Beta(alpha, alpha); 0: off")
    g.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA", help="cutmix's Beta(alpha, alpha); 0: off")
    g.add_argument("--mixup-prob", type=float, default=1.0, metavar="P", help="mixup or cutmix on a batch (or sample)")
    g.add_argument(
        "--mixup-switch-prob",
        type=float,
        default=0.5,
        metavar="P",
        help="with both --mixup and --cutmix: cutmix's share",
    )
    g.add_argument(
        "--mixup-mode", choices=MIX_MODES, default="batch", help="one draw per micro-batch, per pair or per sample"
    )
    g.add_argument(
        "--aug-repeats",
        type=int,
        default=0,
        metavar="N",
        help="repeated augmentation (DeiT): each sample N times an epoch, differently augmented, in one "
        "step's other micro-batches (ranks); 0: off",
    )


def _probability(value: float, flag: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{flag} is a probability in [0, 1], got {value}")


def check_image_flags(cfg: argparse.Namespace) -> None:
    """Impossible values: a --mean/--std of the wrong length, an unknown --aa policy, out-of-range probabilities."""
    for flag, values in (("--mean", cfg.mean), ("--std", cfg.std)):
        if len(values) != 3:
            raise UserError(f"{flag} takes 3 values (R G B), got {len(values)}: {' '.join(map(str, values))}")
    if not all(s > 0 for s in cfg.std):
        raise UserError(f"--std must be > 0 in every channel, got {' '.join(map(str, cfg.std))}")
    if not 0.0 < cfg.crop_pct <= 1.0:
        raise UserError(f"--crop-pct must be in (0, 1], got {cfg.crop_pct}")
    if not 0.0 < cfg.scale[0] <= cfg.scale[1] <= 1.0:
        raise UserError(f"--scale takes MIN MAX with 0 < MIN <= MAX <= 1, got {cfg.scale[0]} {cfg.scale[1]}")
    if not 0.0 < cfg.ratio[0] <= cfg.ratio[1]:
        raise UserError(f"--ratio takes MIN MAX with 0 < MIN <= MAX, got {cfg.ratio[0]} {cfg.ratio[1]}")
    for flag, value in (("--hflip", cfg.hflip), ("--reprob", cfg.reprob), ("--mixup-prob", cfg.mixup_prob)):
        _probability(value, flag)
    _probability(cfg.mixup_switch_prob, "--mixup-switch-prob")
    if not cfg.color_jitter >= 0:
        raise UserError(f"--color-jitter must be >= 0, got {cfg.color_jitter}")
    parse_aa(cfg.aa)
    if cfg.color_jitter > 0 and parse_aa(cfg.aa) is not None:
        raise UserError("--color-jitter with --aa: timm leaves the jitter out where --aa is given; give one of them")
    if cfg.recount < 1:
        raise UserError(f"--recount must be >= 1, got {cfg.recount}")
    for flag, value in (("--mixup", cfg.mixup), ("--cutmix", cfg.cutmix)):
        if not value >= 0:
            raise UserError(f"{flag} is Beta's alpha, >= 0 (0: off), got {value}")
    if cfg.aug_repeats < 0:
        raise UserError(f"--aug-repeats must be >= 0 (0 or 1: off), got {cfg.aug_repeats}")
    if cfg.aug_repeats > 1 and cfg.batch_trace is not None:
        raise UserError("--aug-repeats places each sample's repeats in one step, which --batch-trace's steps do not do")


def image_options(cfg: argparse.Namespace) -> dict:
    """data.augment.ImageRecipe's settings: each sample's crop, flip, augmentation and normalisation."""
    return {
        "mean": tuple(cfg.mean),
        "std": tuple(cfg.std),
        "crop_pct": cfg.crop_pct,
        "scale": tuple(cfg.scale),
        "ratio": tuple(cfg.ratio),
        "interpolation": cfg.interpolation,
        "hflip": cfg.hflip,
        "color_jitter": cfg.color_jitter,
        "aa": cfg.aa,
        "reprob": cfg.reprob,
        "remode": cfg.remode,
        "recount": cfg.recount,
    }


def mixing_options(cfg: argparse.Namespace) -> dict | None:
    """data.mixing.Mixing's settings (None: neither --mixup nor --cutmix)."""
    if not (cfg.mixup > 0 or cfg.cutmix > 0):
        return None
    return {
        "mixup_alpha": cfg.mixup,
        "cutmix_alpha": cfg.cutmix,
        "prob": cfg.mixup_prob,
        "switch_prob": cfg.mixup_switch_prob,
        "mode": cfg.mixup_mode,
    }
