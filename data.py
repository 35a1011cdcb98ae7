"""Datasets (embedded digits, MNIST/Fashion-MNIST/CIFAR-10 files, image folders), their loaders, and the
exact evaluation split: every validation sample is seen by exactly one rank, none padded in twice.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from config import UserError
from customized_function import seed_worker

DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed, so every run and every world size sees the same split


class InMemoryDataset(Dataset):
    """Samples held as one tensor: a batch is one indexing operation, with no per-sample Python."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.inputs[index], self.targets[index]


def _batch_as_is(batch):
    """collate_fn for InMemoryDataset, whose __getitems__ already returns a batch."""
    return batch


@dataclass
class Data:
    train_set: Dataset
    val_set: Dataset
    num_classes: int
    in_channels: int
    image_size: int


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r + world, r + 2*world, ...: each sample exactly once, no padding."""

    def __init__(self, length: int, num_replicas: int, rank: int):
        self.indices = range(rank, length, num_replicas)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way: `skip` of this rank's samples are left out."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


def start_epoch(loader: DataLoader, epoch: int, seed: int, rank: int, skip_samples: int = 0) -> None:
    """A new shuffle (set_epoch), and this epoch's randomness (augmentation, worker seeds) as a function of
    (seed, rank, epoch) alone, so a resumed run draws what the uninterrupted run drew."""
    loader.sampler.set_epoch(epoch)
    loader.sampler.skip = skip_samples
    epoch_seed = (seed * 1_000_003 + rank) * 1_009 + epoch
    loader.generator.manual_seed(epoch_seed)
    torch.manual_seed(epoch_seed)


def load(cfg: argparse.Namespace) -> Data:
    """The datasets the flags name; a missing or unreadable path raises UserError naming it."""
    if cfg.dataset == "digits":
        return _digits()
    if cfg.dataset in ("mnist", "fashion-mnist"):
        return _mnist_like(cfg)
    if cfg.dataset == "cifar10":
        return _cifar10(cfg)
    if cfg.dataset == "mnist-idx":
        return _mnist_idx(cfg)
    return _image_folder(cfg)


def _standardised(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return ((images - mean) / std).contiguous()


def _split_in_memory(images: torch.Tensor, targets: torch.Tensor, in_channels: int, image_size: int) -> Data:
    """Split 80/20 into train/val by a fixed seed, standardised with the training part's mean and std."""
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    n_val = int(round(len(targets) * DIGITS_VAL_FRACTION))
    val_idx, train_idx = order[:n_val], order[n_val:]
    mean, std = images[train_idx].mean().item(), images[train_idx].std().item()
    images = _standardised(images, mean, std)
    return Data(
        InMemoryDataset(images[train_idx], targets[train_idx]),
        InMemoryDataset(images[val_idx], targets[val_idx]),
        num_classes=10,
        in_channels=in_channels,
        image_size=image_size,
    )


def _digits() -> Data:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return _split_in_memory(images, torch.tensor(bunch.target, dtype=torch.long), in_channels=1, image_size=8)


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (MNIST's format), gzipped or not: a big-endian header of dimensions, then uint8 data."""
    import gzip

    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise UserError(f"{str(path)!r} is not an IDX file of unsigned bytes (MNIST format)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8)
    if data.numel() != math.prod(dims):
        raise UserError(f"{str(path)!r} is truncated: expected {math.prod(dims)} values, found {data.numel()}")
    return data.view(*dims)


def _mnist_idx(cfg: argparse.Namespace) -> Data:
    root = Path(cfg.data_root)
    images = sorted(root.glob("*images-idx3-ubyte*"))
    labels = sorted(root.glob("*labels-idx1-ubyte*"))
    if not images or not labels:
        raise UserError(
            f"no MNIST IDX files (*images-idx3-ubyte[.gz], *labels-idx1-ubyte[.gz]) in --data-root {str(root)!r}"
        )
    x = read_idx(images[0]).float().unsqueeze(1) / 255.0
    return _split_in_memory(x, read_idx(labels[0]).long(), in_channels=1, image_size=28)


def _missing(cfg: argparse.Namespace, what: str) -> UserError:
    return UserError(
        f"{what} not found under --data-root {cfg.data_root!r}: put the files there, "
        f"or add --download to let torchvision fetch them"
    )


def _mnist_like(cfg: argparse.Namespace) -> Data:
    from torchvision import datasets

    cls = datasets.MNIST if cfg.dataset == "mnist" else datasets.FashionMNIST
    try:
        train = cls(cfg.data_root, train=True, download=cfg.download)
        val = cls(cfg.data_root, train=False, download=cfg.download)
    except (RuntimeError, OSError) as error:
        raise _missing(cfg, cls.__name__) from error
    x_train = train.data.float().unsqueeze(1) / 255.0
    mean, std = x_train.mean().item(), x_train.std().item()
    x_val = val.data.float().unsqueeze(1) / 255.0
    return Data(
        InMemoryDataset(_standardised(x_train, mean, std), train.targets.clone()),
        InMemoryDataset(_standardised(x_val, mean, std), val.targets.clone()),
        num_classes=10,
        in_channels=1,
        image_size=28,
    )


def _cifar10(cfg: argparse.Namespace) -> Data:
    from torchvision import datasets, transforms

    normalise = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    augment = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalise]
    )
    plain = transforms.Compose([transforms.ToTensor(), normalise])
    try:
        train = datasets.CIFAR10(cfg.data_root, train=True, transform=augment, download=cfg.download)
        val = datasets.CIFAR10(cfg.data_root, train=False, transform=plain, download=cfg.download)
    except (RuntimeError, OSError) as error:
        raise _missing(cfg, "CIFAR10") from error
    return Data(train, val, num_classes=10, in_channels=3, image_size=32)


def _image_folder(cfg: argparse.Namespace) -> Data:
    from torchvision import datasets, transforms

    for flag, path in (("--train-dir", cfg.train_dir), ("--val-dir", cfg.val_dir)):
        if not Path(path).is_dir():
            raise UserError(
                f"{flag} {path!r} is not a folder: give an ImageNet-style folder with one sub-folder per class"
            )
    normalise = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    size = cfg.image_size
    augment = transforms.Compose(
        [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalise]
    )
    plain = transforms.Compose(
        [transforms.Resize(int(size * 256 / 224)), transforms.CenterCrop(size), transforms.ToTensor(), normalise]
    )
    try:
        train = datasets.ImageFolder(cfg.train_dir, transform=augment)
        val = datasets.ImageFolder(cfg.val_dir, transform=plain)
    except (FileNotFoundError, OSError) as error:
        raise UserError(
            f"cannot read the image folders ({error}); each needs one sub-folder of images per class"
        ) from None
    if train.classes != val.classes:
        raise UserError(
            f"--train-dir has classes {train.classes[:5]}... but --val-dir has {val.classes[:5]}...; they must match"
        )
    return Data(train, val, num_classes=len(train.classes), in_channels=3, image_size=size)


def check_sizes(data: Data, world_size: int) -> None:
    """Combinations the datasets make impossible, found before any process group exists."""
    if len(data.val_set) < world_size:
        raise UserError(
            f"the validation set has {len(data.val_set)} samples, fewer than the {world_size} processes; "
            "launch fewer processes"
        )
    if len(data.train_set) < world_size:
        raise UserError(f"the training set has {len(data.train_set)} samples, fewer than the {world_size} processes")


def _loader_options(cfg: argparse.Namespace, dataset: Dataset, device: torch.device, seed: int) -> dict:
    options = dict(
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=seed_worker,
    )
    if cfg.workers > 0:
        options.update(persistent_workers=True, prefetch_factor=cfg.prefetch_factor)
    if isinstance(dataset, InMemoryDataset):
        options["collate_fn"] = _batch_as_is
    return options


def train_loader(
    cfg: argparse.Namespace, dataset: Dataset, rank: int, world_size: int, device: torch.device
) -> DataLoader:
    """Shuffled by DistributedSampler (seeded by --seed; call start_epoch every epoch), padded to equal length."""
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    # Workers get seed + rank, so augmentation differs between ranks.
    return DataLoader(
        dataset, batch_size=cfg.batch_size, sampler=sampler, **_loader_options(cfg, dataset, device, cfg.seed + rank)
    )


def val_loader(
    cfg: argparse.Namespace, dataset: Dataset, rank: int, world_size: int, device: torch.device
) -> DataLoader:
    """Each validation sample on exactly one rank (no padding), so reduced sums are the exact totals."""
    sampler = ShardSampler(len(dataset), world_size, rank)
    return DataLoader(
        dataset, batch_size=cfg.val_batch_size, sampler=sampler, **_loader_options(cfg, dataset, device, cfg.seed)
    )
