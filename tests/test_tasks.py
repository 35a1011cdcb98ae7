"""The task seam: example tasks trained by real processes (exact evaluation against metrics computed plainly here,
accumulation, SIGTERM + resume, early stopping and plateau on the monitored metric), forks of the built-in task,
and every mistake in a task file as one line."""

import csv
import json
import math
import sys

import pytest
import torch
from multiproc import REPO, launch, preempted
from resumed import assert_resumed, final_step

import run
from ddp_tricks import cli as config
from ddp_tricks.storage import checkpoint

TIMING = {"epoch_seconds", "samples_per_second"}
EXAMPLES = {
    "regression": ["--task", "examples/regression.py:Diabetes", "--optimizer", "adamw", "-l", "0.003"],
    "multilabel": ["--task", "examples/multilabel.py:DigitAttributes"],
}


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def weights(run_dir, name="last.pt"):
    return torch.load(run_dir / name, weights_only=True)["model"]


def task_and_data(example):
    """The example's task object, its validation set and a model, built as run.py builds them."""
    args, task_class = config.parse(EXAMPLES[example])
    task = task_class(args)
    _, val = task.datasets()
    torch.manual_seed(0)
    model = task.model()
    model(val.inputs[:2])  # initialise lazy modules before loading weights
    return task, val, model


def plain_metrics(example, run_dir):
    """Validation metrics of last.pt's weights, in one process and one batch, with formulas written here."""
    from sklearn.metrics import accuracy_score, f1_score

    task, val, model = task_and_data(example)
    model.load_state_dict(weights(run_dir))
    with torch.no_grad():
        out = model(val.inputs).double()
    y = val.targets.double()
    if example == "regression":
        p = out.squeeze(-1)
        return {
            "val_loss": ((p - y) ** 2).mean().item(),
            "val_mae": (p - y).abs().mean().item() * task.target_std,
            "val_r2": 1 - ((p - y) ** 2).sum().item() / ((y - y.mean()) ** 2).sum().item(),
        }
    predicted = (out > 0).numpy().astype(int)
    return {
        "val_loss": torch.nn.functional.binary_cross_entropy_with_logits(out, y).item(),
        "val_f1": f1_score(y.numpy(), predicted, average="micro"),
        "val_exact": accuracy_score(y.numpy(), predicted),  # subset accuracy: every label right
        "val_label_acc": (predicted == y.numpy()).mean(),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_task_on_2_ranks_exact_eval_accumulation_and_resume(example, tmp_path):
    flags = [*EXAMPLES[example], "--no-progress", "--runs-dir", str(tmp_path), "--log-interval", "5"]
    # 1. Trains on 2 gloo ranks; the 2-rank evaluation equals one process's, computed plainly.
    long_run = [*flags, "-b", "2", "-e", "2"]  # the SIGTERM comes in epoch 1: the resume crosses an epoch boundary
    full = launch([*long_run, "-n", "full"])
    assert full.returncode == 0, full.stderr[-3000:]
    reported = rows(tmp_path / "full")[-1]
    for name, value in plain_metrics(example, tmp_path / "full").items():
        assert float(reported[name]) == pytest.approx(value, rel=1e-6, abs=1e-9), name

    # 2. --accum-steps 3 gives the weights of 3 times the batch (the global batch 48 leaves 18 and 45 samples for
    # the last step: enough for its 6 micro-batches; fewer would leave it out, and not from the batch of 24)
    accumulated = launch([*flags, "-b", "8", "--accum-steps", "3", "-e", "1", "-n", "accum"])
    single = launch([*flags, "-b", "24", "-e", "1", "-n", "single"])
    assert accumulated.returncode == 0 and single.returncode == 0, accumulated.stderr[-2000:] + single.stderr[-2000:]
    a, b = weights(tmp_path / "accum"), weights(tmp_path / "single")
    assert all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in a)

    # 3. SIGTERM mid-run (after the first mid-epoch checkpoint), then --resume auto: bit-identical.
    run_dir = tmp_path / "pre"
    out, err = preempted([*long_run, "-n", "pre", "--checkpoint-every-steps", "20"], run_dir / "last.pt")
    assert "preempted" in out, (out + err)[-3000:]
    saved = checkpoint.load(run_dir / "last.pt")
    resumed = launch([*long_run, "-n", "pre", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, saved, final_step(tmp_path / "full"))
    assert rows(run_dir) == rows(tmp_path / "full")
    wa, wb = weights(run_dir), weights(tmp_path / "full")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _plateau_and_early_stop(values, mode, plateau_patience, stop_patience, factor, lr):
    """ReduceLROnPlateau (relative threshold 1e-4) and EarlyStopping (delta 0), written plainly: the LR each
    epoch trained with, and the epoch that stops the run."""
    better = (lambda a, b: a > b * (1 + 1e-4)) if mode == "max" else (lambda a, b: a < b * (1 - 1e-4))
    best, bad, lrs = None, 0, []
    stop_best, stop_count = None, 0
    for epoch, value in enumerate(values, start=1):
        lrs.append(lr)
        if best is None or better(value, best):
            best, bad = value, 0
        else:
            bad += 1
        if bad > plateau_patience:
            lr, bad = lr * factor, 0
        if stop_best is None or (value > stop_best if mode == "max" else value < stop_best):
            stop_best, stop_count = value, 0
        else:
            stop_count += 1
        if stop_count >= stop_patience:
            return lrs, epoch
    return lrs, None


PLATEAU = {  # settings under which each example overfits or stalls within 30 epochs
    "multilabel": (["-l", "0.5", "-b", "64"], "val_f1", "max", 0.5),
    "regression": (["-b", "16"], "val_mae", "min", 0.003),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", list(PLATEAU))
def test_plateau_and_early_stopping_follow_the_task_s_monitored_metric(example, tmp_path):
    flags, monitored, mode, lr = PLATEAU[example]
    result = launch([*EXAMPLES[example], *flags, "-e", "30", "--scheduler", "plateau", "--plateau-patience", "1",
                     "--plateau-factor", "0.5", "--early-stop-patience", "4", "--no-progress", "-n", "p",
                     "--runs-dir", str(tmp_path)], nproc=None)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = rows(tmp_path / "p")
    values = [float(r[monitored]) for r in got]
    lrs, stop_epoch = _plateau_and_early_stop(values, mode, plateau_patience=1, stop_patience=4, factor=0.5, lr=lr)
    assert stop_epoch is not None and len(got) == stop_epoch < 30  # stopped early, on the metric's own terms
    assert [float(r["lr"]) for r in got] == pytest.approx(lrs)
    assert any(value < lr for value in lrs)  # a cut happened
    best = max(values) if mode == "max" else min(values)
    assert torch.load(tmp_path / "p" / "best.pt", weights_only=True)["best"]["value"] == pytest.approx(best)
    assert f"best {monitored}" in result.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regression_reaches_ridge_r2_on_the_same_split(tmp_path):
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import Ridge

    sys.path.insert(0, str(REPO / "examples"))
    import regression

    x, y = load_diabetes(return_X_y=True)
    train, val = (i.numpy() for i in regression.split(len(y)))
    mean, std = x[train].mean(0), x[train].std(0, ddof=1)
    ridge = Ridge(alpha=1.0).fit((x[train] - mean) / std, y[train])
    residual = y[val] - ridge.predict((x[val] - mean) / std)
    ridge_r2 = 1 - (residual**2).sum() / ((y[val] - y[val].mean()) ** 2).sum()
    result = launch([*EXAMPLES["regression"], "--wd", "0.01", "-b", "16", "-e", "8", "--scheduler", "cosine",
                     "--no-progress", "-n", "reg", "--runs-dir", str(tmp_path)], nproc=None)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    best = min(rows(tmp_path / "reg"), key=lambda r: float(r["val_mae"]))  # what best.pt holds
    assert float(best["val_r2"]) >= ridge_r2 - 0.03, (best["val_r2"], ridge_r2)


FORK = """
import torch

from ddp_tricks.data import images as image_data
from task import Task, count_classes


class Three(Task):
    def datasets(self):
        train, val = super().datasets()
        for d in (train, val):  # digits 0, 1 and 2 only
            keep = d.targets < 3
            d.inputs, d.targets = d.inputs[keep], d.targets[keep]
        self.num_classes = count_classes(train, val)
        return train, val


class Twelve(Task):
    def datasets(self):
        train, val = image_data.digits()
        for d in (train, val):  # every other 0 and 1 become classes 10 and 11
            extra = (d.targets < 2) & (torch.arange(len(d.targets)) % 2 == 0)
            d.targets = torch.where(extra, d.targets + 10, d.targets)
        self.in_channels, self.num_classes = 1, count_classes(train, val)
        return train, val
"""


@pytest.mark.parametrize("name, classes", [("Three", 3), ("Twelve", 12)])
def test_a_fork_of_the_built_in_task_gets_the_right_head(name, classes, tmp_path):
    (tmp_path / "fork.py").write_text(FORK)
    code = run.main(["--task", f"{tmp_path / 'fork.py'}:{name}", "-e", "1", "--no-progress", "-n", name,
                     "--runs-dir", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert weights(tmp_path / name)["head.weight"].shape[0] == classes
    assert json.loads((tmp_path / name / "config.json").read_text())["task_info"]["num_classes"] == classes
    assert math.isfinite(float(rows(tmp_path / name)[-1]["val_loss"]))


BAD_TASK = """
import torch
import torch.nn.functional as F
from torch import nn
from ddp_tricks import InMemoryDataset


class NoLoss:
    def datasets(self):
        pass

    def model(self):
        pass


class WrongOutput:
    better = {}

    def __init__(self, args):
        pass

    def datasets(self):
        x = torch.randn(20, 5)
        return InMemoryDataset(x, torch.arange(20) % 3), InMemoryDataset(x, torch.arange(20) % 3)

    def model(self):
        return nn.Linear(5, 7)

    def loss(self, outputs, targets):
        return F.mse_loss(outputs, targets.float())


class Shaped(WrongOutput):
    better = {"hits": "max"}

    def model(self):
        return nn.Linear(5, 3)

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    def metric_sums(self, outputs, targets):  # hits per class: a sum of shape (3,), reported as it is
        return {"hits": torch.bincount(targets[outputs.argmax(1) == targets], minlength=3)}


class Unnamed(Shaped):
    better = {}

    def metric_sums(self, outputs, targets):
        return {"hits": (outputs.argmax(1) == targets).sum()}
"""


@pytest.mark.parametrize(
    "spec, extra, message",
    [
        ("nowhere.py:Task", [], "--task 'nowhere.py:Task': no Python file 'nowhere.py'"),
        ("{bad}:Missing", [], "has no class 'Missing' (it defines: NoLoss, Shaped, Unnamed, WrongOutput)"),
        ("{bad}:NoLoss", [], "NoLoss lacks loss(); a task needs datasets(), model() and loss(outputs, targets)"),
        ("{bad}:WrongOutput", [], "the task's model output (on inputs of shape (4, 5)) does not fit its loss"),
        ("{bad}:Unnamed", [], "the task reports metrics ['hits'] but its `better` names []"),
        ("{bad}:Shaped", [], "the task reports 'hits' as a tensor of shape (3,) from a state without metrics()"),
        ("task.py:Task", ["--monitor", "f1"], "--monitor-metric 'f1' is not a reported metric: use one of loss, acc"),
        ("examples/regression.py:Diabetes", ["--dataset", "mnist"], "--dataset is a flag of the built-in task"),
        ("examples/regression.py:Diabetes", ["--hidden", "0"], "--hidden must be a positive number of units, got 0"),
    ],
)
def test_a_mistake_in_a_task_is_one_line_exit_2_and_leaves_nothing(spec, extra, message, tmp_path, capsys):
    (tmp_path / "bad.py").write_text(BAD_TASK)
    runs = tmp_path / "runs"
    argv = ["--task", spec.format(bad=tmp_path / "bad.py"), *extra, "--runs-dir", str(runs), "-e", "1", "-b", "4"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not runs.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_task_mistake_on_2_ranks_is_printed_once_and_every_rank_exits_2(tmp_path):
    result = launch(["--monitor-metric", "val_f1", "--runs-dir", str(tmp_path / "runs")], stop_others=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "--monitor-metric 'val_f1' is not a reported metric" in errors[0]
    assert result.exitcodes == [2, 2] and not (tmp_path / "runs").exists()
