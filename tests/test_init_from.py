"""--init-from (#57): a NEW run from another run's checkpoint or a weights file: global step 0, its own plan and
schedule; the weights (and with --init-optimizer the optimizer's state) are the source's, across strategies and world
sizes; what does not fit is named; --resume stays the same run, strictly. Each test runs run.py as a user does."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from multiproc import launch, python_run
from resumed import RESUMED, TOOK

from ddp_tricks import models

BASE = ["--epochs", "1", "--no-progress", "--log-interval", "0"]


def _run(tmp: Path, *args: str, nproc: int = 0):
    """run.py in one process (nproc 0) or on `nproc` ranks; its output, after asserting it ended well."""
    argv = [*BASE, "--runs-dir", str(tmp), *args]
    result = launch(argv, nproc=nproc, timeout=200) if nproc else python_run(argv, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def _failed(tmp: Path, *args: str) -> str:
    result = python_run([*BASE, "--runs-dir", str(tmp), *args], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _rows(tmp: Path, name: str, file: str = "metrics.csv") -> list[dict]:
    with open(tmp / name / file, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_run_starts_from_the_weights_at_step_0_with_its_own_plan(tmp_path):
    """Phase 2 at another batch size starts from phase 1's weights (its evaluation at step 0 is phase 1's last), at
    global step 0 with its own warmup; with --init-optimizer its result differs (the moments are used). Broken on
    purpose (start() not loading the weights): the step-0 evaluation is a fresh model's (val_acc about 0.1)."""
    _run(tmp_path, "-n", "p1", "--optimizer", "adam", "--base-lr", "0.003")
    first = _rows(tmp_path, "p1")[-1]
    out = _run(tmp_path, "-n", "e", "--optimizer", "adam", "--init-from", str(tmp_path / "p1"), "--eval-only")
    assert "started from the weights of checkpoint" in out and "14 of 14 tensors loaded" in out
    row = _rows(tmp_path, "e", "eval.csv")[0]
    assert (row["step"], row["val_loss"], row["val_acc"]) == ("0", first["val_loss"], first["val_acc"])
    flags = ["--optimizer", "adam", "--base-lr", "0.003", "-b", "16", "--warmup-epochs", "0.5"]
    out = _run(tmp_path, "-n", "p2", *flags, "--init-from", str(tmp_path / "p1" / "last.pt"), "--log-interval", "5")
    assert [int(x) for x in TOOK.search(out).group("steps", "first", "last")] == [90, 0, 90]  # 1438 / 16, from 0
    lrs = {int(row["step"]): float(row["lr"]) for row in _rows(tmp_path, "p2", "steps.csv")}
    assert lrs[1] < lrs[20] < lrs[45] == lrs[90]  # its own warmup, over its first half epoch
    out = _run(tmp_path, "-n", "p2o", *flags, "--init-from", str(tmp_path / "p1"), "--init-optimizer")
    assert "optimizer state carried for 8 of 8 parameter(s)" in out
    plain, carried = _rows(tmp_path, "p2")[-1], _rows(tmp_path, "p2o")[-1]
    assert plain["val_loss"] != carried["val_loss"]
    assert float(plain["val_loss"]) < 2.0 and float(carried["val_loss"]) < 2.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_starts_a_ddp_run_and_a_ddp_one_a_sharded_run(tmp_path):
    """An FSDP run on 2 ranks, its last.dcp read whole by a one-process DDP run (its step-0 evaluation is the FSDP
    run's last); a DDP checkpoint starts a 2-rank FSDP run with its optimizer state (Adam's moments laid out as the
    shards). Broken on purpose (_sharded reading placeholders, not the files): the evaluation differs."""
    lm = ["--optimizer", "adam", "--base-lr", "0.003"]
    _run(tmp_path, "-n", "fs", "--strategy", "fsdp", *lm, nproc=2)
    first = _rows(tmp_path, "fs")[-1]
    out = _run(tmp_path, "-n", "from-fs", *lm, "--init-from", str(tmp_path / "fs"), "--eval-only")
    assert "sharded checkpoint" in out
    row = _rows(tmp_path, "from-fs", "eval.csv")[0]
    assert abs(float(row["val_loss"]) - float(first["val_loss"])) < 1e-6 and row["val_acc"] == first["val_acc"]
    _run(tmp_path, "-n", "dd", *lm)
    out = _run(tmp_path, "-n", "fs-e", "--strategy", "fsdp", *lm, "--init-from", str(tmp_path / "dd"), "--eval-only",
               nproc=2)  # fmt: skip
    assert "model built whole on the CPU: the checkpoint's whole weights are loaded into it" in out
    row = _rows(tmp_path, "fs-e", "eval.csv")[0]
    assert abs(float(row["val_loss"]) - float(_rows(tmp_path, "dd")[-1]["val_loss"])) < 1e-6
    out = _run(tmp_path, "-n", "to-fs", "--strategy", "fsdp", *lm, "--init-from", str(tmp_path / "dd"),
               "--init-optimizer", nproc=2)  # fmt: skip
    assert "optimizer state carried for 8 of 8 parameter(s)" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ten_class_checkpoint_starts_a_five_class_run_naming_the_head(tmp_path):
    """The head's two tensors are initialised as built and named with both shapes; the rest loaded."""
    _run(tmp_path, "-n", "ten")
    out = _run(tmp_path, "-n", "five", "--task", "tests/init_tasks.py:FiveDigits", "--init-from", str(tmp_path / "ten"))
    assert "12 of 14 tensors loaded" in out
    assert "re-initialised (as the model builds them): head.weight [5, 256] (checkpoint [10, 256])" in out, out
    out = _run(tmp_path, "-n", "five-x", "--task", "tests/init_tasks.py:FiveDigits", "--init-from",
               str(tmp_path / "ten"), "--init-exclude", "^features\\.0\\.")  # fmt: skip
    assert "left as built by --init-exclude: features.0.weight" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_state_dict_file_starts_a_run(tmp_path):
    """torch.save of a DDP-wrapped model's state_dict inside a {"state_dict": ...} wrapper (the `module.` prefix and
    the wrapper handled): its weights are the run's at step 0."""
    _run(tmp_path, "-n", "src")
    weights = torch.load(tmp_path / "src" / "last.pt", weights_only=True)["model"]
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights.items()}}, tmp_path / "plain.pt")
    out = _run(tmp_path, "-n", "e", "--init-from", str(tmp_path / "plain.pt"), "--eval-only")
    assert "weights file" in out and "14 of 14 tensors loaded" in out
    assert _rows(tmp_path, "e", "eval.csv")[0]["val_loss"] == _rows(tmp_path, "src")[-1]["val_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_init_from_with_resume_auto_resumes_the_run_s_own_checkpoint_once_it_has_one(tmp_path):
    """One command for the first start and every requeue: started from the source, then resumed from its own."""
    _run(tmp_path, "-n", "src")
    again = ["-n", "p2", "--resume", "auto", "--init-from", str(tmp_path / "src"), "--epochs", "2"]
    first = _run(tmp_path, *again[:-1], "1")
    assert "started from the weights" in first and not RESUMED.search(first)
    second = _run(tmp_path, *again)
    assert "started from" not in second and RESUMED.search(second)
    assert [int(x) for x in TOOK.search(second).group("steps", "first", "last")] == [45, 45, 90]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--init-from", "missing.pt"], "--init-from 'missing.pt' does not exist"),
        (["--init-from", "{tmp}/junk.pt"], "cannot be read as weights (corrupt, truncated"),
        (["--init-from", "{tmp}/empty.pt"], "holds no tensors by name"),
        (["--init-from", "{tmp}/other.pt"], "none of the model's 14 tensors is in the file by name and shape"),
        (["--init-from", "{tmp}", "--resume", "{tmp}/x.pt"], "--init-from starts a new run and --resume"),
        (["--init-from", "{tmp}/runs"], "is a folder with no last.pt, last.dcp or .metadata (it holds the runs a, b"),
        (["--init-optimizer"], "--init-optimizer acts with --init-from PATH"),
        (["--init-from", "{tmp}/other.pt", "--init-exclude", "("], "--init-exclude '(' is not a regular expression"),
        (["--init-from", "{tmp}/other.pt", "--init-from-ema"], "holds no EMA weights"),
        (["--init-from", "{tmp}/model.pt", "--init-optimizer"], "is a weights file with no optimizer state"),
    ],
)
def test_bad_init_input_is_one_line_and_writes_nothing(tmp_path, args, said):
    (tmp_path / "junk.pt").write_bytes(b"not a pickle at all")
    for run in ("a", "b"):  # a runs folder given for a run's
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "last.pt").touch()
    torch.save({"step": 3}, tmp_path / "empty.pt")
    torch.save({"fc.weight": torch.zeros(3, 3), "features.0.weight": torch.zeros(2)}, tmp_path / "other.pt")
    torch.save(models.build("toy", 1, 10).state_dict(), tmp_path / "model.pt")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = _failed(tmp_path, "-n", "new", *args)
    assert said in line, line
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_is_the_same_run_strictly(tmp_path):
    """A resume with another training set is one line naming --init-from (it trained past --max-steps before); a
    resume into a new name with nothing left to train is one line (a FileNotFoundError traceback before)."""
    _run(tmp_path, "-n", "r", "--epochs", "2")
    ckpt = str(tmp_path / "r" / "last.pt")
    line = _failed(tmp_path, "-n", "r", "--resume", ckpt, "--task", "tests/init_tasks.py:HalfDigits", "--epochs", "3")
    assert "its training set changed: 1438 samples in the checkpoint's run, 719 now" in line and "--init-from" in line
    line = _failed(tmp_path, "-n", "fresh", "--resume", ckpt, "--epochs", "1")
    assert "its run has done 2 epoch(s), and this run is 1 epoch(s) long" in line and "--init-from" in line
    assert not (tmp_path / "fresh").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_torchvision_weights_file_fine_tunes_resnet18_on_a_four_class_folder(tmp_path):
    """The file torchvision's ResNet18_Weights would download (a plain state dict of the 1000-class model; made here
    from torchvision's own builder, no network) starts the built-in task's --model resnet18 on a 4-class JPEG folder:
    the head is replaced for the folder's classes and named; every other tensor is the file's."""
    import numpy as np
    from PIL import Image
    from torchvision.models import resnet18

    for split, count in (("train", 6), ("val", 2)):
        rng = np.random.default_rng(len(split))
        for label in ("a", "b", "c", "d"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / label / f"{i}.jpg", quality=90)
    torch.manual_seed(0)
    torch.save(resnet18(num_classes=1000).state_dict(), tmp_path / "resnet18-imagenet.pth")
    folders = ["--dataset", "imagefolder", "--train-dir", str(tmp_path / "train"), "--val-dir", str(tmp_path / "val")]
    out = _run(tmp_path, "-n", "ft", *folders, "--image-size", "32", "--model", "resnet18", "-b", "8", "--init-from",
               str(tmp_path / "resnet18-imagenet.pth"))  # fmt: skip
    assert "started from the weights of weights file" in out and "120 of 122 tensors loaded" in out, out
    assert "re-initialised (as the model builds them): fc.weight [4, 512] (checkpoint [1000, 512]), fc.bias [4]" in out
    assert len(_rows(tmp_path, "ft")) == 1


def test_init_optimizer_maps_the_state_by_parameter_name_and_only_for_loaded_weights():
    """The source's groups laid out otherwise (no --no-decay-1d there, --no-decay-1d here: the groups' order
    differs) and one weight not loaded (--init-exclude): each momentum buffer lands on the parameter of its name, and
    the one not loaded starts fresh. Broken on purpose (mapped by place): features.1.bias got another parameter's
    momentum of its shape."""
    from ddp_tricks.optim import build as optimizers
    from ddp_tricks.storage import init_from

    torch.manual_seed(0)
    model = models.build("toy", 1, 10)
    source_opt = optimizers.build(model, "sgd", lr=0.1, momentum=0.9, bn_bias_separately=False)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    source_opt.step()
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = [by_id[id(p)] for g in source_opt.param_groups for p in g["params"]]
    momentum = {by_id[id(p)]: source_opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    source = init_from.Source(Path("src.pt"), "checkpoint", {}, None, source_opt.state_dict(), "SGD", 1, names)
    source.loaded = set(names) - {"features.4.weight"}
    target = optimizers.build(model, "sgd", lr=0.1, momentum=0.9, bn_bias_separately=True)
    header = {"optimizer_name": "SGD", "optimizer_parameters": [by_id[id(p)] for g in target.param_groups for p in
                                                                  g["params"]]}  # fmt: skip
    lines = init_from.load_optimizer(target, source, header)
    assert lines == ["optimizer state carried for 7 of 8 parameter(s), by name; fresh (not loaded, no state, or "
                     "another shape): features.4.weight"]  # fmt: skip
    for name, p in model.named_parameters():
        if name == "features.4.weight":
            assert p not in target.state or "momentum_buffer" not in target.state[p]
        else:
            assert torch.equal(target.state[p]["momentum_buffer"], momentum[name]), name
