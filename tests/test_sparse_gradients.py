"""Sparse embedding gradients (nn.Embedding(sparse=True)), on the recommender example (examples/recommender.py): the
start-up check finds them with one backward; SGD steps them in a group of their own (no momentum, no weight decay)
with every trick that can take them, on DDP over gloo too, and gives the dense run's weights; every setting that
cannot take them is one line at start (it was a traceback at the first step)."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from multiproc import REPO, launch
from torch import nn

import run
from customized_function import same_seeds
from ddp_tricks import cli as config
from ddp_tricks.errors import UserError
from ddp_tricks.training import seam

TASK = ["--task", "examples/recommender.py:Ratings"]
TABLES = ["user.weight", "item.weight", "user_bias.weight", "item_bias.weight"]
SAID = "sparse gradients in user.weight, item.weight, user_bias.weight, item_bias.weight: plain SGD steps them"


def weights(run_dir):
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


def last_row(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))[-1]


def test_one_backward_names_the_parameters_with_sparse_gradients_and_clears_every_gradient():
    class Mixed(nn.Module):  # a table, a functional lookup with sparse=True, and dense layers
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 3, sparse=True)
            self.dense_table = nn.Embedding(10, 3)
            self.free = nn.Parameter(torch.randn(10, 3))
            self.head = nn.Linear(3, 1)

        def forward(self, ids):
            x = self.table(ids) + self.dense_table(ids) + F.embedding(ids, self.free, sparse=True)
            return self.head(x).squeeze(-1)

    class Task:
        def loss(self, outputs, targets):
            return F.mse_loss(outputs, targets)

    from ddp_tricks import InMemoryDataset

    model = Mixed().train()
    data = InMemoryDataset(torch.arange(8) % 10, torch.randn(8))
    assert seam.sparse_parameters(Task(), model, data) == ["free", "table.weight"]  # named_parameters order
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_sgd_steps_sparse_parameters_in_their_own_group_without_momentum_or_weight_decay():
    # Two steps, against the update written out here: the table's rows by -lr * grad alone, the dense weight by
    # SGD with momentum and weight decay (v = m v + g + wd w, w -= lr v).
    from ddp_tricks.optim import build as optimizers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 2, sparse=True), nn.Linear(2, 1, bias=False))
    table, dense = (p.detach().clone() for p in model.parameters())
    optimizer = optimizers.build(model, "sgd", lr=0.5, momentum=0.9, weight_decay=0.1, sparse=["0.weight"])
    velocity = torch.zeros_like(dense)  # torch's first step sets v = g + wd w: the same as from v = 0
    for ids in (torch.tensor([0, 1, 1]), torch.tensor([1, 4])):
        model(ids).sum().backward()
        grads = [p.grad.to_dense() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        table -= 0.5 * grads[0]
        velocity = 0.9 * velocity + grads[1] + 0.1 * dense
        dense -= 0.5 * velocity
        assert torch.allclose(model[0].weight, table, atol=1e-7) and torch.allclose(model[1].weight, dense, atol=1e-7)
    assert (
        optimizer.param_groups[-1]["params"] == [model[0].weight]
        and "momentum_buffer" not in optimizer.state[model[0].weight]
    )


def test_sparse_sgd_in_the_template_equals_sgd_written_out_with_the_tables_apart(tmp_path, capsys):
    # The template's defaults (momentum 0.9, weight decay 5e-4), accumulation 2, one process: each step, the mean
    # loss over the step's samples (the plan's), one SGD step with the tables in a plain group, written here.
    argv = [*TASK, "--sparse", "-b", "32", "--accum-steps", "2", "-l", "0.5", "-e", "1", "--no-progress"]
    assert run.main([*argv, "-n", "r", "--runs-dir", str(tmp_path)]) == 0
    assert SAID in capsys.readouterr().out

    flags, task_class = config.parse([*TASK, "-b", "32", "--accum-steps", "2", "-l", "0.5", "-e", "1"])
    task = task_class(flags)  # dense tables: the reference owes nothing to sparse gradients
    same_seeds(flags.seed)  # as run.py: seeds, datasets, model
    train, _ = task.datasets()
    model = task.model()
    tables = [getattr(model, name.split(".")[0]).weight for name in TABLES]
    rest = [p for p in model.parameters() if all(p is not t for t in tables)]
    reference = torch.optim.SGD(
        [{"params": rest}, {"params": tables, "momentum": 0.0, "weight_decay": 0.0}],
        lr=0.5,
        momentum=0.9,
        weight_decay=5e-4,
    )
    for step in run.make_plan(flags, len(train), 1).epoch(1, 0):
        index = torch.tensor([i for micro in step.micro_batches for i in micro])
        F.mse_loss(model(train.inputs[index]), train.targets[index]).backward()
        reference.step()
        reference.zero_grad()
    trained = weights(tmp_path / "r")
    for name, value in model.state_dict().items():
        assert (trained[name] - value).abs().max().item() <= 1e-5, name


def weights_at_start(name):
    flags, task_class = config.parse(TASK)
    task = task_class(flags)
    same_seeds(flags.seed)
    task.datasets()
    return task.model().state_dict()[name]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_with_sparse_tables_give_the_dense_run_s_weights(tmp_path):
    # DDP on gloo reduces the sparse gradients; accumulation (no_sync) and clipping take them as they are.
    flags = [*TASK, "--momentum", "0", "--wd", "0", "-l", "0.5", "--accum-steps", "2", "--clip-grad-norm", "0.5",
             "-b", "16", "-e", "1", "--no-progress", "--runs-dir", str(tmp_path)]  # fmt: skip
    sparse = launch([*flags, "--sparse", "-n", "sparse"])
    dense = launch([*flags, "-n", "dense"])
    assert sparse.returncode == 0 and dense.returncode == 0, sparse.stderr[-3000:] + dense.stderr[-3000:]
    assert SAID in sparse.stdout and "sparse gradients" not in dense.stdout
    a, b = weights(tmp_path / "sparse"), weights(tmp_path / "dense")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in a)
    assert any((a[k] - weights_at_start(k)).abs().max().item() > 1e-3 for k in TABLES)  # the tables did train
    assert float(last_row(tmp_path / "sparse")["val_rmse"]) == pytest.approx(
        float(last_row(tmp_path / "dense")["val_rmse"]), rel=1e-5
    )


SUPPORTED = {  # each with the default momentum 0.9 and weight decay 5e-4 for the dense weights
    "clip accum lookahead bn-bias-separately bf16 skip": [
        "--clip-grad-norm",
        "1",
        "--accum-steps",
        "2",
        "--lookahead",
        "--bn-bias-separately",
        "--amp",
        "bf16",
        "--on-nonfinite",
        "skip",
    ],  # fmt: skip
    "fp16 nesterov cosine warmup": ["--amp", "fp16", "--nesterov", "--scheduler", "cosine", "--warmup-epochs", "0.5"],
}


@pytest.mark.parametrize("extra", SUPPORTED.values(), ids=SUPPORTED.keys())
def test_every_trick_that_can_take_sparse_gradients_trains_with_them(extra, tmp_path, capsys):
    assert run.main([*TASK, "--sparse", "-l", "1", "-b", "64", "-e", "1", "--no-progress", "-n", "r", "--runs-dir",
                     str(tmp_path), *extra]) == 0  # fmt: skip
    assert SAID in capsys.readouterr().out
    rmse = float(last_row(tmp_path / "r")["val_rmse"])
    assert math.isfinite(rmse) and rmse < 1.15  # below the ratings' spread (1.167): it learned


WHAT = "error: the model's user.weight, item.weight, user_bias.weight, item_bias.weight get sparse gradients (an "
DENSE = "or make the tables dense (sparse=False)"
REFUSED = {
    **{
        f"--optimizer {name}": (
            ["--optimizer", name],
            f"which --optimizer {name} cannot step: use --optimizer sgd (it steps them without momentum or weight "
            f"decay), {DENSE}",
        )
        for name in ("adam", "adamw", "lars", "lamb")
    },
    "--lars-wrap": (
        ["--lars-wrap"],
        f"which --lars-wrap cannot scale (LARS takes dense ones): drop --lars-wrap, {DENSE}",
    ),
    "--strategy fsdp": (
        ["--strategy", "fsdp"],
        f"which FSDP cannot shard or reduce-scatter: use --strategy ddp, {DENSE}",
    ),
    "--batch-trace": (
        ["--batch-trace", str(REPO / "examples" / "traces" / "doubling.csv"), "--trace-end", "repeat-last"],
        f"which a --batch-trace run cannot reduce (it sums all gradients as one dense buffer): drop --batch-trace, "
        f"{DENSE}",
    ),
}


@pytest.mark.parametrize("argv, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_setting_that_cannot_take_sparse_gradients_is_one_line_at_start(argv, message, tmp_path, capsys):
    assert run.main([*TASK, "--sparse", "-e", "1", "--no-progress", "--runs-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{WHAT}nn.Embedding(sparse=True)), {message}"]
    assert not any(tmp_path.iterdir())


def test_sparse_gradients_under_nccl_are_one_line_naming_gloo(monkeypatch, tmp_path, capsys):
    # Rank 0 of 2 on a GPU machine (faked): the template averages sparse gradients on gloo only.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert run.main([*TASK, "--sparse", "-e", "1", "--no-progress", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{WHAT}nn.Embedding(sparse=True)), which the template averages across processes on gloo only (the rows' "
        f"counts travel as CPU tensors): pass --backend gloo, {DENSE}"
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refused_setting_on_2_ranks_exits_2_without_a_traceback(tmp_path):
    result = launch([*TASK, "--sparse", "--optimizer", "adamw", "-e", "1", "--no-progress", "--runs-dir",
                     str(tmp_path)])  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"{WHAT}nn.Embedding(sparse=True)), {REFUSED['--optimizer adamw'][1]}"], result.stderr[-3000:]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------ averaged apart from DDP's reducer (distributed/sparse.py)
# DDP's reducer takes sparse gradients on gloo, but its sparse path aborts the process now and then (glibc's "malloc():
# unaligned tcache chunk detected" inside backward(), in a plain torch 2.14.1 script too): the template builds DDP
# without the tables and averages their gradients itself after the step's last backward.

APART = ["free", "a.weight", "b.weight", "never.weight"]


class Lookups(nn.Module):
    """A float table (also held by a second module), a float64 one only some ranks use, one no rank uses, the root
    module's own table (a functional lookup), and a dense head (DDP's)."""

    def __init__(self):
        super().__init__()
        self.free = nn.Parameter(torch.randn(6, 3))
        self.a = nn.Embedding(12, 3, sparse=True)
        self.a_again = nn.Embedding(12, 3, sparse=True)
        self.a_again.weight = self.a.weight  # DDP's reducer meets it as "a_again.weight" too
        self.b = nn.Embedding(7, 2, sparse=True).double()
        self.never = nn.Embedding(5, 2, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, ids, use_b):
        out = self.head(self.a(ids) + F.embedding(ids % 6, self.free, sparse=True)).squeeze(-1)
        return out + self.b(ids % 7).sum(-1).float() if use_b else out


def _rank_batch(rank):
    """Each rank's ids (repeats, a different count per rank) and whether it uses table b (rank 0 only)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 12, (5 + 4 * rank,), generator=g), rank == 0


def _grads(model):
    return {n: None if p.grad is None else p.grad.to_dense().clone() for n, p in model.named_parameters()}


def _apart_step(rank, world_size):
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.distributed.sparse import SparseGradients
    from ddp_tricks.distributed.wrap import reducer_names, wrap

    here = Dist(rank, world_size, rank, torch.device("cpu"), "gloo")
    torch.manual_seed(rank)  # every rank starts from its own weights: wrap gives them rank 0's
    model = Lookups()
    sparse = SparseGradients(model, APART, world_size)
    ddp = wrap(model, here, apart=APART)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, use_b = _rank_batch(rank)
    ddp(ids, use_b).square().mean().backward()
    before = _grads(model)  # DDP has averaged the head's, and left the tables alone
    if rank == 0:  # a gradient with no row: no rank has a row, so no rank keeps a gradient
        model.never.weight.grad = torch.sparse_coo_tensor(
            torch.empty(1, 0, dtype=torch.int64), torch.empty(0, 2), (5, 2)
        )
    sparse.reduce()
    coalesced = all(p.grad.is_sparse and p.grad.is_coalesced() for n, p in model.named_parameters() if n in APART[:3])
    torch.manual_seed(rank)
    tables_only = nn.Embedding(9, 2, sparse=True)
    wrapped = wrap(tables_only, here, apart=["weight"])  # nothing left for DDP: not wrapped, rank 0's weights
    named = reducer_names(model)  # what DDP's error messages index: the head alone
    return (
        start,
        before,
        _grads(model),
        coalesced,
        type(ddp).__name__,
        wrapped is tables_only,
        tables_only.weight,
        named,
    )


@pytest.mark.timeout(120)
def test_sparse_tables_are_left_out_of_ddp_and_averaged_after_the_backward_as_ddp_s_mean():
    from multiproc import run_ranks

    ranks = run_ranks(_apart_step, 2)
    torch.manual_seed(0)
    reference = Lookups()  # rank 0's weights, each rank's batch in one process
    local = []
    for rank in range(2):
        reference.zero_grad(set_to_none=True)
        reference(*_rank_batch(rank)).square().mean().backward()
        local.append(_grads(reference))
    mean = {
        name: None if all(g[name] is None for g in local) else sum(g[name] for g in local if g[name] is not None) / 2
        for name in local[0]
    }
    for rank, (start, before, after, coalesced, kind, unwrapped, table, named) in enumerate(ranks):
        assert kind == "DistributedDataParallel" and unwrapped and coalesced and named == ["head.weight", "head.bias"]
        assert all(torch.equal(start[n], p) for n, p in reference.named_parameters())  # rank 0's tables too
        assert torch.equal(table, ranks[0][6])
        assert torch.allclose(before["head.weight"], mean["head.weight"], atol=1e-6)  # DDP's own mean
        for name in ("a.weight", "free"):  # the rank's own: DDP left them alone (a shared table, the root's own)
            assert torch.allclose(before[name], local[rank][name], atol=1e-6), (rank, name)
        assert (before["b.weight"] is None) == (rank == 1)
        for name in ("a.weight", "b.weight", "free"):
            assert after[name].dtype == mean[name].dtype
            assert torch.allclose(after[name], mean[name], atol=1e-6), (rank, name)
        assert after["never.weight"] is None  # no rank has a gradient for it: none, as DDP leaves it
    assert not torch.allclose(ranks[0][1]["a.weight"], ranks[1][1]["a.weight"])  # the ranks' own before, apart
    torch.manual_seed(1)
    assert not torch.equal(nn.Embedding(9, 2).weight, ranks[0][6])  # rank 1 began from other weights


TABLES_ONLY = """
import torch
from torch import nn

from examples.recommender import ITEMS, USERS, Ratings


class Biases(nn.Module):  # a rating as the mean plus a user bias and an item bias: sparse tables, nothing dense
    def __init__(self, mean):
        super().__init__()
        self.user, self.item = nn.Embedding(USERS, 1, sparse=True), nn.Embedding(ITEMS, 1, sparse=True)
        self.mean = mean

    def forward(self, pairs):
        return self.mean + self.user(pairs[:, 0]).squeeze(1) + self.item(pairs[:, 1]).squeeze(1)


class BiasesOnly(Ratings):
    def model(self):
        return Biases(self.mean)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_of_sparse_tables_alone_trains_on_two_ranks_as_one_process_at_the_same_global_batch(tmp_path):
    # Nothing is left for DDP (it refuses such a module): the model is not wrapped, the template averages the tables.
    (tmp_path / "biases.py").write_text(TABLES_ONLY)
    flags = ["--task", f"{tmp_path / 'biases.py'}:BiasesOnly", "--sparse", "-l", "2", "-e", "1", "--no-progress",
             "--runs-dir", str(tmp_path)]  # fmt: skip
    two = launch([*flags, "-b", "16", "-n", "two"])
    one = launch([*flags, "-b", "32", "-n", "one"], nproc=None)
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:] + one.stderr[-3000:]
    a, b = weights(tmp_path / "two"), weights(tmp_path / "one")
    assert set(a) == set(b) == {"user.weight", "item.weight"}
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert all(a[k].abs().max().item() > 0.1 for k in a)  # the tables did train


def test_sparse_gradients_with_apex_on_several_processes_are_one_line_naming_native_amp():
    # Apex's amp unscales and checks for overflow inside backward(), before the template averages the tables.
    with pytest.raises(UserError) as caught:
        seam.check_sparse(["t.weight"], "sgd", False, "ddp", False, False, True)
    assert str(caught.value) == (
        "the model's t.weight gets sparse gradients (an nn.Embedding(sparse=True)), which the template averages "
        "across processes after the backward, where --amp-backend apex has already unscaled them and judged an "
        "overflow on each rank alone: use --amp-backend native, or make the tables dense (sparse=False)"
    )
    seam.check_sparse(["t.weight"], "sgd", False, "ddp", False, False, False)  # native AMP, or one process: taken
