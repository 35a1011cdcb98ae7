"""ImageNet-style folders read as uint8 (#50): decoded by decode_jpeg (PIL for PNG, grayscale, CMYK), cropped,
flipped and collated channels-last on uint8, normalised on the device by the Feed; the model sees what torchvision's
reference transforms compute for the same crop and flip. Each sample's augmentation is a function of (seed, epoch,
index): the same at 0, 1 and 2 workers and on any rank."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import functional as reference_pil
from torchvision.transforms.v2 import functional as reference

from ddp_tricks.data import images, loaders
from ddp_tricks.data.decoded import MEAN, STD, DecodedImages, read_image
from ddp_tricks.data.feed import Feed
from ddp_tricks.errors import UserError

SIZE = 24


def smooth_picture(rng: np.random.Generator, height: int, width: int, channels: int = 3) -> np.ndarray:
    """A picture with edges and gradients (JPEG of noise is not what a decoder meets)."""
    y, x = np.mgrid[0:height, 0:width]
    planes = [np.sin(x / rng.uniform(2, 9) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(2, 9)) for _ in range(3)]
    picture = (np.stack(planes, -1) * 110 + 128 + rng.normal(0, 8, (height, width, 3))).clip(0, 255).astype(np.uint8)
    return picture if channels == 3 else picture[..., 0]


def write_folder(root, sizes=((48, 64), (64, 40), (56, 56), (40, 60)), per_class: int = 4, seed: int = 0):
    """A JPEG folder of two classes at quality 90 (heights x widths from `sizes`)."""
    rng = np.random.default_rng(seed)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            height, width = sizes[i % len(sizes)]
            Image.fromarray(smooth_picture(rng, height, width)).save(root / label / f"{i}.jpg", quality=90)
    return root


def finished(image: torch.Tensor) -> torch.Tensor:
    """The reference's last two transforms: ToDtype(float32, scale=True), Normalize(ImageNet's mean and std)."""
    return reference.normalize(reference.to_dtype(image, torch.float32, scale=True), MEAN, STD)


def reference_input(path, box, flip: bool, size: int = SIZE) -> torch.Tensor:
    """torchvision's reference for one training sample (its classification presets, tensor backend: PILToTensor,
    RandomResizedCrop(antialias=True), RandomHorizontalFlip, ToDtype(scale=True), Normalize) with the crop box
    and flip given: PIL's decode, then transforms.v2's functions."""
    pixels = reference.pil_to_tensor(Image.open(path).convert("RGB"))
    image = reference.resized_crop(pixels, *box, [size, size], antialias=True)
    return finished(reference.horizontal_flip(image) if flip else image)


def model_input(dataset: DecodedImages, indices) -> torch.Tensor:
    """The batch of these samples as the model sees it: collated by the training loader, finished by its Feed."""
    loader = DataLoader(dataset, batch_sampler=[list(indices)], collate_fn=dataset.collate)
    feed = Feed(loader, torch.device("cpu"), functools.partial(dataset.finish, channels_last=True))
    (inputs, _), *rest = list(feed)
    assert rest == []
    return inputs


@pytest.mark.timeout(60)
def test_the_model_sees_the_reference_s_values_for_the_same_crop_and_flip(tmp_path):
    """Each training sample, on the device, equals torchvision's reference transforms applied to PIL's decode of the
    file for the sample's crop box and flip (within 1e-6); the batch arrives uint8 from the loader and float32 in
    channels-last memory from the Feed. Broken on purpose: normalising by (x - mean) / std without the division by
    255 fails it, and so does a sample flipped where its draw says not."""
    train = DecodedImages(str(write_folder(tmp_path / "train")), SIZE, train=True, draft=False, seed=3)
    train.seed_augmentation(3, 2)
    uint8, _ = train.collate([train[i] for i in range(len(train))])
    assert uint8.dtype == torch.uint8 and uint8.is_contiguous(memory_format=torch.channels_last)
    inputs = model_input(train, range(len(train)))
    assert inputs.dtype == torch.float32 and inputs.is_contiguous(memory_format=torch.channels_last)
    flips = []
    for index, (path, _) in enumerate(train.samples):
        width, height = Image.open(path).size
        box, flip = train.box_and_flip(index, width, height)
        flips.append(flip)
        torch.testing.assert_close(inputs[index], reference_input(path, box, flip), rtol=0, atol=1e-6)
    assert 0 < sum(flips) < len(flips)  # both kinds of sample were compared


@pytest.mark.timeout(60)
def test_pil_s_own_resize_differs_by_at_most_one_level_in_a_few_pixels(tmp_path):
    """Against the reference's PIL backend (PIL's resize, ToTensor), torch's antialiased uint8 resize rounds
    differently in some pixels, by one level of 255 at most. Broken on purpose: a bilinear resize without
    antialiasing fails it."""
    train = DecodedImages(str(write_folder(tmp_path / "train")), SIZE, train=True, draft=False, seed=3)
    inputs = model_input(train, range(len(train)))
    one_level = 1 / 255 / min(STD) + 1e-6
    differing = 0
    for index, (path, _) in enumerate(train.samples):
        width, height = Image.open(path).size
        box, flip = train.box_and_flip(index, width, height)
        image = reference_pil.resized_crop(Image.open(path).convert("RGB"), *box, [SIZE, SIZE])
        image = reference_pil.hflip(image) if flip else image
        expected = reference_pil.normalize(reference_pil.to_tensor(image), MEAN, STD)
        assert (inputs[index] - expected).abs().max() <= one_level
        differing += int(((inputs[index] - expected).abs() > 1e-6).sum())
    assert differing <= 0.02 * inputs.numel()


@pytest.mark.timeout(60)
def test_validation_is_the_reference_s_resize_and_centre_crop(tmp_path):
    """A validation sample equals the reference's Resize(size x 256 / 224) then CenterCrop(size), normalised.
    Broken on purpose: resizing the crop box instead of the whole image fails it."""
    val = DecodedImages(str(write_folder(tmp_path / "val")), SIZE, train=False, draft=False)
    inputs = model_input(val, range(len(val)))
    for index, (path, _) in enumerate(val.samples):
        pixels = reference.pil_to_tensor(Image.open(path).convert("RGB"))
        image = reference.center_crop(reference.resize(pixels, int(SIZE * 256 / 224), antialias=True), SIZE)
        expected = finished(image)
        torch.testing.assert_close(inputs[index], expected, rtol=0, atol=1e-6)


@pytest.mark.timeout(60)
def test_png_grayscale_and_cmyk_images_are_read_by_pil_as_rgb(tmp_path):
    """Files decode_jpeg does not take (a PNG, a grayscale and a CMYK JPEG) come out as PIL's RGB conversion.
    Broken on purpose: sending every JPEG to decode_jpeg fails it (the grayscale one comes out with one channel)."""
    rng = np.random.default_rng(1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    Image.fromarray(smooth_picture(rng, 40, 50)).save(tmp_path / "a" / "p.png")
    Image.fromarray(smooth_picture(rng, 40, 50, channels=1)).save(tmp_path / "a" / "g.jpg", quality=90)
    Image.fromarray(smooth_picture(rng, 40, 50)).convert("CMYK").save(tmp_path / "b" / "c.jpg", quality=90)
    val = DecodedImages(str(tmp_path), SIZE, train=False, draft=False)
    for path, _ in val.samples:
        pixels, box = read_image(path, lambda w, h: (0, 0, h, w), (SIZE, SIZE), draft=False)
        expected = reference_pil.pil_to_tensor(Image.open(path).convert("RGB"))
        assert pixels.shape[0] == 3 and torch.equal(pixels, expected), path
        assert box == (0, 0, 40, 50)


@pytest.mark.timeout(60)
def test_a_corrupt_image_is_one_line_naming_it(tmp_path):
    """In the process and from a worker, through the Feed. Broken on purpose: letting PIL's error through fails it (no
    UserError); so does the Feed passing the worker's UserError on as DataLoader wraps it (its traceback inside)."""
    write_folder(tmp_path / "train")
    broken = tmp_path / "train" / "cat" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    train = DecodedImages(str(tmp_path / "train"), SIZE, train=True)
    index = [path for path, _ in train.samples].index(str(broken))
    with pytest.raises(UserError) as error:
        train[index]
    assert str(broken) in str(error.value) and "\n" not in str(error.value)
    loader = DataLoader(train, batch_sampler=[[index]], collate_fn=train.collate, num_workers=1)
    with pytest.raises(UserError) as error:  # from a worker process, through the Feed
        list(Feed(loader, torch.device("cpu"), train.finish))
    assert str(error.value).startswith("cannot read the image") and str(broken) in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.timeout(60)
def test_a_large_image_is_decoded_reduced_where_the_crop_allows_and_stays_close(tmp_path):
    """A 1200 x 900 image cropped to SIZE is decoded reduced (DCT-domain downscaling), its box scaled with it; the
    result stays close to the whole decode's (the reduced decode averages pixels as the resize would). Broken on
    purpose: a box left in the original coordinates fails it."""
    rng = np.random.default_rng(2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    Image.fromarray(smooth_picture(rng, 900, 1200)).save(tmp_path / "a" / "big.jpg", quality=90)
    Image.fromarray(smooth_picture(rng, 900, 1200)).save(tmp_path / "b" / "big.jpg", quality=90)
    box = (100, 200, 600, 640)
    reduced, scaled = read_image(str(tmp_path / "a" / "big.jpg"), lambda w, h: box, (SIZE, SIZE), draft=True)
    assert reduced.shape[1:] == (math.ceil(900 / 8), math.ceil(1200 / 8)) and scaled == (12, 25, 75, 80)
    for draft in (True, False):
        train = DecodedImages(str(tmp_path), SIZE, train=True, draft=draft, seed=0)
        train.box_and_flip = lambda index, width, height: (box, False)
        if draft:
            drafted = model_input(train, [0, 1])
        else:
            whole = model_input(train, [0, 1])
    assert (drafted - whole).abs().mean() < 0.05 and (drafted - whole).abs().max() < 1.0


@pytest.mark.timeout(60)
def test_the_feed_finishes_batches_as_a_batch_made_outside_the_loader_is(tmp_path):
    """The Feed's batches and a batch made outside the loader (loaders.batch_of: the task's checks, the evaluation's
    batch of no sample) are both finished: float, normalised, contiguous unless channels-last was asked. Broken on
    purpose: batch_of without the dataset's finish fails it."""
    write_folder(tmp_path / "train")
    write_folder(tmp_path / "val", seed=1)
    train, val = images.image_folders(str(tmp_path / "train"), str(tmp_path / "val"), SIZE)

    class Dist:
        rank, world_size, device = 0, 1, torch.device("cpu")

    for channels_last in (False, True):
        _, feed = loaders.both(train, val, Dist, val_batch_size=3, seed=0, channels_last=channels_last)
        assert isinstance(feed, Feed)
        inputs, targets = next(iter(feed))
        assert inputs.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        made, made_targets = loaders.batch_of(val, [0, 1, 2])
        for batch in (inputs, made):
            assert batch.dtype == torch.float32 and batch.shape == (3, 3, SIZE, SIZE)
        torch.testing.assert_close(made, inputs, rtol=0, atol=0)
        assert torch.equal(made_targets, targets)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
@pytest.mark.timeout(120)
def test_the_feed_on_a_gpu_equals_the_cpu_s_batches(tmp_path):
    """On CUDA the Feed copies from pinned memory and finishes each batch on a side stream, one batch ahead: the
    batches equal the CPU's, in order. Broken on purpose: yielding before the compute stream waits for the side
    stream may fail it (a race); reading `ahead` after staging the next fails it always."""
    train = DecodedImages(str(write_folder(tmp_path / "train", per_class=8)), SIZE, train=True, seed=5)
    batches = [list(range(k, k + 4)) for k in range(0, 16, 4)]
    cpu = Feed(DataLoader(train, batch_sampler=batches, collate_fn=train.collate), torch.device("cpu"), train.finish)
    loader = DataLoader(train, batch_sampler=batches, collate_fn=train.collate, pin_memory=True, num_workers=2)
    gpu = Feed(loader, torch.device("cuda"), train.finish)
    got = [(x.cpu(), y.cpu()) for x, y in gpu]
    assert len(got) == len(batches)
    for (x, y), (ex, ey) in zip(got, cpu):
        torch.testing.assert_close(x, ex, rtol=0, atol=1e-6)
        assert torch.equal(y, ey)


class _Steps:
    """An epoch of the plan as PlanSampler reads it: steps of micro-batches (lists of sample indices)."""

    def __init__(self, micro_batches):
        self.micro_batches = micro_batches


def crops_by_sample(dataset: DecodedImages, workers: int, rank: int, world_size: int, epochs=(1, 2)) -> dict:
    """Each sample's training image in each epoch, fetched through one training loader (persistent workers kept
    across the epochs) on `rank` of `world_size`, whose share is every world_size-th micro-batch of 2 samples."""
    loader = loaders.train_loader(dataset, rank, torch.device("cpu"), seed=7, workers=workers)
    micro_batches = [list(range(k, min(k + 2, len(dataset)))) for k in range(0, len(dataset), 2)]
    mine = [_Steps([batch]) for batch in micro_batches[rank::world_size]]
    found = {}
    for epoch in epochs:
        loader.batch_sampler.start(mine)
        loaders.seed_epoch(loader, epoch, 7, rank)
        for indices, (batch, _) in zip((s.micro_batches[0] for s in mine), loader):
            found.update({(epoch, index): image for index, image in zip(indices, batch)})
    return found


@pytest.mark.timeout(120)
def test_a_sample_s_crop_is_the_same_at_0_1_and_2_workers_and_on_any_rank(tmp_path):
    """Each sample's augmented image in epochs 1 and 2 is the same whether one process at 0, 1 or 2 workers or two
    ranks at 2 workers each fetch it; the epoch reaches persistent workers (epoch 2's images differ from epoch 1's).
    Broken on purpose: the epoch kept in a tensor that is not shared with the workers fails it, and so does a
    sample's generator seeded with its worker's id."""
    train = DecodedImages(str(write_folder(tmp_path / "train")), SIZE, train=True, seed=0)
    alone = crops_by_sample(train, 0, 0, 1)
    assert len(alone) == 2 * len(train)
    assert any(not torch.equal(alone[1, i], alone[2, i]) for i in range(len(train)))
    for workers in (1, 2):
        got = crops_by_sample(train, workers, 0, 1)
        assert got.keys() == alone.keys() and all(torch.equal(got[k], alone[k]) for k in alone), workers
    shared = crops_by_sample(train, 2, 0, 2) | crops_by_sample(train, 2, 1, 2)
    assert shared.keys() == alone.keys() and all(torch.equal(shared[k], alone[k]) for k in alone)


# a JPEG folder of 2 x 24 images: 6 steps an epoch at the global batch 8 (4 on each of 2 ranks; 4 x 2 micro-batches
# on 1 process); SIGTERM after rank 0's 2nd micro-batch stops the 2-rank run in epoch 1, mid-epoch
ELASTIC = ["--task", "tests/rank_tasks.py:PreemptedTinyMLP", "--dataset", "imagefolder", "--image-size", "16",
           "--workers", "2", "-l", "0.05", "--batch-size", "4", "--epochs", "2", "--no-progress",
           "--checkpoint-every-steps", "2"]  # fmt: skip


def preempted_on_2_and_resumed_on_1(tmp_path, monkeypatch, backend: str = "torchvision") -> str:
    """A JPEG folder run with `backend`, --workers 2 on 2 ranks, preempted mid-epoch, resumed on 1 process (2 workers,
    2 micro-batches a step), against the uninterrupted 2-rank run: the final weights within 1e-4 (relative), the
    resumed run took only the steps its checkpoint lacked. The uninterrupted run's output."""
    from multiproc import launch
    from resumed import assert_resumed, final_step

    from ddp_tricks.storage import checkpoint

    write_folder(tmp_path / "train", per_class=24)
    write_folder(tmp_path / "val", seed=1)
    flags = [*ELASTIC, "--data-backend", backend, "--train-dir", str(tmp_path / "train"), "--val-dir",
             str(tmp_path / "val"), "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    whole = launch([*flags, "-n", "whole"], nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    monkeypatch.setenv("PREEMPT_AFTER", "2")
    stopped = launch([*flags, "-n", "moved"], nproc=2)
    monkeypatch.delenv("PREEMPT_AFTER")
    assert stopped.returncode == 143 and "preempted at epoch" in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    saved = checkpoint.load(tmp_path / "runs" / "moved" / "last.pt")
    assert 0 < saved["step_in_epoch"] < 6  # mid-epoch
    end = launch([*flags, "-n", "moved", "--resume", "auto"], nproc=1)
    assert end.returncode == 0, end.stderr[-3000:]
    assert_resumed(end.stdout, saved, final_step(tmp_path / "runs" / "whole"))
    expected = checkpoint.load(tmp_path / "runs" / "whole" / "last.pt")["model"]
    got = checkpoint.load(tmp_path / "runs" / "moved" / "last.pt")["model"]
    for name, value in expected.items():
        assert ((got[name] - value).norm() / value.norm()).item() <= 1e-4, name
    return whole.stdout + whole.stderr


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_jpeg_folder_run_preempted_on_2_ranks_and_resumed_on_1_ends_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """--workers 2 on 2 ranks, preempted mid-epoch, resumed on 1 process (2 workers, 2 micro-batches a step): the
    final weights are the uninterrupted 2-rank run's within 1e-4 (relative), and the resumed run took only the
    steps its checkpoint lacked. Broken on purpose: a sample's generator seeded with its worker's id as well fails
    it (the resumed process's workers hold other samples)."""
    output = preempted_on_2_and_resumed_on_1(tmp_path, monkeypatch)
    assert "input: image folder of 48 images at 16 px, data backend torchvision" in output


def test_the_input_line_says_the_cpu_time_per_image_and_the_cores_a_gpu_needs_leaving_every_random_state(tmp_path):
    """The run's input line (a training folder): this machine's CPU time per image, measured on a few samples at
    start, and the cores one GPU at 3,000 images/s needs at that rate, which is that rate times the time (written here
    from the two printed numbers); timing the samples leaves torch's, Python's and numpy's random states as they were
    (the run stays bit-identical). Broken on purpose: the cores a thousandth of that (a unit slip) fails it."""
    import random
    import re

    from ddp_tricks.data.decoded import DecodedImages

    write_folder(tmp_path / "train")
    images = DecodedImages(str(tmp_path / "train"), 16, train=True)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    line = images.describe()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    found = re.search(
        r"; ([\d.]+) ms of CPU per image here: one GPU at 3,000 images/s needs about ([\d.]+) cores$", line
    )
    assert found, line
    ms, cores = float(found[1]), float(found[2])
    assert ms > 0 and cores == pytest.approx(3000 * ms / 1e3, abs=0.05 + 3000 * 0.05 / 1e3)  # both printed rounded
    assert "ms of CPU" not in DecodedImages(str(tmp_path / "train"), 16, train=False).describe()  # validation: none
