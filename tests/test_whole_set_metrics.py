"""Metrics over the whole validation set (#38): states that score() gives as rows (`gathered`) are concatenated across
ranks once per evaluation, so a metric that is no sum of per-sample values (ROC AUC) is exact at any world size, on
uneven splits and under both strategies; a task that scores its evaluation reports no validation loss."""

import csv

import pytest
import torch
from multiproc import run_ranks

import run
from ddp_tricks import InMemoryDataset, cli
from ddp_tricks.data import loaders
from ddp_tricks.distributed import collectives, fsdp
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training import loop, seam
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

CPU = torch.device("cpu")
RATINGS = ["--task", "examples/recommender.py:Ratings"]
N_VAL, VAL_BATCH = 577, 16  # 2 ranks: 18 rounds of 16 rows, 1 leftover (19 batches); 3 ranks: 12 rounds, 1 leftover


def _ratings_model():
    """The recommender's task, its first N_VAL validation ratings and a model whose predictions spread (its tables
    drawn at random: the example starts its biases at zero), the same in every process."""
    flags, task_class = cli.parse(RATINGS)
    task = task_class(flags)
    _, val = task.datasets()
    val = InMemoryDataset(val.inputs[:N_VAL], val.targets[:N_VAL])
    torch.manual_seed(0)
    model = task.model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    return task, val, model


def _evaluate(rank, world_size, sharded):
    task, val, model = _ratings_model()
    scoring = seam.check_scoring(task, model, val)
    if sharded:
        model = fsdp.shard(model, fsdp.shard_units(task, model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    t = Training(model, optimizer, Schedule(WarmupDecay(optimizer, 0, 0)), task, ["sq_error", "abs_error"],
                 Precision("off", CPU), CPU, scoring=scoring, rank=rank, world_size=world_size)  # fmt: skip
    return loop.evaluate(t, loaders.val_loader(val, VAL_BATCH, rank, world_size, CPU))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, strategy", [(1, "ddp"), (2, "ddp"), (3, "ddp"), (2, "fsdp")])
def test_the_auc_over_gathered_predictions_equals_scikit_learn_s_on_the_whole_set(world_size, strategy):
    """Broken on purpose (gather_rows keeping each rank's padding rows: `part` for `part[:n]`), the AUC at 2 and 3
    ranks (and under FSDP) takes padded zeros for predictions and differs from scikit-learn's."""
    from sklearn.metrics import roc_auc_score

    sharded = strategy == "fsdp"
    results = run_ranks(_evaluate, world_size, sharded, timeout=240) if world_size > 1 else [_evaluate(0, 1, False)]
    task, val, model = _ratings_model()
    with torch.no_grad():
        predicted = model(val.inputs).double()
    stars = val.targets.double()
    expected_auc = roc_auc_score((stars >= 4).numpy(), predicted.numpy())
    expected_rmse = ((predicted - stars) ** 2).mean().sqrt().item()
    for result in results:  # every rank reports the same
        assert "val_loss" not in result  # score() evaluates: no loss
        assert result["val_auc"] == pytest.approx(expected_auc, abs=1e-6)
        assert result["val_rmse"] == pytest.approx(expected_rmse, rel=1e-6)


def _gather(rank, world_size):
    rows = torch.arange(rank + 1, dtype=torch.float32).repeat(2, 1).T * (rank + 1)  # rank r: r + 1 rows of 2
    flags = torch.tensor([rank % 2 == 0] * (2 - rank), dtype=torch.bool)  # 2 rows, 1, then none
    return collectives.gather_rows(rows), collectives.gather_rows(flags)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gather_rows_concatenates_uneven_rows_in_rank_order():
    """Broken on purpose (the padding kept), rank 0's single row arrives with two rows of zeros after it."""
    for rows, flags in run_ranks(_gather, 3, timeout=60):
        assert torch.equal(rows, torch.tensor([[0.0, 0.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [3.0, 3.0], [6.0, 6.0]]))
        assert flags.dtype == torch.bool and flags.tolist() == [True, True, False]


SCORED = """
import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset


class Scored:
    better = {"auc_like": "max", "hits": "max"}
    monitor = "loss"
    gathered = ("score",)

    def __init__(self, args):
        pass

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 3, generator=g)
        y = (x.sum(1) > 0).long()
        return InMemoryDataset(x[:30], y[:30]), InMemoryDataset(x[30:], y[30:])

    def model(self):
        return nn.Linear(3, 2)

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    def score(self, outputs, targets):
        per_class = torch.bincount(targets[outputs.argmax(1) == targets], minlength=2)
        return {"hits": per_class, "score": outputs[:, 1] - outputs[:, 0]}

    def metrics(self, sums, count):
        return {"hits": float(sums["hits"].sum()) / count, "auc_like": float(sums["score"].mean())}


class Monitored(Scored):
    monitor = "hits"
"""


def test_a_task_that_scores_its_evaluation_monitors_a_metric_and_has_no_validation_loss(tmp_path, capsys):
    """Broken on purpose (monitored_metric without its score() check), the run starts and ends at its first epoch
    with a KeyError: 'val_loss' traceback."""
    (tmp_path / "t.py").write_text(SCORED)
    argv = ["--task", f"{tmp_path / 't.py'}:Scored", "-e", "2", "-b", "5", "--no-progress", "--runs-dir",
            str(tmp_path / "runs"), "-n", "r"]  # fmt: skip
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the task monitors its loss (monitor = 'loss'), but the task scores" in err, err
    assert "set monitor = 'NAME' in the task (or pass --monitor-metric NAME), NAME one of its metrics" in err
    assert run.main([*argv, "--monitor-metric", "loss"]) == 2
    assert "--monitor-metric loss, but the task scores its validation set with score()" in capsys.readouterr().err
    assert run.main([*argv, "--task", f"{tmp_path / 't.py'}:Monitored"]) == 0, capsys.readouterr().err
    with open(tmp_path / "runs" / "r" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert "val_loss" not in rows[0] and {"train_loss", "val_hits", "val_auc_like"} <= set(rows[0])
    assert rows[0]["train_hits"] == "nan"  # training sums nothing: its loss only
    best = torch.load(tmp_path / "runs" / "r" / "best.pt", weights_only=True)["best"]
    values = [float(r["val_hits"]) for r in rows]
    assert best["metric"] == "val_hits" and best["value"] == max(values)


def _user_task_metrics(name, weights):
    """The validation metrics of `weights`, in one process and one batch, by scikit-learn: mIoU from per-class
    Jaccard scores over every pixel (classes that appear nowhere left out), recall@1 from cosine nearest neighbours
    (each digit's nearest other digit)."""
    import numpy as np
    from sklearn.metrics import accuracy_score, jaccard_score
    from sklearn.neighbors import NearestNeighbors

    flags, task_class = cli.parse(["--task", f"tests/user_tasks.py:{name}"])
    task = task_class(flags)
    _, val = task.datasets()
    model = task.model()
    model.load_state_dict(weights)
    with torch.no_grad():
        outputs = model(val.inputs)
    if name == "Segmentation":
        truth, predicted = val.targets.flatten().numpy(), outputs.argmax(1).flatten().numpy()
        present = np.union1d(truth, predicted)
        miou = jaccard_score(truth, predicted, labels=present, average="macro")
        return {"val_miou": float(miou), "val_pixel_acc": accuracy_score(truth, predicted)}
    neighbours = NearestNeighbors(n_neighbors=2, metric="cosine").fit(outputs.numpy())
    nearest = neighbours.kneighbors(outputs.numpy(), return_distance=False)[:, 1]
    return {"val_recall_at_1": float((val.targets[nearest] == val.targets).double().mean())}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["Segmentation", "Retrieval"])
def test_tasks_of_other_families_evaluate_exactly_on_2_ranks_under_ddp_and_fsdp(name, tmp_path):
    """tests/user_tasks.py, written from docs/tasks.md alone: mIoU from a summed confusion matrix (a metric sum with
    a shape, units() counting pixels), recall@1 over gathered embeddings (score(), `gathered`). Broken on purpose
    (the flat sums vector one element per sum, as before #38: `t.sums_layout.width` as `len(t.sum_names)`), the
    segmentation fails at its first step; (gather_rows keeping the padding) the retrieval's recall differs."""
    from multiproc import full_state, launch

    for strategy in ("ddp", "fsdp"):
        flags = ["--task", f"tests/user_tasks.py:{name}", "-b", "8", "-e", "2", "--strategy", strategy,
                 "--no-progress", "--runs-dir", str(tmp_path), "-n", strategy]  # fmt: skip
        result = launch(flags)
        assert result.returncode == 0, result.stderr[-3000:]
        if strategy == "ddp":
            weights = torch.load(tmp_path / strategy / "last.pt", weights_only=True)["model"]
        else:
            weights = full_state(tmp_path / strategy / "last.dcp")["model"]
        with open(tmp_path / strategy / "metrics.csv", newline="") as f:
            reported = list(csv.DictReader(f))[-1]
        for column, value in _user_task_metrics(name, weights).items():
            assert float(reported[column]) == pytest.approx(value, rel=1e-6, abs=1e-9), (strategy, column)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_five_validation_digits_at_batch_1_report_one_process_s_recall_with_each_row_once(world_size, tmp_path):
    """tests/user_tasks.py:FewRetrieval (score(), gathered rows) with 5 validation digits at --val-batch-size 1: on 4
    ranks the split before #48 gave one rank none of them (torch.cat of its no rows failed; now every rank holds one,
    and the leftover is evaluated by all, its rows given by rank 0). Its run trains and reports the recall@1 that
    scikit-learn finds over the 5 digits with the run's last weights, from 5 gathered rows. Broken on purpose: under
    the split before #48, a rank's empty batches adding no rows, the 4-rank run ended in torch.cat's "expected a
    non-empty list of Tensors"; the leftover's rows given by every rank (`counts_alike = True`), 6, 6 and 8 rows."""
    from multiproc import launch

    flags = ["--task", "tests/user_tasks.py:FewRetrieval", "-b", "8", "-e", "2", "--val-batch-size", "1",
             "--no-progress", "--runs-dir", str(tmp_path), "-n", "few"]  # fmt: skip
    result = launch(flags, nproc=world_size)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = torch.load(tmp_path / "few" / "last.pt", weights_only=True)["model"]
    with open(tmp_path / "few" / "metrics.csv", newline="") as f:
        reported = list(csv.DictReader(f))
    assert len(reported) == 2 and all(float(r["val_rows"]) == 5 for r in reported)
    expected = _user_task_metrics("FewRetrieval", weights)["val_recall_at_1"]
    assert float(reported[-1]["val_recall_at_1"]) == pytest.approx(expected, abs=1e-12)


def test_metrics_gets_python_floats_for_scalar_sums_and_float64_cpu_tensors_for_shaped_ones():
    """What docs/tasks.md tells a task's metrics(sums, count): count a float, a scalar sum a Python float, a shaped
    sum a float64 tensor on the CPU. Broken on purpose: Layout.unflat giving a scalar as a 0-d tensor fails it."""
    from ddp_tricks.training.metric_states import Layout, report

    seen = {}

    class Task:
        def metrics(self, sums, count):
            seen.update(sums, count=count)
            return {"acc": sums["correct"] / count}

    layout = Layout((("correct", ()), ("confusion", (2, 2))))
    assert report(Task(), layout, "val", [1.0, 3.0, 1.0, 2.0, 3.0, 4.0], 4.0) == {"val_loss": 0.25, "val_acc": 0.75}
    assert type(seen["correct"]) is float and type(seen["count"]) is float
    assert seen["confusion"].dtype == torch.float64 and seen["confusion"].device.type == "cpu"
    assert seen["confusion"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
