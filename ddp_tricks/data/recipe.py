"""An image folder's recipe (the crop, the flip, the augmentation after them, the validation resize and the
normalisation, by timm's names) and timm's `--aa` strings read as the torchvision.transforms.v2 transform that does
each. No torch import here: the command line checks --aa with it before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_tricks.errors import UserError

MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as timm's and torchvision's ImageNet recipes normalise
STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
ERASE_MODES = ("const", "rand", "pixel")
MIX_MODES = ("batch", "pair", "elem")
# timm's AutoAugment policies that torchvision.transforms.v2.AutoAugment has (timm's "original" is the paper's
# ImageNet policy); v0, v0r and 3a are timm's own
AUTO_AUGMENT = {"original": "imagenet", "originalr": "imagenet", "autoaugment": "imagenet", "cifar10": "cifar10"}
AUTO_AUGMENT |= {"svhn": "svhn"}
TRIVIAL = ("trivialaugment", "ta_wide")
AA_FORMS = (
    "rand-mM[-nN][-mstdS][-mmaxX][-pP][-incI] (RandAugment), trivialaugment, augmix-mM[-wW][-dD][-aA], or an "
    "AutoAugment policy: original, cifar10, svhn"
)


def parse_aa(text: str | None) -> dict | None:
    """timm's `--aa` string as the settings of the torchvision.transforms.v2 transform that does it (None: none).
    An unknown policy or key is one line."""
    if text is None or text.lower() in ("", "none"):
        return None
    name, *parts = text.split("-")
    if name in TRIVIAL and not parts:
        return {"kind": "trivialaugment"}
    if name in AUTO_AUGMENT and not parts:
        return {"kind": "autoaugment", "policy": AUTO_AUGMENT[name]}
    if name in ("v0", "v0r", "3a"):
        raise UserError(f"--aa {text}: timm's own AutoAugment policy, not in torchvision.transforms.v2; use original")
    if name == "rand":
        known = {"m": 9.0, "n": 2, "mstd": 0.0, "mmax": 10.0, "p": 0.5, "inc": 0}
    elif name == "augmix":
        known = {"m": 3.0, "w": 3, "d": -1, "a": 1.0}
    else:
        raise UserError(f"--aa {text!r}: unknown policy; give {AA_FORMS}")
    settings = dict(known)
    for part in parts:
        key = next((k for k in sorted(known, key=len, reverse=True) if part.startswith(k)), None)
        try:
            settings[key] = type(known[key])(part[len(key) :]) if key else None
        except ValueError:
            key = None
        if key is None:
            raise UserError(f"--aa {text}: cannot read {part!r}; give {AA_FORMS}")
    if name == "rand" and not (0 <= settings["m"] <= 10 and settings["n"] >= 1 and 0 <= settings["p"] <= 1):
        raise UserError(f"--aa {text}: RandAugment takes a magnitude m in [0, 10], n >= 1 ops, p in [0, 1]")
    if name == "augmix" and not (1 <= settings["m"] <= 10 and settings["w"] >= 1):
        raise UserError(f"--aa {text}: AugMix takes a severity m in [1, 10] and a width w >= 1")
    return {"kind": "randaugment" if name == "rand" else "augmix"} | settings


@dataclass(frozen=True)
class ImageRecipe:
    """The crop, flip, augmentation and normalisation of an image folder (cli.image_flags names each flag)."""

    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    crop_pct: float = 0.875
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"
    hflip: float = 0.5
    color_jitter: float = 0.0
    aa: str | None = None
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1

    @property
    def augments(self) -> bool:
        """Whether anything follows the crop and flip (colour jitter, --aa, random erasing)."""
        return self.color_jitter > 0 or parse_aa(self.aa) is not None or self.reprob > 0

    def describe(self) -> str:
        """The augmentation beyond crop and flip, for the input line ("" : none)."""
        parts = [f"colour jitter {self.color_jitter:g}"] if self.color_jitter > 0 else []
        parts += [f"--aa {self.aa}"] if parse_aa(self.aa) is not None else []
        parts += [f"random erasing p {self.reprob:g} ({self.remode}, up to {self.recount})"] if self.reprob else []
        return ", ".join(parts)

    def fill(self) -> list[int]:
        """The mean colour in uint8: what the geometric ops fill with (timm's img_mean) and const erasing paints."""
        return [round(255 * m) for m in self.mean]
