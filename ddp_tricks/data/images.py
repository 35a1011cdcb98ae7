"""The built-in task's image datasets, read from what is on disk or inside installed packages: scikit-learn's
8x8 digits, MNIST IDX files, torchvision's MNIST / Fashion-MNIST / CIFAR-10, and ImageNet-style folders.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ddp_tricks.data.in_memory import InMemoryDataset
from ddp_tricks.errors import UserError

VAL_FRACTION = 0.2
SPLIT_SEED = 0  # fixed, so every run and every world size sees the same split


def split_in_memory(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[InMemoryDataset, InMemoryDataset]:
    """Split 80/20 into train/val by a fixed seed, standardised with the training part's mean and std."""
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = int(round(len(targets) * VAL_FRACTION))
    val_idx, train_idx = order[:n_val], order[n_val:]
    mean, std = inputs[train_idx].mean().item(), inputs[train_idx].std().item()
    inputs = ((inputs - mean) / std).contiguous()
    return InMemoryDataset(inputs[train_idx], targets[train_idx]), InMemoryDataset(inputs[val_idx], targets[val_idx])


def digits() -> tuple[InMemoryDataset, InMemoryDataset]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): no download. Read from the file scikit-learn
    ships (what its load_digits reads), without importing scikit-learn, which takes a second of every rank's
    start; load_digits itself where that file is not found."""
    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if shipped is not None and shipped.is_file():
        table = np.loadtxt(shipped, delimiter=",", dtype=np.float32)  # a row: 64 pixels (0..16), then the label
        pixels, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.images, bunch.target
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    return split_in_memory(images, torch.tensor(labels, dtype=torch.long))


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (MNIST's format), gzipped or not: a big-endian header of dimensions, then uint8 data."""
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise UserError(f"{str(path)!r} is not an IDX file of unsigned bytes (MNIST format)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    values = torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8)
    if values.numel() != math.prod(dims):
        raise UserError(f"{str(path)!r} is truncated: expected {math.prod(dims)} values, found {values.numel()}")
    return values.view(*dims)


def mnist_idx(root: str) -> tuple[InMemoryDataset, InMemoryDataset]:
    """The first *images-idx3-ubyte[.gz] / *labels-idx1-ubyte[.gz] pair in `root`, split 80/20."""
    images = sorted(Path(root).glob("*images-idx3-ubyte*"))
    labels = sorted(Path(root).glob("*labels-idx1-ubyte*"))
    if not images or not labels:
        raise UserError(
            f"no MNIST IDX files (*images-idx3-ubyte[.gz], *labels-idx1-ubyte[.gz]) in --data-root {root!r}"
        )
    x = read_idx(images[0]).float().unsqueeze(1) / 255.0
    return split_in_memory(x, read_idx(labels[0]).long())


def resized(dataset: InMemoryDataset, size: int) -> InMemoryDataset:
    """Every image resized to size x size once (bilinear, antialiased when shrinking): a cheaper input."""
    import torch.nn.functional as F

    inputs = F.interpolate(dataset.inputs, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return InMemoryDataset(inputs.contiguous(), dataset.targets)


def _missing(root: str, what: str) -> UserError:
    return UserError(
        f"{what} not found under --data-root {root!r}: put the files there, "
        f"or add --download to let torchvision fetch them"
    )


def mnist_like(name: str, root: str, download: bool) -> tuple[InMemoryDataset, InMemoryDataset]:
    """torchvision's MNIST or Fashion-MNIST files, held in memory, standardised by the training set."""
    from torchvision import datasets

    cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
    try:
        train = cls(root, train=True, download=download)
        val = cls(root, train=False, download=download)
    except (RuntimeError, OSError) as error:
        raise _missing(root, cls.__name__) from error
    x_train = train.data.float().unsqueeze(1) / 255.0
    mean, std = x_train.mean().item(), x_train.std().item()
    x_val = val.data.float().unsqueeze(1) / 255.0
    return (
        InMemoryDataset(((x_train - mean) / std).contiguous(), train.targets.clone()),
        InMemoryDataset(((x_val - mean) / std).contiguous(), val.targets.clone()),
    )


def cifar10(root: str, download: bool) -> tuple[Dataset, Dataset]:
    """CIFAR-10 with random crops and flips for training."""
    from torchvision import datasets, transforms

    normalise = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    augment = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalise]
    )
    plain = transforms.Compose([transforms.ToTensor(), normalise])
    try:
        train = datasets.CIFAR10(root, train=True, transform=augment, download=download)
        val = datasets.CIFAR10(root, train=False, transform=plain, download=download)
    except (RuntimeError, OSError) as error:
        raise _missing(root, "CIFAR10") from error
    return train, val


def image_folders(
    train_dir: str, val_dir: str, size: int, draft: bool = True, backend: str = "torchvision", recipe=None
) -> tuple[Dataset, Dataset]:
    """ImageNet-style folders (one sub-folder per class) read as uint8 (data.decoded): the usual
    random-resized-crop training and what `recipe` (data.recipe.ImageRecipe: timm's flags) adds, each sample's
    augmentation a function of (seed, epoch, index); the normalisation happens on the device. `backend`: torchvision
    (decoded by the CPU workers), gpu-decode (decoded on the GPU, data.gpu_decode), dali (NVIDIA DALI decodes and
    augments the batch, data.dali), these two with the default recipe only."""
    from ddp_tricks.data import gpu_decode
    from ddp_tricks.data.decoded import DecodedImages
    from ddp_tricks.data.recipe import ImageRecipe

    recipe = recipe or ImageRecipe()
    if backend != "torchvision" and recipe != ImageRecipe():
        changed = [name for name, value in vars(recipe).items() if value != getattr(ImageRecipe(), name)]
        raise UserError(
            f"--{changed[0].replace('_', '-')} is done by --data-backend torchvision only (this run's is {backend}): "
            "use it, or leave the image recipe's flags at their defaults"
        )

    if backend == "dali":
        from ddp_tricks.data import dali

        dali.check()  # NVIDIA DALI importable (its CPU operators run without a GPU), else one line
        kind = dali.DaliImages
    else:
        gpu_decode.check_backend(backend)
        kind = gpu_decode.EncodedImages if backend == "gpu-decode" else DecodedImages

    for flag, path in (("--train-dir", train_dir), ("--val-dir", val_dir)):
        if not Path(path).is_dir():
            raise UserError(
                f"{flag} {path!r} is not a folder: give an ImageNet-style folder with one sub-folder per class"
            )
    try:
        options = {"recipe": recipe} if kind is DecodedImages else {}
        train = kind(train_dir, size, train=True, draft=draft, **options)
        val = kind(val_dir, size, train=False, draft=draft, **options)
    except (FileNotFoundError, OSError) as error:
        raise UserError(
            f"cannot read the image folders ({error}); each needs one sub-folder of images per class"
        ) from None
    if train.classes != val.classes:
        raise UserError(
            f"--train-dir has classes {train.classes[:5]}... but --val-dir has {val.classes[:5]}...; they must match"
        )
    if len(train.classes) < 2:
        raise UserError(
            f"--train-dir {train_dir!r} has {len(train.classes)} class folder: a classifier needs at least two"
        )
    return train, val
