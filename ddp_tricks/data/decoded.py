"""ImageNet-style folders read as uint8: each JPEG decoded by torchvision's libjpeg-turbo (`decode_jpeg`), PIL for
the rest (PNG, CMYK, grayscale, whatever decode_jpeg refuses) and for a reduced decode (`draft()`, DCT-domain
downscaling) where the crop is at least twice the output; cropped, resized (antialiased) and flipped on uint8;
collated channels-last. The conversion to floating point and the normalisation happen once per batch, on the
device (`finish`, which data.feed.Feed applies to each batch): 4x fewer bytes cross shared memory, pinned
memory and the host-to-device copy than float32, and the CPU does no per-pixel arithmetic.

A training sample's crop and flip, and what the recipe adds after them (data/augment.py: colour jitter, --aa,
random erasing, by transforms.v2 on uint8), are drawn from a generator seeded by (seed, epoch, sample index) alone
(`sample_rng`), so the same sample gets the same augmentation at any number of workers and ranks, and a run
resumed on another world size follows the uninterrupted one. The recipe (data/recipe.py: timm's flags) also sets the
crop's scale and ratio, the flip's probability, the resize's interpolation, the validation resize and the mean and
std. An index past the folder's length is a repeat (--aug-repeats): the file of index mod length, augmented anew.
The epoch reaches worker processes (persistent ones too) through a shared-memory tensor that `seed_augmentation`
sets before each epoch's iteration starts.
"""

from __future__ import annotations

import io
import math
import random
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ddp_tricks.data.recipe import MEAN, STD, ImageRecipe
from ddp_tricks.errors import UserError

SCALE = (0.08, 1.0)  # RandomResizedCrop's defaults
RATIO = (3 / 4, 4 / 3)
GPU_IMAGES_PER_SECOND = 3000  # about what one A100 trains ResNet-50 at (FFCV's and DALI's figures): what to feed
TIMED = 8  # training samples timed at start for the run's input line (after one to warm up)
# a reduced decode where the crop is at least this many times the output on both sides, in an image of at least
# DRAFT_PIXELS: at ImageNet's sizes (about 500 x 375) PIL's reduced decode is no faster than decode_jpeg's whole one
DRAFT_FROM = 2.0
DRAFT_PIXELS = 600_000
JPEG_SUFFIXES = (".jpg", ".jpeg")


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The generator of one sample's augmentation in one epoch: a function of (seed, epoch, index) alone."""
    return random.Random((seed * 1_000_003 + epoch) * 4_294_967_311 + index)


def crop_box(rng: random.Random, width: int, height: int, scale=SCALE, ratio=RATIO) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, height, width) for an image of width x height, by torchvision's own
    rule (10 tries of a random area in `scale` and aspect ratio in `ratio`, then the central crop of the clamped
    ratio), drawn from `rng`."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _pil_to_tensor(image) -> torch.Tensor:
    """A PIL image as a (3, H, W) uint8 tensor over its (H, W, 3) pixels (copied where numpy's view is read-only)."""
    import numpy as np

    pixels = np.asarray(image.convert("RGB"))
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy()).permute(2, 0, 1)


def read_image(path: str, choose, output: tuple[int, int], draft: bool = True):
    """One image file as (pixels, box): a (3, H, W) uint8 tensor and the crop box (top, left, height, width) that
    `choose(width, height)` picks from the image's size, in the pixels' coordinates. A JPEG is decoded by
    decode_jpeg, or by PIL reduced by 2, 4 or 8 (`draft`) where the box is at least DRAFT_FROM times `output`
    (height, width) on both sides of a large image; anything else by PIL. A file neither reads is one line naming it."""
    from PIL import Image

    try:
        data = Path(path).read_bytes()
        image = Image.open(io.BytesIO(data))  # reads the header only: size, mode, format
        width, height = image.size
        box = choose(width, height)
        factor = min(box[2] / output[0], box[3] / output[1])
        if draft and image.format == "JPEG" and factor >= DRAFT_FROM and width * height >= DRAFT_PIXELS:
            reduce = 2 ** min(3, int(math.log2(factor)))
            image.draft("RGB", (max(1, width // reduce), max(1, height // reduce)))  # PIL's rule: size // scale
            pixels = _pil_to_tensor(image)
            return pixels, _scaled(box, pixels.shape[2] / width, pixels.shape[1] / height)
        if image.format == "JPEG" and image.mode == "RGB":
            from torchvision.io import decode_jpeg

            try:
                return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)), box
            except RuntimeError:
                pass  # a JPEG that libjpeg-turbo refuses: PIL may still read it
        return _pil_to_tensor(image), box
    except (OSError, ValueError, SyntaxError) as error:
        raise UserError(f"cannot read the image {path!r} ({error}): remove or replace the file") from None


def _scaled(box, sx: float, sy: float) -> tuple[int, int, int, int]:
    """A box in the coordinates of the image scaled by (sx, sy)."""
    top, left, h, w = box
    return int(top * sy), int(left * sx), max(1, round(h * sy)), max(1, round(w * sx))


def on_device(
    images: torch.Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = True, mean=MEAN, std=STD
) -> torch.Tensor:
    """A uint8 batch (N, 3, H, W), already on its device, as the model's input: `dtype`, scaled to [0, 1] and
    normalised by `mean` and `std` (ImageNet's by default) with the reference's own arithmetic (ToTensor's division
    by 255, then Normalize's subtraction and division), in channels-last memory or contiguous."""
    mean = torch.tensor(mean, dtype=dtype, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=dtype, device=images.device).view(1, 3, 1, 1)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return images.to(dtype).div_(255).sub_(mean).div_(std).contiguous(memory_format=layout)


def collate_channels_last(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, label) samples as one uint8 batch (N, 3, H, W) in channels-last memory (each image's (H, W, 3)
    pixels copied once) and a label tensor."""
    first = samples[0][0]
    batch = torch.empty((len(samples), *first.shape[1:], first.shape[0]), dtype=torch.uint8)
    for row, (image, _) in zip(batch, samples):
        row.copy_(image.permute(1, 2, 0))
    return batch.permute(0, 3, 1, 2), torch.tensor([label for _, label in samples], dtype=torch.long)


class DecodedImages(Dataset):
    """An ImageNet-style folder (one sub-folder per class) whose samples are (uint8 image, label): training
    samples with RandomResizedCrop, a horizontal flip and the recipe's augmentation drawn from `sample_rng`
    (train=True), validation samples resized (the shorter side to size / crop_pct) and centre-cropped. `finish` makes
    a batch the model's input on the device (normalised by the recipe's mean and std)."""

    repeats = True  # an index past the length is a repeat of index mod length, augmented anew (--aug-repeats)

    def __init__(
        self, root: str, size: int, train: bool, draft: bool = True, seed: int = 0, recipe: ImageRecipe | None = None
    ):
        from torchvision import datasets

        from ddp_tricks.data.augment import Augment

        folder = datasets.ImageFolder(root, loader=str)  # lists the files and classes; reads none
        self.samples, self.classes = folder.samples, folder.classes
        self.size, self.train, self.draft = size, train, draft
        self.recipe = recipe or ImageRecipe()
        self.augment = Augment(self.recipe) if train and self.recipe.augments else None
        # (seed, epoch) in shared memory: worker processes, persistent ones too, see each epoch's
        self.epoch = torch.tensor([seed, 0], dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the model's input images."""
        return 3, self.size, self.size

    collate = staticmethod(collate_channels_last)
    backend = "data backend torchvision: decode_jpeg (PIL for the rest) in the loader's workers"

    def describe(self) -> str:
        """The input pipeline in a line, for the run's log: with training samples, this machine's CPU time per sample
        and the cores one GPU needs at that rate."""
        line = f"image folder of {len(self)} images at {self.size} px, {self.backend}, uint8, normalised on the device"
        line += f"; then {self.recipe.describe()}" if self.train and self.recipe.augments else ""
        return line + (f"; {cores_per_gpu(self)}" if self.train and len(self) > 1 else "")

    def finish(self, images: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
        """A uint8 batch of this dataset's images as the model's float32 input on `device` (the copy non-blocking:
        from pinned memory it overlaps the compute)."""
        moved = images.to(device, non_blocking=True)
        return on_device(moved, torch.float32, channels_last, self.recipe.mean, self.recipe.std)

    def seed_augmentation(self, seed: int, epoch: int) -> None:
        """The epoch's augmentation: set before the epoch's iteration starts (loaders.seed_epoch)."""
        self.epoch[0], self.epoch[1] = seed, epoch

    def box_and_flip(self, index: int, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """A training sample's crop box (top, left, height, width) in an image of width x height and whether it is
        flipped, in the current epoch; a validation sample's box is the whole image."""
        return self.draws(index, width, height)[:2]

    def draws(self, index: int, width: int, height: int) -> tuple[tuple[int, int, int, int], bool, random.Random]:
        """box_and_flip's, and the sample's generator after them, which the rest of its augmentation draws from."""
        seed, epoch = self.epoch.tolist()
        rng = sample_rng(seed, epoch, index)
        if not self.train:
            return (0, 0, height, width), False, rng
        box = crop_box(rng, width, height, self.recipe.scale, self.recipe.ratio)
        return box, rng.random() < self.recipe.hflip, rng

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.transforms.v2 import functional as F

        from ddp_tricks.data.augment import validation_resize

        path, label = self.samples[index % len(self.samples)]
        decided = {}

        def choose(width: int, height: int) -> tuple[int, int, int, int]:
            decided["box"], decided["flip"], decided["rng"] = self.draws(index, width, height)
            return decided["box"]

        interpolation = F.InterpolationMode(self.recipe.interpolation)
        if not self.train:  # the reference's Resize (the shorter side) then CenterCrop
            resize = validation_resize(self.size, self.recipe.crop_pct)
            pixels, _ = read_image(path, choose, (resize, resize), self.draft)
            image = F.resize(pixels, resize, interpolation, antialias=True)
            return F.center_crop(image, [self.size, self.size]), label
        pixels, box = read_image(path, choose, (self.size, self.size), self.draft)
        image = F.resized_crop(pixels, *box, [self.size, self.size], interpolation, antialias=True)
        image = F.horizontal_flip(image) if decided["flip"] else image
        return (image if self.augment is None else self.augment(image, decided["rng"])), label


def seconds_per_sample(dataset, count: int = TIMED) -> float:
    """The CPU time (every thread of this process: the cores a loader worker keeps busy) per sample of `dataset`, on
    its samples 1 to `count` (sample 0 first, untimed: the first call's one-off costs)."""
    dataset[0]
    timed = range(1, min(count, len(dataset) - 1) + 1)
    start = time.process_time()
    for index in timed:
        dataset[index]
    return (time.process_time() - start) / len(timed)


def cores_per_gpu(dataset, images_per_second: float = GPU_IMAGES_PER_SECOND) -> str:
    """How many of this machine's cores one GPU training at `images_per_second` needs to be fed, from the measured
    CPU time per sample (a few samples at start: a first estimate; bench/input_pipeline.py measures it properly)."""
    seconds = seconds_per_sample(dataset)
    return (
        f"{seconds * 1e3:.1f} ms of CPU per image here: one GPU at {images_per_second:,.0f} images/s needs about "
        f"{images_per_second * seconds:.1f} cores"
    )
