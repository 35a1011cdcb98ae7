"""A training sample's augmentation after its crop and flip, on uint8 by torchvision.transforms.v2 (timm's recipe
by its names: colour jitter, RandAugment / TrivialAugment / AutoAugment / AugMix, random erasing), and the recipe
(data/recipe.py) that also sets the crop, the flip, the validation resize and the normalisation.

v2's transforms draw from torch's global generator; `Augment` runs them in a fork of it seeded from the sample's own
generator (data.decoded.sample_rng: (seed, epoch, index) alone), so a sample's augmented image is the same at any
number of workers and ranks and after a resume, and the worker's generator is left as it was.
"""

from __future__ import annotations

import contextlib
import math
import random

import torch

from ddp_tricks.data.recipe import ImageRecipe, parse_aa

ERASE_SCALE = (0.02, 1 / 3)  # timm's RandomErasing's area range and aspect range (v2's defaults too)
ERASE_RATIO = (0.3, 1 / 0.3)
MAGNITUDE_BINS = 101  # RandAugment's magnitude in steps of 0.1 of timm's level (0..10)


def _interpolation(name: str):
    from torchvision.transforms import InterpolationMode

    return InterpolationMode(name)


class TimmRandAugment:
    """timm's RandAugment by v2's ops: `num_ops` ops, each applied with probability `p`, each at a magnitude drawn
    around `m` (N(m, mstd); mstd > 100: uniform in [0, m]), clipped to [0, min(mmax, 10)], as timm draws it per op.
    v2's ops are timm's increasing ones (posterize and solarize stronger with the magnitude: timm's inc1), with
    Identity where timm has Invert and SolarizeAdd."""

    def __init__(self, m: float, n: int, mstd: float, mmax: float, p: float, fill: list[int], **_):
        from torchvision.transforms import v2

        self.m, self.n, self.mstd, self.mmax, self.p = m, n, mstd, min(mmax, 10.0), p
        self.op = v2.RandAugment(1, 0, MAGNITUDE_BINS, interpolation=_interpolation("bilinear"), fill=fill)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            if self.p < 1.0 and float(torch.rand(())) > self.p:
                continue
            m = self.m
            if self.mstd > 100:
                m = float(torch.empty(()).uniform_(0, m))
            elif self.mstd > 0:
                m = float(torch.empty(()).normal_(m, self.mstd))
            self.op.magnitude = round(min(max(m, 0.0), self.mmax) / 10 * (MAGNITUDE_BINS - 1))
            image = self.op(image)
        return image


def auto_augment(spec: dict | None, fill: list[int]):
    """The v2 transform of a parsed --aa (cli.image_flags.parse_aa), or None."""
    from torchvision.transforms import v2

    if spec is None:
        return None
    bilinear = _interpolation("bilinear")
    if spec["kind"] == "trivialaugment":
        return v2.TrivialAugmentWide(interpolation=bilinear, fill=fill)
    if spec["kind"] == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy(spec["policy"]), interpolation=bilinear, fill=fill)
    if spec["kind"] == "augmix":
        return v2.AugMix(round(spec["m"]), spec["w"], spec["d"], spec["a"], interpolation=bilinear, fill=fill)
    return TimmRandAugment(fill=fill, **spec)


@contextlib.contextmanager
def native_conv():
    """oneDNN off for the augmentation's one convolution, v2's sharpness blur (3 x 3, one image, groups=3): oneDNN
    takes 4.5 ms for it here, ATen's own kernel 0.5 ms (bench/input_pipeline.py). The same image: the blur of uint8
    values by (1, 5)/13 is rounded, and (sum of integers)/13 is never within float error of a half."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


class Augment:
    """What follows a training sample's crop and flip: colour jitter, the --aa policy, then random erasing (timm's
    order: erasing last, where timm erases the normalised tensor), each on the (3, H, W) uint8 image."""

    def __init__(self, recipe: ImageRecipe):
        from torchvision.transforms import v2

        self.recipe = recipe
        self.augments = recipe.augments  # once: the property parses --aa, 5 % of a sample's time if asked per call
        cj = recipe.color_jitter
        self.jitter = v2.ColorJitter(brightness=cj, contrast=cj, saturation=cj) if cj > 0 else None
        self.auto = auto_augment(parse_aa(recipe.aa), recipe.fill())
        counts = range(1, recipe.recount + 1)
        self.erasers = {n: v2.RandomErasing(1.0, (ERASE_SCALE[0] / n, ERASE_SCALE[1] / n), ERASE_RATIO) for n in counts}
        self.mean = torch.tensor(recipe.mean).view(3, 1, 1)
        self.std = torch.tensor(recipe.std).view(3, 1, 1)

    def __call__(self, image: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """The sample's augmented image, every draw from `rng` (the sample's generator) and nothing else."""
        if not self.augments:
            return image
        with torch.random.fork_rng(devices=[]), native_conv():
            # the CPU generator alone: torch.manual_seed also seeds every device's (CUDA's lazy seeding records the
            # caller's stack), a third of this call's time in a loader worker, for generators v2 does not use here
            torch.default_generator.manual_seed(rng.getrandbits(63))
            if self.jitter is not None:
                image = self.jitter(image)
            if self.auto is not None:
                image = self.auto(image)
            if self.recipe.reprob > 0 and float(torch.rand(())) < self.recipe.reprob:
                image = self.erase(image)
        return image

    def erase(self, image: torch.Tensor) -> torch.Tensor:
        """timm's RandomErasing on uint8: 1 to --recount boxes (each of 1/count the area), placed by v2's
        RandomErasing, filled as --remode says in the normalised space and brought back to uint8 (pixel and rand:
        N(0, 1) there, so mean + std x N(0, 1), clipped to [0, 255]; const: 0 there, the mean colour)."""
        from torchvision.transforms.v2 import functional as F

        count = 1 if self.recipe.recount == 1 else int(torch.randint(1, self.recipe.recount + 1, ()))
        for _ in range(count):
            box = self.erasers[count].make_params([image])
            if box["v"] is None:  # no box fitted in its 10 tries
                continue
            h, w = box["h"], box["w"]
            shape = {"const": (3, 1, 1), "rand": (3, 1, 1), "pixel": (3, h, w)}[self.recipe.remode]
            normal = torch.zeros(shape) if self.recipe.remode == "const" else torch.randn(shape)
            value = ((self.mean + self.std * normal) * 255).round_().clamp_(0, 255).to(torch.uint8)
            image = F.erase(image, box["i"], box["j"], h, w, value.expand(3, h, w))
        return image


def validation_resize(size: int, crop_pct: float) -> int:
    """The shorter side a validation image is resized to before its centre crop (timm's floor(size / crop_pct))."""
    return math.floor(size / crop_pct)
