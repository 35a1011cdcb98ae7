"""Any model, any batch (#20): batches and outputs of any structure, losses that average over the task's own units
(tokens), the language-model example on 2 ranks, every torchvision classifier in the built-in task, and small
last batches with BatchNorm."""

import collections
import csv
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from multiproc import launch, preempted, run_ranks
from resumed import assert_resumed, final_step, saved_state
from torch import nn

import run
from ddp_tricks import cli
from ddp_tricks.training.batches import describe, float_outputs, to_device

Pair = collections.namedtuple("Pair", "logits extra")


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    name: str = "a leaf that is not a tensor"


def test_structures_move_cast_and_count_as_a_whole():
    images = torch.randn(3, 2, 5, 5)
    batch = {"x": [images, (torch.arange(3), "tag")], "meta": Batch(images), "n": 7}
    moved = to_device(batch, torch.device("cpu"), channels_last=True)
    assert moved["n"] == 7 and moved["x"][1][1] == "tag" and moved["meta"].name == "a leaf that is not a tensor"
    assert moved["x"][0].is_contiguous(memory_format=torch.channels_last) and torch.equal(moved["x"][0], images)
    assert moved["x"][1][0].is_contiguous()  # an integer tensor is no image: left as it is
    assert isinstance(moved["meta"], Batch) and isinstance(moved["x"][1], tuple)
    half = Pair(torch.ones(2, dtype=torch.bfloat16), {"d": torch.ones(1, dtype=torch.float64), "i": torch.ones(1)})
    cast = float_outputs(half)
    assert isinstance(cast, Pair) and cast.logits.dtype == torch.float32  # autocast's half types become float32
    assert cast.extra["d"].dtype == torch.float64  # nothing else changes
    assert describe({"tokens": torch.zeros(4, 9, dtype=torch.long)}) == "dict(tokens: tensor (4, 9) int64)"


DICT_TASK = """
import collections
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

Out = collections.namedtuple("Out", "logits features")


class Pairs(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
        self.y = ((self.a.sum(1) > 0).long() + (self.b.sum(1) > 0).long())

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"a": self.a[i], "b": self.b[i], "note": "kept"}, self.y[i]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(3, 8), nn.Linear(16, 3)

    def forward(self, batch):
        assert batch["note"] == ["kept"] * len(batch["a"])  # a non-tensor leaf passes through as collated
        features = torch.cat([torch.relu(self.a(batch["a"])), torch.relu(self.b(batch["b"]))], 1)
        return self.head(features), features  # a tuple


class DictTask:
    better = {"acc": "max"}

    def __init__(self, args):
        pass

    def datasets(self):
        return Pairs(96, 1), Pairs(37, 2)

    def model(self):
        return TwoInputs()

    def loss(self, outputs, targets):
        logits, _ = outputs
        return F.cross_entropy(logits, targets)

    def metric_sums(self, outputs, targets):
        return {"acc": (outputs[0].argmax(1) == targets).sum()}


class NamedOut(DictTask):
    def model(self):
        class M(TwoInputs):
            def forward(self, batch):
                return Out(*super().forward(batch))

        return M()


class TokenSums(DictTask):
    def units(self, inputs, targets):
        return torch.ones(2)


class NoUnits(DictTask):
    def units(self, inputs, targets):
        return targets.sum() * 0  # a count of 0 in every batch


class NumberUnits(DictTask):
    def units(self, inputs, targets):
        return targets.numel()


class OneElementUnits(DictTask):
    def units(self, inputs, targets):
        return torch.tensor([float(targets.numel())])  # shape (1,), on the CPU


class FractionUnits(DictTask):
    def units(self, inputs, targets):
        return (targets > 0).float().mean() * 0 + 0.5  # a fraction of the batch, not a count


class ScalarSums(DictTask):
    def metric_sums(self, outputs, targets):
        return {"acc": (outputs.argmax(1) == targets).sum()}
"""


@pytest.mark.parametrize("name", ["DictTask", "NamedOut"])
def test_dict_inputs_and_a_tuple_output_train_and_evaluate_exactly(name, tmp_path):
    (tmp_path / "t.py").write_text(DICT_TASK)
    argv = ["--task", f"{tmp_path / 't.py'}:{name}", "-e", "3", "-b", "8", "--no-progress", "--runs-dir", str(tmp_path),
            "-n", name, "--val-batch-size", "5", "--optimizer", "adam", "-l", "0.01"]  # fmt: skip
    assert run.main(argv) == 0
    with open(tmp_path / name / "metrics.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    import importlib.util

    spec = importlib.util.spec_from_file_location("dict_task", tmp_path / "t.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = getattr(module, name)(None).model()
    model.load_state_dict(torch.load(tmp_path / name / "last.pt", weights_only=True)["model"])
    val = module.Pairs(37, 2)
    with torch.no_grad():
        logits = model({"a": val.a, "b": val.b, "note": ["kept"] * 37})[0]
    assert float(last["val_loss"]) == pytest.approx(F.cross_entropy(logits, val.y).item(), rel=1e-6)
    assert float(last["val_acc"]) == pytest.approx((logits.argmax(1) == val.y).double().mean().item(), abs=1e-12)


@pytest.mark.parametrize(
    "name, message",
    [
        ("TokenSums", "the task's units() must give the batch's count of units as one number, not tensor (2,)"),
        ("ScalarSums", "the task's model output (on inputs of dict(a: tensor (4, 6) float32, b: tensor (4, 3) float32, "
         "note: list(str, str, str, str))) does not fit its metric_sums() (AttributeError: 'tuple' object has no "
         "attribute 'argmax')"),
        ("FractionUnits", "the task's units() must count the units the loss averages over (a whole number, e.g. "
         "mask.sum()), got 0.5: a mean or a fraction would weigh the batches wrongly"),
        ("NoUnits", "optimizer step(s) so far in epoch 1 held no units: the task's units() gave 0 for every "
         "micro-batch"),
    ],
)  # fmt: skip
def test_what_the_template_checks_on_a_structured_task_is_one_line(name, message, tmp_path, capsys):
    (tmp_path / "t.py").write_text(DICT_TASK)
    runs = tmp_path / "runs"
    argv = ["--task", f"{tmp_path / 't.py'}:{name}", "-e", "1", "-b", "8", "--no-progress", "--runs-dir", str(runs),
            "-n", "x"]  # fmt: skip
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (runs / "x" / "last.pt").exists() and not (runs / "x" / "metrics.csv").exists()
    if name == "NoUnits":  # it failed after its start: the folder holds no run, so the name is free again
        (tmp_path / "t.py").write_text(DICT_TASK.replace("targets.sum() * 0", "targets.numel()"))
        capsys.readouterr()
        assert run.main(argv) == 0, capsys.readouterr().err


def test_units_as_a_number_or_a_one_element_tensor_weigh_alike(tmp_path):
    (tmp_path / "t.py").write_text(DICT_TASK)
    weights = {}
    for name in ("NumberUnits", "OneElementUnits"):
        argv = ["--task", f"{tmp_path / 't.py'}:{name}", "-e", "1", "-b", "6", "--accum-steps", "2", "--no-progress",
                "--runs-dir", str(tmp_path), "-n", name]  # fmt: skip
        assert run.main(argv) == 0
        weights[name] = torch.load(tmp_path / name / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(weights["NumberUnits"][k], weights["OneElementUnits"][k]) for k in weights["NumberUnits"])


# ---------------------------------------------------------------- per-token weighting, against a plain computation

TOKENS = [torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 2, 6, 5, 8, 4, 7)]


def _token_task():
    """Sequences of different lengths padded per micro-batch; the loss is the mean over real tokens."""
    from ddp_tricks.training.precision import Precision
    from ddp_tricks.training.state import Training

    class Tokens:
        better = {}

        def loss(self, outputs, targets):
            return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100)

        def units(self, inputs, targets):
            return (targets != -100).sum()

    return Tokens, Training, Precision


def _pad(sequences):
    length = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    targets = torch.full((len(sequences), length), -100)
    for row, s in enumerate(sequences):
        tokens[row, : len(s)] = s
        targets[row, : len(s)] = (s + 1) % 7
    return tokens, targets


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 5), nn.Linear(5, 7))


def _token_steps(rank, world_size, micro):
    """Two SGD steps over TOKENS (each step: every sequence of its half), micro-batches of `micro` sequences dealt
    round-robin to the ranks, accumulated, one reduction per step: the template's loop and its units."""
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.distributed.wrap import wrap
    from ddp_tricks.plan import Step
    from ddp_tricks.schedules.curves import WarmupDecay
    from ddp_tricks.schedules.schedule import Schedule
    from ddp_tricks.training.loop import train_one_epoch

    Tokens, Training, Precision = _token_task()
    cpu = torch.device("cpu")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dist_info = Dist(rank, world_size, rank, cpu, "gloo" if world_size > 1 else None)
    t = Training(wrap(model, dist_info), optimizer, Schedule(WarmupDecay(optimizer, 0, 0)), Tokens(), [],
                 Precision("off", cpu), cpu, world_size=world_size, rank=rank)  # fmt: skip
    steps, batches = [], []
    for half in (range(0, 4), range(4, 8)):
        chunks = [list(half)[i : i + micro] for i in range(0, 4, micro)]
        mine = [c for j, c in enumerate(chunks) if j % world_size == rank]
        steps.append(Step(mine, 0, 4))  # the divisor is unused: the task counts units
        batches += [_pad([TOKENS[i] for i in c]) for c in mine]
    train_one_epoch(t, steps, batches)
    return [p.detach().clone() for p in model.parameters()]


def _plain_token_steps():
    """The same two steps written plainly: the gradient of the mean over every real token of the step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for half in (TOKENS[:4], TOKENS[4:]):
        tokens = torch.cat(half)
        loss = F.cross_entropy(model(tokens), (tokens + 1) % 7)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size, micro", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_a_per_token_loss_is_the_mean_over_the_step_s_tokens_at_any_world_size_and_accumulation(world_size, micro):
    expected = _plain_token_steps()
    results = run_ranks(_token_steps, world_size, micro) if world_size > 1 else [_token_steps(0, 1, micro)]
    for weights in results:
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(weights, expected))


# ---------------------------------------------------------------- the language-model example on 2 ranks

LM = ["--task", "examples/language_model.py:PythonSourceLM", "--max-sequences", "240", "--max-length", "32",
      "--width", "16", "--depth", "1", "--heads", "2", "--optimizer", "lamb", "-l", "0.01", "--no-progress",
      "--log-interval", "5"]  # fmt: skip


def _rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [
            {k: v for k, v in r.items() if k not in ("epoch_seconds", "samples_per_second")} for r in csv.DictReader(f)
        ]


def _weights(run_dir):
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


def _plain_lm_metrics(run_dir):
    """Per-token loss, perplexity and accuracy of last.pt over the validation set, one sequence at a time (no
    padding at all), summed over tokens here."""
    flags, task_class = cli.parse(LM)
    task = task_class(flags)
    _, val = task.datasets()
    model = task.model()
    model.load_state_dict(_weights(run_dir))
    model.eval()
    nll, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for sequence in val.sequences:
            logits, _ = model(
                {"tokens": sequence[None, :-1], "mask": torch.ones(1, len(sequence) - 1, dtype=torch.bool)}
            )
            nll += F.cross_entropy(logits[0].double(), sequence[1:], reduction="sum").item()
            correct += (logits[0].argmax(-1) == sequence[1:]).sum().item()
            tokens += len(sequence) - 1
    return {"val_loss": nll / tokens, "val_ppl": math.exp(nll / tokens), "val_token_acc": correct / tokens}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_language_model_on_2_ranks_exact_eval_accumulation_resume_trace_and_bf16(tmp_path):
    flags = [*LM, "--runs-dir", str(tmp_path), "--val-batch-size", "7"]
    # 1. 2 ranks; its evaluation (batches padded to different lengths) equals the plain per-token computation.
    full = launch([*flags, "-b", "4", "-e", "2", "-n", "full"])
    assert full.returncode == 0, full.stderr[-3000:]
    reported = _rows(tmp_path / "full")[-1]
    for name, value in _plain_lm_metrics(tmp_path / "full").items():
        assert float(reported[name]) == pytest.approx(value, rel=2e-6), name

    # 2. --accum-steps 2 gives the weights of twice the batch, per token, whatever the padding. With SGD: the
    # gradients themselves (Adam-like steps divide by the root of tiny second moments, which turns the rounding of
    # differently padded batches into 3e-4 weight differences, measured).
    sgd = ["--optimizer", "sgd", "-l", "0.5"]
    accumulated = launch([*flags, *sgd, "-b", "4", "--accum-steps", "2", "-e", "1", "-n", "accum"])
    single = launch([*flags, *sgd, "-b", "8", "-e", "1", "-n", "single"])
    assert accumulated.returncode == 0 and single.returncode == 0, accumulated.stderr[-2000:] + single.stderr[-2000:]
    a, b = _weights(tmp_path / "accum"), _weights(tmp_path / "single")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5

    # 3. SIGTERM mid-epoch, then --resume auto: bit-identical to the uninterrupted run.
    out, err = preempted([*flags, "-b", "4", "-e", "2", "-n", "pre", "--checkpoint-every-steps", "10"],
                         tmp_path / "pre" / "last.pt")  # fmt: skip
    assert "preempted" in out, (out + err)[-3000:]
    saved = saved_state(tmp_path / "pre" / "last.pt")
    resumed = launch([*flags, "-b", "4", "-e", "2", "-n", "pre", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, saved, final_step(tmp_path / "full"))
    assert _rows(tmp_path / "pre") == _rows(tmp_path / "full")
    wa, wb = _weights(tmp_path / "pre"), _weights(tmp_path / "full")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # 4. A traced run (uneven micro-batches per rank) in bf16 trains it (one launch for both paths).
    trace = tmp_path / "trace.csv"
    trace.write_text("step,batchsize\n" + "".join(f"{i},{4 * (1 + i % 3)}\n" for i in range(200)))
    traced = launch([*flags, "-b", "4", "-e", "1", "-n", "traced", "--batch-trace", str(trace), "--amp", "bf16"])
    assert traced.returncode == 0, traced.stderr[-3000:]
    assert math.isfinite(float(_rows(tmp_path / "traced")[-1]["val_ppl"]))
    assert json.loads((tmp_path / "traced" / "config.json").read_text())["amp"] == "bf16"


# ---------------------------------------------------------------- torchvision classifiers, small last batches

SMALL = """
import torch
from torch import nn

from ddp_tricks import InMemoryDataset
from task import Task


class FewDigits(Task):
    def datasets(self):
        train, val = super().datasets()
        few = InMemoryDataset(train.inputs[:96], train.targets[:96])
        return few, InMemoryDataset(val.inputs[:40], val.targets[:40])


class BatchNormMLP(Task):
    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(170, 12, generator=g), torch.randint(0, 3, (170,), generator=g)
        self.num_classes = 3
        return InMemoryDataset(x[:130], y[:130]), InMemoryDataset(x[130:], y[130:])

    def model(self):
        return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_googlenet_with_its_auxiliary_heads_trains_one_epoch_on_small_images(tmp_path):
    (tmp_path / "small.py").write_text(SMALL)
    name = "googlenet"
    argv = ["--task", f"{tmp_path / 'small.py'}:FewDigits", "--model", name, "--image-size", "15", "-e", "1",
            "-b", "16", "--no-progress", "--runs-dir", str(tmp_path), "-n", name, "-l", "0.01"]  # fmt: skip
    assert run.main(argv) == 0
    with open(tmp_path / name / "metrics.csv", newline="") as f:
        row = list(csv.DictReader(f))[-1]
    assert math.isfinite(float(row["train_loss"])) and math.isfinite(float(row["val_loss"]))


def test_the_built_in_task_names_a_model_s_smallest_input(tmp_path, capsys):
    assert run.main(["--model", "inception_v3", "--runs-dir", str(tmp_path), "-e", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model inception_v3 needs images of at least 299x299 to train" in err
    assert "pass --image-size 299 or more" in err and not any(tmp_path.iterdir())


def test_auxiliary_losses_are_weighted_as_stated():
    from ddp_tricks import models
    from task import Task

    task = Task.__new__(Task)
    task.args = type("Args", (), {"label_smoothing": 0.0})()
    torch.manual_seed(0)
    main, aux1, aux2, y = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    from torchvision.models import GoogLeNetOutputs, InceptionOutputs  # torchvision's own output types

    ce = F.cross_entropy
    assert task.loss(GoogLeNetOutputs(main, aux2, aux1), y) == pytest.approx(
        (ce(main, y) + 0.3 * ce(aux2, y) + 0.3 * ce(aux1, y)).item()
    )
    assert task.loss(InceptionOutputs(main, aux1), y) == pytest.approx((ce(main, y) + 0.4 * ce(aux1, y)).item())
    assert task.metric_sums(GoogLeNetOutputs(main, aux2, aux1), y)["acc"] == (main.argmax(1) == y).sum()
    assert models.main_and_aux(main)[1] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_sample_per_rank_with_batchnorm_is_refused_at_start_and_trains_with_drop_last(tmp_path):
    (tmp_path / "small.py").write_text(SMALL)
    flags = ["--task", f"{tmp_path / 'small.py'}:BatchNormMLP", "-b", "8", "-e", "2", "--runs-dir", str(tmp_path),
             "--no-progress"]  # fmt: skip
    refused = launch([*flags, "-n", "refused"])
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and refused.returncode == 2, refused.stderr[-3000:]
    assert ("with 130 training samples in steps of 2 micro-batches of 8 (--batch-size), the last micro-batch of every "
            "epoch holds 1 sample(s)" in errors[0] and "pass --drop-last" in errors[0])  # fmt: skip
    assert not (tmp_path / "refused").exists()
    trained = launch([*flags, "-n", "dropped", "--drop-last"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "dropped" / "metrics.csv", newline="")))
    assert [float(r["global_batch"]) for r in rows] == [16.0, 16.0]  # 128 of the 130 samples, in whole micro-batches
    assert all(math.isfinite(float(r["val_loss"])) for r in rows)


def test_drop_last_plans_whole_micro_batches_and_validation_keeps_every_sample():
    from ddp_tricks import plan

    kept = plan.make(num_train=130, world_size=2, micro_batch=8, accum_steps=1, epochs=1, seed=0, base_lr=0.1,
                     lr_scaling="keep", base_batch=8, warmup_epochs=0, drop_last=True)  # fmt: skip
    short = plan.make(num_train=130, world_size=2, micro_batch=8, accum_steps=1, epochs=1, seed=0, base_lr=0.1,
                       lr_scaling="keep", base_batch=8, warmup_epochs=0)  # fmt: skip
    for rank in (0, 1):
        sizes = [len(m) for step in kept.epoch(1, rank) for m in step.micro_batches]
        assert sizes == [8] * 8 and kept.steps_per_epoch == 8  # 65 per rank: 8 whole micro-batches
        assert [len(m) for step in short.epoch(1, rank) for m in step.micro_batches] == [8] * 8 + [1]
    used = {i for rank in (0, 1) for step in kept.epoch(1, rank) for m in step.micro_batches for i in m}
    assert len(used) == 128 and kept.smallest_micro_batch == 8 and short.smallest_micro_batch == 1
