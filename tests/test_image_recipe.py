"""timm's image recipe by its flags (#59): each flag named in --help and settable from a recipe's TOML, bad input in
one line, each sample's augmentation a function of (seed, epoch, index) at any number of workers and ranks, --mixup's
mixed global batch the same at any world size, a task's batch_transform (torchvision's CutMix) resumed bit-identically,
and a JPEG-folder run with the whole recipe preempted on 2 ranks and resumed on 1."""

from __future__ import annotations

import pytest
import torch
from multiproc import launch, python_run
from test_decoded_images import SIZE, crops_by_sample, write_folder

from ddp_tricks import plan as planning
from ddp_tricks.data import loaders
from ddp_tricks.data.decoded import DecodedImages
from ddp_tricks.data.feed import Feed, moved
from ddp_tricks.data.in_memory import InMemoryDataset
from ddp_tricks.data.mixing import Mixing
from ddp_tricks.data.recipe import ImageRecipe

FLAGS = ["--mean", "--std", "--crop-pct", "--scale", "--ratio", "--interpolation", "--hflip", "--color-jitter",
         "--aa", "--reprob", "--remode", "--recount", "--smoothing", "--mixup", "--cutmix", "--mixup-prob",
         "--mixup-switch-prob", "--mixup-mode", "--aug-repeats"]  # fmt: skip


@pytest.mark.timeout(120)
def test_help_names_every_flag_and_a_recipe_s_toml_sets_each(tmp_path):
    """`run.py --help` names each of timm's flags of the issue; a TOML file setting them all is read (a run that
    plots its LR schedule only, so nothing trains). Broken on purpose: the image group left out of build_parser
    fails it (neither --help nor the file knows --aa)."""
    shown = python_run(["--help"]).stdout
    assert [flag for flag in FLAGS if f"{flag} " not in shown] == []
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        "mean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\ncrop-pct = 0.9\nscale = [0.25, 1.0]\nratio = [0.75, 1.33]\n"
        'interpolation = "bicubic"\nhflip = 0.3\naa = "rand-m9-mstd0.5-inc1"\nreprob = 0.25\nremode = "const"\n'
        "recount = 2\nsmoothing = 0.1\nmixup = 0.8\ncutmix = 1.0\nmixup-prob = 0.9\nmixup-switch-prob = 0.4\n"
        'mixup-mode = "elem"\naug-repeats = 2\n'
    )
    from ddp_tricks import cli

    flags, _ = cli.parse(["--config", str(recipe), "--runs-dir", str(tmp_path)])
    assert flags.mean == [0.5] * 3 and flags.crop_pct == 0.9 and flags.scale == [0.25, 1.0] and flags.hflip == 0.3
    assert flags.aa == "rand-m9-mstd0.5-inc1" and flags.remode == "const" and flags.recount == 2
    assert flags.label_smoothing == 0.1 and flags.mixup_mode == "elem" and flags.aug_repeats == 2
    assert cli.mixing_options(flags) == {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "prob": 0.9, "switch_prob": 0.4,
                                         "mode": "elem"}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args, says",
    [
        (["--aa", "rand-m9-xyz1"], "--aa rand-m9-xyz1: cannot read 'xyz1'"),
        (["--aa", "v0"], "--aa v0: timm's own AutoAugment policy"),
        (["--mean", "0.5", "0.5"], "--mean takes 3 values (R G B), got 2"),
        (["--std", "0.2", "0.2", "0.2", "0.2"], "--std takes 3 values (R G B), got 4"),
        (["--aug-repeats", "3", "--batch-size", "4", "--dataset", "imagefolder"], "--aug-repeats 3 must divide"),
        (["--task", "tests/image_tasks.py:LabelsOnly", "--mixup", "0.8"], "the batch transform's targets"),
    ],
)
def test_bad_input_is_one_line_at_start(tmp_path, args, says):
    """Each mistake is one line on stderr and exit code 2, before anything trains. Broken on purpose: parse_aa
    returning None for an unknown policy fails the first (the run trains without it); the start-up check without
    the batch transform fails the last (the loss's error comes mid-step, with a traceback)."""
    if "imagefolder" in args:
        write_folder(tmp_path / "train")
        write_folder(tmp_path / "val", seed=1)
        args = [*args, "--train-dir", str(tmp_path / "train"), "--val-dir", str(tmp_path / "val"), "--image-size", "16"]
    result = python_run([*args, "-e", "1", "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr[-2000:]
    if "LabelsOnly" in args[1]:
        assert "F.cross_entropy" in result.stderr


@pytest.mark.timeout(180)
def test_each_sample_s_augmentation_is_the_same_at_0_and_2_workers_and_on_any_rank(tmp_path):
    """With RandAugment (magnitude drawn per op), colour-free erasing in noise and the recipe's crop scale and flip,
    each sample's image in epochs 1 and 2 is the same at 0 and 2 workers and split over two ranks, differs between
    epochs, and differs from the same sample without the augmentation. Broken on purpose: Augment drawing from the
    worker's own generator (no manual_seed from the sample's) fails it."""
    recipe = ImageRecipe(aa="rand-m9-mstd0.5-inc1", reprob=0.5, remode="pixel", recount=2, scale=(0.3, 1.0), hflip=0.7)
    train = DecodedImages(str(write_folder(tmp_path / "train")), SIZE, train=True, seed=0, recipe=recipe)
    plain = DecodedImages(str(tmp_path / "train"), SIZE, train=True, seed=0, recipe=ImageRecipe(scale=(0.3, 1.0)))
    alone = crops_by_sample(train, 0, 0, 1)
    assert any(not torch.equal(alone[1, i], alone[2, i]) for i in range(len(train)))
    bare = crops_by_sample(plain, 0, 0, 1)
    assert sum(not torch.equal(alone[k], bare[k]) for k in alone) >= len(alone) // 2
    got = crops_by_sample(train, 2, 0, 1)
    assert got.keys() == alone.keys() and all(torch.equal(got[k], alone[k]) for k in alone)
    shared = crops_by_sample(train, 2, 0, 2) | crops_by_sample(train, 2, 1, 2)
    assert shared.keys() == alone.keys() and all(torch.equal(shared[k], alone[k]) for k in alone)


def mixed_by_slot(world_size: int, mode: str, epoch: int = 2) -> dict:
    """Every (step, slot)'s mixed micro-batch of one epoch, over all `world_size` ranks (each its own loader and Feed
    with --mixup and --cutmix), at the global batch 12 in micro-batches of 3."""
    data = InMemoryDataset(torch.randn(30, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(30) % 5)
    plan = planning.make(num_train=30, world_size=world_size, micro_batch=3, accum_steps=4 // world_size, epochs=2,
                         seed=1, base_lr=0.1, lr_scaling="keep", base_batch=12, warmup_epochs=0)  # fmt: skip
    found = {}
    for rank in range(world_size):
        loader = loaders.train_loader(data, rank, torch.device("cpu"), seed=1)
        feed = Feed(loader, torch.device("cpu"), moved, Mixing(5, 0.8, 1.0, 0.9, 0.5, mode))
        loader.batch_sampler.start(plan.epoch(epoch, rank))
        loaders.seed_epoch(loader, epoch, 1, rank)
        found.update(dict(zip(loader.batch_sampler.places, feed)))
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_mixup_s_global_batch_is_the_same_on_1_and_2_ranks(mode):
    """--mixup 0.8 --cutmix 1.0: each micro-batch of the global batch (the plan's slot: the same samples at any world
    size) is mixed alike on 1 process (4 micro-batches a step) and on 2 ranks (2 each), and every sample is mixed:
    the images and the soft targets equal, bit for bit. Broken on purpose: keying the draws by the micro-batch's
    place on its rank (0, 1, ...) instead of its slot fails it."""
    one, two = mixed_by_slot(1, mode), mixed_by_slot(2, mode)
    assert one.keys() == two.keys() and len(one) == 3 * 4  # 2 steps of 12 and the short last one (6), 4 slots each
    for key, (inputs, targets) in one.items():
        assert torch.equal(inputs, two[key][0]) and torch.equal(targets, two[key][1]), key
        assert targets.shape == (len(inputs), 5) and torch.allclose(targets.sum(1), torch.ones(len(inputs)))
    assert sum((targets.max(1).values < 1).sum().item() for _, targets in one.values()) > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_task_whose_batch_transform_is_torchvision_s_cutmix_resumes_bit_identically(tmp_path, monkeypatch):
    """The built-in task on digits with `batch_transform = v2.CutMix(num_classes=10)` as it is: stopped mid-epoch
    (preempted after 5 micro-batches) and resumed, its final weights equal the uninterrupted run's bit for bit.
    Broken on purpose: the Feed keying each micro-batch by its place in this iteration (0, 1, ... from the resumed
    step) instead of its step of the epoch fails it."""
    from resumed import assert_resumed, final_step

    from ddp_tricks.storage import checkpoint

    flags = ["--task", "tests/image_tasks.py:CutMixDigits", "-e", "2", "--batch-size", "128", "--no-progress",
             "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    whole = launch([*flags, "-n", "whole"], nproc=1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "batch transform: the task's (CutMix)" in whole.stdout + whole.stderr
    monkeypatch.setenv("PREEMPT_AFTER", "5")
    stopped = launch([*flags, "-n", "moved"], nproc=1)
    monkeypatch.delenv("PREEMPT_AFTER")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = checkpoint.load(tmp_path / "runs" / "moved" / "last.pt")
    assert saved["epoch"] == 0 and 0 < saved["step_in_epoch"]  # mid-epoch 1
    end = launch([*flags, "-n", "moved", "--resume", "auto"], nproc=1)
    assert end.returncode == 0, end.stderr[-3000:]
    assert_resumed(end.stdout, saved, final_step(tmp_path / "runs" / "whole"))
    expected = checkpoint.load(tmp_path / "runs" / "whole" / "last.pt")["model"]
    got = checkpoint.load(tmp_path / "runs" / "moved" / "last.pt")["model"]
    assert all(torch.equal(got[name], value) for name, value in expected.items())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_jpeg_folder_run_with_the_whole_recipe_preempted_on_2_ranks_and_resumed_on_1_follows_it(
    tmp_path, monkeypatch
):
    """Mixup, cutmix, smoothing, RandAugment, random erasing, mean/std, crop-pct and repeated augmentation, --workers
    2 on 2 ranks, preempted mid-epoch and resumed on 1 process: the final weights within 1e-4 of the uninterrupted
    2-rank run's (test_decoded_images' helper). Broken on purpose: Mixing's draws keyed with the rank as well fails
    it (the resumed process mixes rank 1's micro-batches as rank 0)."""
    import test_decoded_images

    recipe = ["--mixup", "0.8", "--cutmix", "1.0", "--smoothing", "0.1", "--aa", "rand-m9-mstd0.5-inc1", "--reprob",
              "0.25", "--mean", "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5", "--crop-pct", "0.9",
              "--aug-repeats", "2"]  # fmt: skip
    monkeypatch.setattr(test_decoded_images, "ELASTIC", [*test_decoded_images.ELASTIC, *recipe])
    output = test_decoded_images.preempted_on_2_and_resumed_on_1(tmp_path, monkeypatch)
    assert "then --aa rand-m9-mstd0.5-inc1, random erasing p 0.25" in output
    assert "batch transform: mixup 0.8 and cutmix 1" in output


def test_the_augmentation_s_sharpness_is_v2_s_under_onednn_and_the_flag_is_put_back():
    """Augment runs v2 with oneDNN off (augment.native_conv: its sharpness blur is 9x faster then): the same images
    as v2 under oneDNN, for images and factors of every kind, and oneDNN on again after, an exception included.
    Broken on purpose: native_conv without its `finally` leaves oneDNN off after the exception."""
    from torchvision.transforms.v2 import functional as F

    from ddp_tricks.data.augment import native_conv

    generator = torch.Generator().manual_seed(0)
    for height, width in ((224, 224), (37, 61)):
        image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
        for factor in (0.1, 0.37, 1.0, 1.9):
            assert torch.backends.mkldnn.enabled
            expected = F.adjust_sharpness(image, factor)
            with native_conv():
                assert not torch.backends.mkldnn.enabled
                assert torch.equal(F.adjust_sharpness(image, factor), expected)
    with pytest.raises(RuntimeError), native_conv():
        raise RuntimeError("a transform failed")
    assert torch.backends.mkldnn.enabled
