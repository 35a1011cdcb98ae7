"""Variable batch size from a trace: parsing, epoch cutting, exact gradients against a single process on
1, 2 and 3 ranks (uneven splits, idle ranks), LR rules and AdaScale's gain by hand, run.py end to end."""

import csv
import math

import pytest
import tiny
import torch
from multiproc import REPO, launch, preempted, run_ranks
from resumed import assert_resumed, final_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import run
from ddp_tricks.data import images as image_data
from ddp_tricks.data import loaders as data
from ddp_tricks.distributed import trace_reduction
from ddp_tricks.plan import Plan, lr_factor
from ddp_tricks.schedules import schedule as schedulers
from ddp_tricks.traces import batch_trace
from ddp_tricks.traces import original_api as trace_api
from ddp_tricks.training import loop as engine


def test_trace_files_lists_and_ints(tmp_path):
    (tmp_path / "a.csv").write_text("step,batchsize\n0,32\n1,64\n\n2,64\n")
    (tmp_path / "b.csv").write_text("batchsize\n16\n")
    assert batch_trace.load_trace(tmp_path / "a.csv") == [32, 64, 64]
    assert batch_trace.load_trace(tmp_path / "b.csv") == [16]
    assert batch_trace.load_trace([8, 16]) == [8, 16] and batch_trace.load_trace(32) == [32]


@pytest.mark.parametrize(
    "text, message",
    [
        ("step,size\n0,32\n", "line 1: expected a header with a `batchsize` column"),
        ("step,batchsize\n0,32\n1,lots\n", "line 3 (step 1): '1,lots' has no integer batch size"),
        ("batchsize\n32\n\nlots\n", "line 4: 'lots' has no integer batch size"),
        ("step,batchsize\n", "has no rows"),
    ],
)
def test_malformed_traces_name_the_line(tmp_path, text, message):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(batch_trace.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        batch_trace.load_trace(tmp_path / "t.csv")


def test_batch_sizes_must_be_multiples_of_the_micro_batch():
    with pytest.raises(batch_trace.UserError, match="trace step 1: batch size 20 is not a positive multiple"):
        batch_trace.check_trace([16, 20], 8)


def test_too_short_a_trace_is_an_error_at_start_that_says_how_many_steps(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("batchsize\n" + "512\n" * 3)
    code = run.main(["--batch-trace", str(tmp_path / "t.csv"), "--epochs", "2", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "the trace has 3 steps but 2 epochs need 4" in err and "--trace-end repeat-last" in err


def test_an_epoch_ends_before_a_step_that_would_straddle_it():
    steps = batch_trace.epoch_steps(100, [40, 40, 40, 8], 0, seed=0, epoch=1, repeat_last=False)
    assert [len(idx) for _, idx in steps] == [40, 40]  # a third 40 would pass the end: left for the next epoch
    nxt = batch_trace.epoch_steps(100, [40, 40, 40, 8], 2, seed=0, epoch=2, repeat_last=False)
    assert [step for step, _ in nxt] == [2, 3]
    order = torch.cat([idx for _, idx in steps])
    assert len(set(order.tolist())) == 80  # no sample twice within an epoch


def test_micro_batches_are_dealt_round_robin():
    dealt = [batch_trace.deal(torch.arange(40), 8, 3, r) for r in range(3)]
    assert [[c[0].item() for c in d] for d in dealt] == [[0, 24], [8, 32], [16]]
    assert batch_trace.deal(torch.arange(8), 8, 3, 2) == []  # an idle rank


TRACE, MICRO = [24, 8, 40, 16], 8  # 3, 1, 5 and 2 micro-batches: uneven splits and idle ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def _traced_run(rank, world_size, trace, rule="none", lr=1.0, schedule=None, adascale=None, clip=0.0):
    """run.py's loop (engine.train_one_epoch) over one traced epoch: the weights after every step."""
    train_set, _ = image_data.digits()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    plan = Plan(len(train_set), world_size, MICRO, 1, 0, lr, 8, 4, 4, 0, tuple(trace), rule)
    steps = plan.epoch(1, rank)
    reduction = trace_reduction.TraceReduction(list(model.parameters()), MICRO, adascale)
    t = tiny.training(model, opt, schedule and schedule(opt), reduction=reduction,
                      clip_grad_norm=clip)  # fmt: skip
    history = []

    def record(t):
        history.append([p.detach().clone() for p in model.parameters()])
        return False

    engine.train_one_epoch(t, steps, tiny.loader_for(train_set, steps, rank), after_step=record)
    return history, steps, t


def _trace_on_ranks(rank, world_size):
    return _traced_run(rank, world_size, TRACE)[0]


def assert_each_step_matches_one_process(results, steps):
    """Ground truth, one process: w <- w - 1.0 * grad(mean cross-entropy over the step's B_i samples)."""
    train_set, _ = image_data.digits()
    model = _model()
    for step, (_, indices) in enumerate(steps):
        x, y = train_set.inputs[indices], train_set.targets[indices]
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
        for history in results:
            for ours, truth in zip(history[step], model.parameters()):
                assert (ours - truth).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_step_uses_the_exact_mean_gradient_of_its_global_batch(world_size):
    results = run_ranks(_trace_on_ranks, world_size)
    steps = batch_trace.epoch_steps(len(image_data.digits()[0]), TRACE, 0, 0, 1, False)
    assert_each_step_matches_one_process(results, steps)
    assert len(results[0]) == 4


def _clipped_trace_on_ranks(rank, world_size):
    return _traced_run(rank, world_size, TRACE, lr=1.0, clip=0.05)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_traced_step_clips_the_reduced_gradient(world_size):
    results = run_ranks(_clipped_trace_on_ranks, world_size)
    # Ground truth, one process: the mean gradient over the step's B_i samples, scaled to norm 0.05 if longer.
    train_set, _ = image_data.digits()
    model = _model()
    for step, (_, indices) in enumerate(batch_trace.epoch_steps(len(train_set), TRACE, 0, 0, 1, False)):
        model.zero_grad()
        nn.functional.cross_entropy(model(train_set.inputs[indices]), train_set.targets[indices]).backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad * min(1.0, 0.05 / (norm + 1e-6))
        for history in results:
            assert all((a - b).abs().max().item() <= 1e-6 for a, b in zip(history[step], model.parameters()))


def test_lr_rules_by_hand():
    assert lr_factor("none", 128, 32) == lr_factor("keep", 128, 32) == 1.0
    assert lr_factor("linear", 128, 32) == 4.0
    assert lr_factor("root", 128, 32) == lr_factor("sqrt", 128, 32) == 2.0


def test_the_schedule_keeps_the_reference_lr_and_the_step_uses_the_scaled_one():
    before = [p.detach().clone() for p in _model().parameters()]
    history, steps, t = _traced_run(0, 1, [32], rule="linear", lr=0.1)
    assert t.optimizer.param_groups[0]["lr"] == 0.1  # the reference LR, as the user's schedule set it
    train_set, _ = image_data.digits()
    idx = torch.tensor([i for micro in steps[0].micro_batches for i in micro])
    x, y = train_set.inputs[idx], train_set.targets[idx]
    ref = _model()
    nn.functional.cross_entropy(ref(x), y).backward()
    for p, b, r in zip(history[0], before, ref.parameters()):
        assert torch.allclose(p, b - 0.4 * r.grad, atol=1e-6)  # 0.1 x 32/8


def test_adascale_gain_on_a_case_with_known_variance():
    # Four micro-batch gradients around a mean of (2, 2): deviations (+-1, 0) and (0, +-1).
    gradients = [torch.tensor(v) for v in ([3.0, 2.0], [1.0, 2.0], [2.0, 3.0], [2.0, 1.0])]
    mean = sum(gradients) / 4
    sum_sq = sum(float(g @ g) for g in gradients)
    sigma2 = (sum_sq - 4 * float(mean @ mean)) / 3  # = 4/3: the deviations' squared norms (1 each) x 4 / 3
    mu2 = float(mean @ mean) - sigma2 / 4  # = 8 - 1/3
    ada = trace_reduction.AdaScale(theta=0.0)
    gain = ada.update(sum_sq, float(mean @ mean), 4)
    assert sigma2 == pytest.approx(4 / 3) and gain == pytest.approx((sigma2 + mu2) / (sigma2 / 4 + mu2))
    assert 1.0 < gain < 4.0
    assert trace_reduction.AdaScale().update(5.0, 5.0, 1) == 1.0  # S = 1: no estimate yet, gain 1, no division by 0
    assert ada.update(25.0, 25.0, 1) == 1.0  # S = 1 keeps the smoothed estimates: (s + m) / (s / 1 + m) = 1
    restored = trace_reduction.AdaScale()
    restored.load_state_dict(ada.state_dict())
    assert restored.gain(4) == pytest.approx(gain)


def _adascale_on_ranks(rank, world_size):
    ada = trace_reduction.AdaScale()
    gains = []
    original_update = ada.update

    def update(*args):
        gains.append(original_update(*args))
        return gains[-1]

    ada.update = update
    schedule = lambda opt: schedulers.Schedule(schedulers.WarmupDecay(opt, 0, 100, "cosine"))  # noqa: E731
    _, _, t = _traced_run(rank, world_size, [64, 8, 64], rule="adascale", lr=0.05, schedule=schedule, adascale=ada)
    return gains, t.schedule.per_step.last_epoch


class _AllReduces(TorchDispatchMode):
    """The dtype and length of every buffer a c10d all-reduce sends, as the dispatcher sees it (the collective still
    runs: nothing is replaced)."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.sent += [(t.dtype, t.numel()) for t in args[0]]
        return func(*args, **(kwargs or {}))


def _reduce_on_ranks(rank, world_size):
    """A traced step's end with AdaScale on: float32 and bfloat16 gradients, float64 squared norms 1e8 + 1 and 1e8."""
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)]
    grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1), dtype=torch.bfloat16)]
    sq_norms = torch.tensor(1e8 + 1 - rank, dtype=torch.float64)
    ada = trace_reduction.AdaScale()
    with _AllReduces() as seen:
        gain = trace_reduction.reduce_gradients(params, grads, sq_norms, ada, micro_batches=2)
    return seen.sent, [p.grad for p in params], (gain, ada.sigma2, ada.mu2)


@pytest.mark.slow
def test_a_traced_step_reduces_gradients_in_their_own_dtype_and_squared_norms_in_float64():
    """Each gradient dtype in a buffer of its own (float32 stays float32 on the wire: half the bytes of float64), and
    the squared norms in one float64 of their own, exact: 1e8 + 1 + 1e8 has no float32. Fails when the norms are
    concatenated with the gradients (torch.cat promotes the whole buffer to float64)."""
    for sent, grads, (gain, sigma2, mu2) in run_ranks(_reduce_on_ranks, 2):
        assert sent == [(torch.float32, 3), (torch.bfloat16, 4), (torch.float64, 1)]
        assert torch.equal(grads[0], torch.full((3,), 3.0)) and grads[1].dtype == torch.bfloat16
        assert torch.equal(grads[1], torch.full((2, 2), 30.0, dtype=torch.bfloat16))
        mean_sq = 3 * 3.0**2 + 4 * 30.0**2  # |the summed gradient|^2
        # (sum |g_j|^2 - S |g|^2) / (S - 1), S = 2; |g|^2 from float32 norms (4e-6 off): float32 sums would lose the 1
        assert sigma2 == pytest.approx((2e8 + 1) - 2 * mean_sq, abs=0.1)
        assert mu2 == 0.0 and gain == 2.0  # mu^2 = |g|^2 - sigma^2 / S < 0, clamped: gain = S


@pytest.mark.slow
def test_adascale_runs_on_two_ranks_with_the_same_gain_and_scale_invariant_progress():
    (gains0, progress0), (gains1, progress1) = run_ranks(_adascale_on_ranks, 2)
    assert gains0 == gains1 and gains0[0] > 1.0 and gains0[1] == pytest.approx(1.0)
    assert progress0 == pytest.approx(sum(gains0))  # the schedule advanced by r per step


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_py_trains_from_a_trace_and_resumes_it_exactly(tmp_path):
    trace = str(REPO / "examples" / "traces" / "doubling.csv")
    flags = [
        "--batch-trace",
        trace,
        "--batch-size",
        "16",
        "--batch-lr-rule",
        "adascale",  # its smoothed estimates must come back from the checkpoint too
        "--no-progress",
        "--runs-dir",
        str(tmp_path),
    ]
    full = launch([*flags, "--epochs", "4", "-n", "full"])
    assert full.returncode == 0, full.stderr[-3000:]
    part = launch([*flags, "--epochs", "2", "-n", "part"])
    assert part.returncode == 0, part.stderr[-3000:]
    saved = torch.load(tmp_path / "part" / "last.pt", weights_only=True)
    rest = launch([*flags, "--epochs", "4", "-n", "part", "--resume", "auto"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_resumed(rest.stdout, saved, final_step(tmp_path / "full"))  # broken on purpose: a traced run from scratch

    def rows(name):
        with open(tmp_path / name / "metrics.csv", newline="") as f:
            return [
                {k: v for k, v in r.items() if k not in ("epoch_seconds", "samples_per_second")}
                for r in csv.DictReader(f)
            ]

    assert rows("full") == rows("part") and [r["step"] for r in rows("full")] == ["44", "66", "77", "82"]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "part" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not math.isnan(float(rows("full")[-1]["val_loss"]))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_traced_run_with_fp16_and_clipping_resumes_mid_epoch_bit_identically(tmp_path):

    trace = str(REPO / "examples" / "traces" / "doubling.csv")
    flags = ["--batch-trace", trace, "--batch-size", "8", "--trace-end", "repeat-last", "--amp", "fp16",
             "--clip-grad-norm", "1.0", "--batch-lr-rule", "linear", "--epochs", "2", "--no-progress",
             "--runs-dir", str(tmp_path)]  # fmt: skip
    full = launch([*flags, "-n", "full"])
    assert full.returncode == 0, full.stderr[-3000:]
    out, err = preempted([*flags, "-n", "part", "--checkpoint-every-steps", "3"], tmp_path / "part" / "last.pt")
    assert "preempted at epoch 1" in out, (out + err)[-3000:]
    saved = torch.load(tmp_path / "part" / "last.pt", weights_only=True)
    assert saved["step_in_epoch"] > 0 and saved["scaler"] is not None  # mid-epoch, with the GradScaler's state
    rest = launch([*flags, "-n", "part", "--resume", "auto"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_resumed(rest.stdout, saved, final_step(tmp_path / "full"))

    def rows(name):
        with open(tmp_path / name / "metrics.csv", newline="") as f:
            return [{k: v for k, v in r.items() if k not in ("epoch_seconds", "samples_per_second")}
                    for r in csv.DictReader(f)]  # fmt: skip

    assert rows("full") == rows("part")
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "part" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the trace's real batch sizes are logged: each epoch's mean global batch, from the trace rows it used
    sizes = batch_trace.load_trace(trace)
    first = batch_trace.epoch_steps(1438, sizes, 0, 0, 1, True)
    second = batch_trace.epoch_steps(1438, sizes, len(first), 0, 2, True)
    expected = [sum(len(i) for _, i in steps) / len(steps) for steps in (first, second)]
    assert [float(r["global_batch"]) for r in rows("full")] == pytest.approx(expected)
    assert expected[1] > expected[0]


def _original_loop(rank, world_size, rule="none", stop_after=None, resume=None):
    """The original project's loop: a plain model, optimizer.step() after every backward."""
    train_set, _ = image_data.digits()
    model = _model()
    if resume is not None:
        model.load_state_dict(resume["model"])
    sampler = trace_api.CustomSampler(train_set, TRACE + [16] * 200, world_size, rank, MICRO, seed=0)
    cls = {
        "none": trace_api._TraceRuleOptimizer,
        "linear": trace_api.LinearRuleOptimizer,
        "adascale": trace_api.AdaScaleOptimizer,
    }[rule]
    opt = cls(torch.optim.SGD(model.parameters(), lr=1.0), sampler, ref_batchsize=8)
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
    loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=data._batch_as_is)
    history, updates = [], 0
    for epoch in range(resume["epoch"] if resume else 0, 2):
        opt.set_epoch(epoch)
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            if opt.step():
                updates += 1
                history.append([p.detach().clone() for p in model.parameters()])
                if stop_after is not None and updates == stop_after:
                    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}
    return history


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_original_api_gives_exact_gradients_with_placeholders(world_size):
    results = run_ranks(_original_loop, world_size)
    steps = batch_trace.epoch_steps(len(image_data.digits()[0]), TRACE + [16] * 200, 0, 0, 0, True)
    assert_each_step_matches_one_process(results, steps[:4])
    assert len(results[0]) == len(results[-1]) > 4


def test_original_api_state_dict_resumes_exactly_mid_epoch():
    full = _original_loop(0, 1, rule="adascale")
    # epoch 0 has 4 + 84 steps: 90 updates is 2 steps into epoch 1
    saved = _original_loop(0, 1, rule="adascale", stop_after=90)
    assert saved["epoch"] == 1
    rest = _original_loop(0, 1, rule="adascale", resume=saved)
    assert len(full) == 90 + len(rest)
    assert all(torch.equal(a, b) for a, b in zip(full[-1], rest[-1]))


def test_plot_lr_shows_the_trace_rule(tmp_path):
    trace = str(REPO / "examples" / "traces" / "doubling.csv")
    assert (
        run.main(
            [
                "--plot-lr",
                "--batch-trace",
                trace,
                "--batch-size",
                "16",
                "--batch-lr-rule",
                "linear",
                "--epochs",
                "5",
                "-n",
                "p",
                "--runs-dir",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    with open(tmp_path / "p" / "lr_schedule.csv", newline="") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f)]
    # 44 steps of 32, then 64, 128, 256, 512; reference batch = the first (32); LR 0.05 x B_i / 32
    assert len(lrs) == 84 and lrs[0] == pytest.approx(0.05) and lrs[44] == pytest.approx(0.1)
    assert lrs[-1] == pytest.approx(0.05 * 512 / 32)


COUNTS_IN_LOSS = """
import torch
import torch.distributed as dist
from task import Task


class CountsInLoss(Task):
    collectives = True

    def loss(self, outputs, targets):
        count = torch.tensor([float(len(targets))])
        if dist.is_initialized():  # in training: every rank must call it as often (the start-up check has no group)
            dist.all_reduce(count)
        return super().loss(outputs, targets)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_task_s_own_collectives_with_a_batch_trace_on_several_ranks_are_one_line_at_start(tmp_path):
    """`collectives = True` and --batch-trace on 2 ranks: doubling.csv's steps of 32 at -b 32 leave rank 1 without a
    micro-batch, so the loss's all_reduce would meet the trace's gradient reduction; refused at start, exit 2 on
    every rank. Broken on purpose: without the check (training/preflight.py) the job ends in a collective mismatch
    mid-run (rank 0 aborted, exit -6 and 1), which fails it."""
    (tmp_path / "counts.py").write_text(COUNTS_IN_LOSS)
    trace = str(REPO / "examples" / "traces" / "doubling.csv")
    argv = ["--task", f"{tmp_path / 'counts.py'}:CountsInLoss", "--batch-trace", trace, "-b", "32", "-e", "1",
            "--no-progress", "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    result = launch(argv)
    assert result.exitcodes == [2, 2], (result.exitcodes, result.stderr[-3000:])
    assert "(collectives = True), and a --batch-trace step gives the ranks different numbers" in result.stderr
