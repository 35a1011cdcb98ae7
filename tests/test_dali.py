"""--data-backend dali (#50): NVIDIA DALI decodes, crops, resizes, flips and normalises the batches the template's own
sampler lists, with each sample's crop and flip drawn from (seed, epoch, index) as the torchvision backend draws them.
DALI's CPU decoder is libjpeg-turbo, bit-identical to decode_jpeg here; its antialiased linear resize rounds
differently from torch's, so the batches equal the torchvision backend's within a few levels of 255.

`make test` skips them (DALI's wheels are about 500 MB, not in requirements-dev.txt); `make test-extras` installs DALI
into .venv and runs them (CI's extras job). Or install it into a folder of its own and put that on the path:
    pip install --target DIR nvidia-dali-cuda120
    PYTHONPATH=.:DIR pytest tests/test_dali.py
"""

from __future__ import annotations

import pytest
import torch
from test_data_backends import batches
from test_decoded_images import SIZE, preempted_on_2_and_resumed_on_1, write_folder

from ddp_tricks import plan
from ddp_tricks.data import loaders
from ddp_tricks.data.dali import DaliImages, validation_geometry
from ddp_tricks.data.decoded import STD, DecodedImages

try:
    import nvidia.dali  # noqa: F401

    NO_DALI = False
except ImportError:
    NO_DALI = True
needs_dali = pytest.mark.skipif(
    NO_DALI,
    reason="NVIDIA DALI is not installed: make test-extras installs it and runs these tests",
)
CPU = torch.device("cpu")


def levels(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The difference of two normalised batches in levels of 255 of the uint8 image (x 255 x each channel's std)."""
    return (got - expected).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255


def assert_within_resize_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """DALI's resize against torch's (the decodes are identical on the CPU): measured on write_folder's pictures,
    at most 4 levels (3.98), 0.20 on average, more than one level in 0.8% of the values (training crops; validation:
    at most 1 level, 0.15 on average). Bounded at 5 levels, 0.3 on average and 2% beyond one level."""
    difference = levels(got, expected)
    assert difference.max() <= 5, difference.max()
    assert difference.mean() <= 0.3, difference.mean()
    assert (difference > 1 + 1e-3).float().mean() <= 0.02


@needs_dali
@pytest.mark.timeout(120)
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_dali_s_batches_equal_the_torchvision_backend_s_within_its_resize_rounding(tmp_path, train):
    """The same samples, the same crops and flips (from (seed, epoch, index)), through DALI's CPU pipeline: the model's
    inputs are the torchvision backend's within DALI's resize rounding, float32 (N, 3, H, W), the labels equal.
    Broken on purpose: DALI ignoring the sample's flip fails it (train); the validation resize rounding the longer
    side where torchvision truncates it fails it too (val)."""
    root = write_folder(tmp_path / "train", per_class=8)
    indices = list(range(16))
    expected, expected_targets = batches(DecodedImages, root, train, CPU, indices)
    got, targets = batches(DaliImages, root, train, CPU, indices)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (16, 3, SIZE, SIZE)
    assert_within_resize_rounding(got, expected)
    assert torch.equal(targets, expected_targets)


@pytest.mark.timeout(60)
def test_the_validation_geometry_is_torchvision_s_resize_and_centre_crop():
    """The resized size and the centre crop's corner that DALI is given are those torchvision's Resize(size x 256 /
    224) and CenterCrop(size) compute, for images of many shapes (no DALI needed). Broken on purpose: rounding the
    longer side instead of truncating it fails it."""
    from torchvision.transforms.v2 import functional as F

    for size in (24, 224):
        for height, width in [(375, 500), (500, 375), (333, 500), (64, 40), (48, 64), (1000, 1001), (257, 901)]:
            resize = int(size * 256 / 224)
            (h, w), (top, left) = validation_geometry(width, height, size)
            resized = F.resize(torch.zeros(1, height, width), resize, antialias=True)
            assert (h, w) == tuple(resized.shape[1:]), (height, width)
            rows = torch.arange(h, dtype=torch.float64).view(1, h, 1).expand(1, h, w)
            columns = torch.arange(w, dtype=torch.float64).view(1, 1, w).expand(1, h, w)
            corner = F.center_crop(torch.cat([rows, columns]), [size, size])[:, 0, 0]
            assert (top, left) == tuple(int(v) for v in corner), (height, width)


@needs_dali
@pytest.mark.timeout(60)
def test_a_jpeg_dali_cannot_decode_is_one_line(tmp_path):
    """A JPEG whose header reads but whose data is cut: DALI's decode error is one line saying how to find the file.
    Broken on purpose: letting DALI's RuntimeError through (its operator's traceback) fails it."""
    from ddp_tricks.errors import UserError

    root = write_folder(tmp_path / "train")
    cut = root / "cat" / "0.jpg"
    cut.write_bytes(cut.read_bytes()[:200] + bytes(50))
    dataset = DaliImages(str(root), SIZE, train=True)
    error = None
    try:
        dataset.finish(dataset.collate([dataset[i] for i in range(4)])[0], CPU)
    except Exception as raised:  # which kind it is, is what the test asserts
        error = raised
    assert isinstance(error, UserError), repr(error)[:300]
    assert "NVIDIA DALI cannot decode a batch" in str(error) and "\n" not in str(error)
    assert "--data-backend torchvision names the file" in str(error)


@needs_dali
@pytest.mark.timeout(180)
def test_dali_follows_the_template_s_sampler_on_2_ranks_and_resumes_mid_epoch(tmp_path):
    """Through the training loader (its PlanSampler, 2 workers) and the Feed, each rank's DALI batches are the
    plan's micro-batches of that rank, in order (each equal, within the resize rounding, to the torchvision backend's
    batch of the plan's indices); the 2 ranks' samples are disjoint and together the epoch; started at step 2 (a
    resume mid-epoch) the loader yields the uninterrupted epoch's batches from there, identical. Broken on purpose:
    DALI's outputs in reverse order of the batch fails it."""
    root = write_folder(tmp_path / "train", per_class=8)
    dali, torchvision = DaliImages(str(root), SIZE, train=True, seed=3), DecodedImages(str(root), SIZE, train=True)
    run_plan = plan.make(num_train=16, world_size=2, micro_batch=2, accum_steps=1, epochs=1, seed=3, base_lr=0.1,
                         lr_scaling="keep", base_batch=4, warmup_epochs=0)  # fmt: skip
    seen = []
    for rank in (0, 1):
        steps = run_plan.epoch(1, rank)
        loader = loaders.fed(loaders.train_loader(dali, rank, CPU, seed=3, workers=2), CPU)
        loader.batch_sampler.start(steps)
        loaders.seed_epoch(loader, 1, 3, rank)
        whole = list(loader)
        micro_batches = [indices for step in steps for indices in step.micro_batches]
        assert len(whole) == len(micro_batches) == 4
        torchvision.seed_augmentation(3, 1)
        for (inputs, targets), indices in zip(whole, micro_batches):
            expected, expected_targets = loaders.batch_of(torchvision, indices)
            assert_within_resize_rounding(inputs, expected)
            assert torch.equal(targets, expected_targets)
        loader.batch_sampler.start(steps, first_step=2)
        loaders.seed_epoch(loader, 1, 3, rank)
        resumed = list(loader)
        assert len(resumed) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(resumed, whole[2:]))
        seen.append({index for indices in micro_batches for index in indices})
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(16))


@needs_dali
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_dali_run_preempted_on_2_ranks_and_resumed_on_1_ends_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """run.py with --data-backend dali (DALI's CPU pipeline), --workers 2 on 2 ranks, preempted mid-epoch, resumed on
    1 process: the final weights are the uninterrupted 2-rank run's within 1e-4 (relative), the resumed run took only
    the steps its checkpoint lacked. Broken on purpose: DALI drawing the training crops itself
    (decoders.image_random_crop, as DALI's examples do, its generator the pipeline's) fails it (the weights differ by
    100 %): the crop must be the sample's, from (seed, epoch, index)."""
    assert "data backend dali" in preempted_on_2_and_resumed_on_1(tmp_path, monkeypatch, "dali")


@needs_dali
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_dali_s_gpu_pipeline_is_close_to_the_torchvision_backend_s(tmp_path, train):
    """The mixed pipeline (nvJPEG decode of the crop, resize, flip and normalise on the GPU), copied on the current
    stream: within a few levels of the CPU's torchvision backend (nvJPEG's IDCT differs from libjpeg-turbo's as well
    as the resize), in order, the labels equal, in channels-last memory where asked. Broken on purpose: the mixed
    decoder given the whole image instead of the crop fails it."""
    root = write_folder(tmp_path / "train", per_class=8)
    indices = list(range(16))
    expected, expected_targets = batches(DecodedImages, root, train, CPU, indices)
    dataset = DaliImages(str(root), SIZE, train=train, seed=4)
    dataset.seed_augmentation(4, 3)
    inputs, targets = dataset.collate([dataset[i] for i in indices])
    got = dataset.finish(inputs, torch.device("cuda"), channels_last=True)
    assert got.device.type == "cuda" and got.is_contiguous(memory_format=torch.channels_last)
    difference = levels(got.cpu(), expected)
    assert difference.mean() < 1.0 and difference.max() < 12, (difference.mean(), difference.max())
    assert torch.equal(targets, expected_targets)
