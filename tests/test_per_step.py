"""What happens after an optimizer step (#37): the task's per-step hook `after_step(model, step, progress)` runs once
per optimizer step that was taken, on every rank, and nowhere else (not per micro-batch, not in the start-up checks,
not in evaluation, not for a skipped step); model EMA (`--model-ema`) is a plain EMA of the weights' history, on
the device without host syncs, evaluated beside the weights, checkpointed and resumed bit-identically under DDP and
FSDP (at another world size too), and FSDP's EMA is DDP's."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from multiproc import REPO, full_state, launch, preempted
from step_tasks import hook_calls

from ddp_tricks.storage import checkpoint

TASK = ["--task", "tests/step_tasks.py:Recording", "--no-progress", "--log-interval", "5"]
TIMING = {"epoch_seconds", "samples_per_second"}


def _env(**extra) -> dict:
    return dict(os.environ) | {k: str(v) for k, v in extra.items()}


def _rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def _last(run_dir) -> dict:
    """The run's last checkpoint, whole (a sharded one's slices joined as tools/export.py joins them)."""
    if (run_dir / "last.pt").exists():
        return torch.load(run_dir / "last.pt", weights_only=True)
    whole = full_state(run_dir / "last.dcp")
    state = checkpoint.load(run_dir / "last.dcp", "fsdp")
    ema = state["ema"] and {"weights": whole["ema"], "updates": state["ema"]["updates"]}
    return {"model": whole["model"], "ema": ema, "global_step": state["global_step"], "epoch": state["epoch"]}


# ---------------------------------------------------------------- the hook: once per optimizer step taken


CASES = {  # (processes: None is plain `python run.py`, flags): steps per epoch of the digits' 1438 samples
    "one process": (None, ["-b", "32"]),
    "2 ranks": (2, ["-b", "32"]),
    "2 ranks, accumulation": (2, ["-b", "16", "--accum-steps", "2"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, flags", CASES.values(), ids=CASES.keys())
def test_the_hook_runs_once_per_optimizer_step_on_every_rank(nproc, flags, tmp_path):
    """Break: call the hook per micro-batch (inside the accumulation loop): the counts differ."""
    log = tmp_path / "hook"
    result = launch([*TASK, *flags, "-e", "2", "--runs-dir", str(tmp_path), "-n", "r"], nproc, env=_env(HOOK_LOG=log))
    assert result.returncode == 0, result.stderr[-3000:]
    total = _last(tmp_path / "r")["global_step"]
    assert total == 2 * (45 if nproc is None else 23)  # ceil(1438 / 32) or / 64 steps per epoch
    for rank in range(nproc or 1):
        calls = hook_calls(log, rank)
        assert [c["step"] for c in calls] == list(range(1, total + 1)), rank  # not in the checks, not in evaluation
        assert [c["progress"] for c in calls] == [k / total for k in range(1, total + 1)]
        assert all(c["training"] and not c["grad"] for c in calls)  # after the step: train mode, under no_grad


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_traced_run_calls_the_hook_once_per_trace_step_on_every_rank(tmp_path):
    """Every rank takes part in a traced step, also one with no micro-batch in it (doubling.csv's first steps, of 32
    samples, are one micro-batch at -b 32: one rank has none): each calls the hook. Break: call it only where the
    rank ran a micro-batch."""
    log = tmp_path / "hook"
    trace = ["--batch-trace", str(REPO / "examples" / "traces" / "doubling.csv"), "-b", "32"]
    result = launch([*TASK, *trace, "-e", "1", "--runs-dir", str(tmp_path), "-n", "t"], env=_env(HOOK_LOG=log))
    assert result.returncode == 0, result.stderr[-3000:]
    total = _last(tmp_path / "t")["global_step"]
    for rank in (0, 1):
        calls = hook_calls(log, rank)
        assert [c["step"] for c in calls] == list(range(1, total + 1)), rank
        progress = [c["progress"] for c in calls]
        assert progress == sorted(progress) and progress[-1] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_skipped_step_skips_the_hook_and_the_ema_on_every_rank(tmp_path):
    """--on-nonfinite skip: a step whose loss is NaN (a poisoned sample's) is skipped on every rank, and so are the
    hook and the EMA update. Break: call after_optimizer_step in the skip branch too."""
    log = tmp_path / "hook"
    argv = [*TASK, "-b", "32", "-e", "1", "--on-nonfinite", "skip", "--model-ema", "0.9"]
    result = launch([*argv, "--runs-dir", str(tmp_path), "-n", "s"], env=_env(HOOK_LOG=log, POISON=100))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["skipped_steps"] for row in _rows(tmp_path / "s")] == ["1"]
    last = _last(tmp_path / "s")
    steps = [[c["step"] for c in hook_calls(log, rank)] for rank in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == last["global_step"] - 1 == 22
    assert steps[0] == sorted(set(steps[0])) and set(steps[0]) < set(range(1, 24))  # one step missing, the others once
    assert last["ema"]["updates"] == 22


def test_a_step_the_fp16_scaler_skips_skips_the_hook_and_the_ema():
    """The loop in one process, fp16 on the CPU with a scale that overflows every step (as test_host_syncs): the
    scaler skips all, so neither the hook nor the EMA runs. Break: optimizer_step returns True for a skipped step."""
    from test_host_syncs import overflowing, syncs_per_step, toy

    from ddp_tricks.training.ema import ModelEma

    calls = []
    t = overflowing(toy(amp="fp16"))
    t.task.after_step = lambda model, step, progress: calls.append(step)
    t.ema = ModelEma(t.model, 0.9)
    before = {k: v.clone() for k, v in t.ema.weights.items()}
    syncs_per_step(t)
    assert t.progress.skipped_steps == t.progress.global_step > 0 and calls == [] and t.ema.updates == 0
    assert all(torch.equal(before[k], v) for k, v in t.ema.weights.items())
    t = toy(amp="fp16")  # the same with a scale that fits: every step calls both
    t.task.after_step = lambda model, step, progress: calls.append(step)
    t.ema = ModelEma(t.model, 0.9)
    syncs_per_step(t)
    assert calls == list(range(1, t.progress.global_step + 1)) and t.ema.updates == t.progress.global_step


def test_an_ema_step_makes_no_host_sync_and_neither_does_calling_the_hook():
    """Break: read the decay from a device tensor, or compute the warmup on the device and read it back."""
    from test_host_syncs import STEPS, syncs_per_step, toy

    from ddp_tricks.training.ema import ModelEma

    t = toy()
    t.ema = ModelEma(t.model, 0.999, warmup=True)
    t.task.after_step = lambda model, step, progress: None
    assert syncs_per_step(t) == [[]] * (STEPS - 1)
    assert t.ema.updates == STEPS


# ---------------------------------------------------------------- model EMA: the EMA of the weights' history


def plain_ema(history: list[dict], decay: float, warmup: bool) -> dict:
    """The EMA written out: e_0 = w_0; after step k (1-based), e_k = d_k e_{k-1} + (1 - d_k) w_k with d_k = decay, or
    min(decay, k / (9 + k)) with warmup; integer tensors copied. In float64."""
    ema = {k: v.double() if v.is_floating_point() else v.clone() for k, v in history[0].items()}
    for k, weights in enumerate(history[1:], start=1):
        d = min(decay, k / (9 + k)) if warmup else decay
        for name, value in weights.items():
            ema[name] = d * ema[name] + (1 - d) * value.double() if value.is_floating_point() else value.clone()
    return ema


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ema_equals_a_plain_ema_over_the_weights_history(tmp_path):
    """2 ranks with accumulation, warmup of the decay: the checkpoint's EMA against the EMA computed here from the
    weights after every step (saved by the hook on rank 0, with the initial ones) to 1e-6; the last row's val_ema_*
    are this EMA's evaluation, written here. Break: lerp with weight `decay` instead of 1 - decay, or count updates
    from 1: off by far more; evaluate without swapping the EMA in: val_ema_* are the weights'."""
    folder = tmp_path / "history"
    argv = [*TASK, "-b", "16", "--accum-steps", "2", "-e", "1", "--model-ema", "0.95", "--model-ema-warmup"]
    result = launch([*argv, "--runs-dir", str(tmp_path), "-n", "e"], env=_env(HOOK_WEIGHTS=folder))
    assert result.returncode == 0, result.stderr[-3000:]
    last = _last(tmp_path / "e")
    history = [torch.load(folder / f"step-{k}.pt", weights_only=True) for k in range(last["global_step"] + 1)]
    expected = plain_ema(history, 0.95, warmup=True)
    ema = last["ema"]["weights"]
    assert ema.keys() == expected.keys() and last["ema"]["updates"] == last["global_step"] == 23
    worst = max((ema[k].double() - expected[k]).abs().max().item() for k in ema)
    assert worst <= 1e-6, worst
    assert not all(torch.equal(ema[k], last["model"][k]) for k in ema)  # an EMA, not the weights
    row = _rows(tmp_path / "e")[-1]
    assert (float(row["val_ema_loss"]), float(row["val_ema_acc"])) == pytest.approx(evaluated(ema), rel=1e-5)
    assert (float(row["val_loss"]), float(row["val_acc"])) == pytest.approx(evaluated(last["model"]), rel=1e-5)


def evaluated(weights: dict) -> tuple[float, float]:
    """The built-in model with `weights`, evaluated here in one process on the whole validation set: (mean
    cross-entropy, accuracy)."""
    import torch.nn.functional as F

    from ddp_tricks import models
    from ddp_tricks.data import images

    _, val = images.digits()
    model = models.build("toy", 1, 10)
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model.eval()(val.inputs)
    return F.cross_entropy(logits, val.targets).item(), (logits.argmax(1) == val.targets).double().mean().item()


# ---------------------------------------------------------------- model EMA: checkpoints, resume, FSDP

EMA = [*TASK, "-b", "16", "-e", "2", "--model-ema", "0.9", "--model-ema-warmup", "--base-lr", "0.02"]
STRATEGIES = {"ddp": [], "fsdp": ["--strategy", "fsdp"]}
TOTAL = 90  # 2 epochs of ceil(1438 / 32) steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The EMA run of each strategy to its end, on 2 ranks, without a stop."""
    runs = tmp_path_factory.mktemp("ema")
    for strategy, flags in STRATEGIES.items():
        result = launch([*EMA, *flags, "--runs-dir", str(runs), "-n", strategy])
        assert result.returncode == 0, result.stderr[-3000:]
    return runs


def _same_state(a: dict, b: dict) -> None:
    for part in ("model", "ema"):
        x, y = (a[part], b[part]) if part == "model" else (a[part]["weights"], b[part]["weights"])
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), part


def _preempt(argv, run_dir, log, monkeypatch) -> dict:
    """run.py ARGV on 2 ranks, SIGTERM once rank 0's hook has seen 30 steps; the checkpoint it wrote (read before
    anything resumes from it)."""
    monkeypatch.setenv("HOOK_LOG", str(log))
    out, err = preempted(argv, run_dir, ready=lambda: len(hook_calls(log, 0)) >= 30)
    assert "preempted at epoch" in out or "preempted after epoch" in out, (out + err)[-3000:]
    state = _last(run_dir)
    assert 30 <= state["global_step"] < TOTAL
    assert state["ema"] is None or state["ema"]["updates"] == state["global_step"]
    return state


def _assert_resumed(log, saved: dict) -> None:
    """The resumed process started after the checkpoint's step and took the steps it lacked, each once, on both
    ranks: a fresh start (or a second pass over steps already taken) would call the hook from step 1."""
    for rank in (0, 1):
        assert [c["step"] for c in hook_calls(log, rank)] == list(range(saved["global_step"] + 1, TOTAL + 1)), rank


@pytest.mark.xdist_group("ema-uninterrupted")  # on one worker: the module's shared runs are made once
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_and_resume_of_an_ema_run_are_bit_identical(strategy, uninterrupted, tmp_path, monkeypatch):
    """Mid-epoch SIGTERM, then --resume auto: every metrics row (val_ema_* too), the weights and the EMA equal the
    uninterrupted run's bit for bit. Under FSDP the same checkpoint also resumes on one process (another world size:
    DCP cuts the EMA's slices anew), and its EMA goes on from the saved one. Break: resume the EMA from the
    resumed weights instead of the checkpoint's EMA: it differs."""
    argv = [*EMA, *STRATEGIES[strategy], "--runs-dir", str(tmp_path), "-n", "p"]
    saved = _preempt(argv, tmp_path / "p", tmp_path / "before", monkeypatch)
    if strategy == "fsdp":
        import shutil

        shutil.copytree(tmp_path / "p", tmp_path / "one" / "p", symlinks=True)
    monkeypatch.setenv("HOOK_LOG", str(tmp_path / "after"))
    resumed = launch([*argv, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_resumed(tmp_path / "after", saved)
    assert _rows(tmp_path / "p") == _rows(uninterrupted / strategy)
    _same_state(_last(tmp_path / "p"), _last(uninterrupted / strategy))
    if strategy == "fsdp":
        monkeypatch.setenv("HOOK_LOG", str(tmp_path / "alone"))
        alone = launch([*EMA, "--strategy", "fsdp", "--runs-dir", str(tmp_path / "one"), "-n", "p", "--resume", "auto"],
                       nproc=None)  # fmt: skip
        assert alone.returncode == 0, alone.stderr[-3000:]
        calls = [c["step"] for c in hook_calls(tmp_path / "alone", 0)]
        assert calls == list(range(saved["global_step"] + 1, TOTAL + 1))
        end, reference = _last(tmp_path / "one" / "p"), _last(uninterrupted / strategy)
        assert end["ema"]["updates"] == TOTAL
        params = [k for k in reference["model"] if "running" not in k and "num_batches" not in k]
        worst = max((end["ema"]["weights"][k] - reference["ema"]["weights"][k]).abs().max().item() for k in params)
        assert worst < 1e-4, worst  # the same EMA up to the order of sums (1 process sums the 2 ranks' gradients)


@pytest.mark.xdist_group("ema-uninterrupted")  # on one worker: the module's shared runs are made once
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_s_ema_is_ddp_s(uninterrupted):
    """The EMA kept on FSDP's shards (each rank its slices, no collective) equals DDP's whole one, parameters and
    BatchNorm's statistics alike (rank 0's: both save rank 0's buffers), and FSDP evaluates it as it is (the head
    is the root's: tests/step_tasks.py's shard_units). Break: lerp only where the rank is 0 (`if rank == 0` around
    the lerp): rank 1's slices stay at the start."""
    ddp, fsdp = _last(uninterrupted / "ddp"), _last(uninterrupted / "fsdp")
    assert ddp["ema"]["weights"].keys() == fsdp["ema"]["weights"].keys()
    worst = max((ddp["ema"]["weights"][k].double() - fsdp["ema"]["weights"][k].double()).abs().max().item()
                for k in ddp["ema"]["weights"])  # fmt: skip
    assert worst <= 1e-5, worst
    assert ddp["ema"]["updates"] == fsdp["ema"]["updates"] == TOTAL
    last = _rows(uninterrupted / "fsdp")[-1]  # FSDP's evaluation of its EMA: swapped into the shards it gathers
    assert (float(last["val_ema_loss"]), float(last["val_ema_acc"])) == pytest.approx(
        evaluated(fsdp["ema"]["weights"]), rel=1e-5
    )


# ---------------------------------------------------------------- the teacher-student example: BYOL

BYOL = ["--task", "examples/byol.py:BYOL", "--views", "fixed", "--optimizer", "lars", "--bn-bias-separately",
        "--base-lr", "1", "-b", "32", "-e", "1", "--wd", "1e-4", "--no-progress"]  # fmt: skip


def test_byol_s_hook_moves_the_teacher_by_the_cosine_tau():
    """BYOL's after_step: teacher = tau teacher + (1 - tau) student, tau = 1 - (1 - --tau)(cos(pi progress) + 1) / 2,
    written out here; the student is left as it is. Break: swap teacher and student in the lerp."""
    import math

    from ddp_tricks import cli

    flags, task_class = cli.parse([*BYOL, "--tau", "0.9"])
    task = task_class(flags)
    task.datasets()
    model = task.model()
    teacher, student = model.student_and_teacher()
    with torch.no_grad():
        for p in student:
            p.add_(torch.randn_like(p))
    before = [p.clone() for p in teacher], [p.clone() for p in student]
    task.after_step(model, 7, 0.3)
    tau = 1 - (1 - 0.9) * (math.cos(math.pi * 0.3) + 1) / 2
    for new, old, s in zip(teacher, *before):
        assert torch.allclose(new, tau * old + (1 - tau) * s, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(student, before[1]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_byol_trains_on_2_ranks_and_fsdp_s_teacher_is_ddp_s(tmp_path):
    """The teacher-student example under torchrun (LARS, bn/bias apart), under DDP and under FSDP, where the hook
    moves each rank's slices of the teacher: both end with the same teacher (1e-5), which has moved from its start
    and is not the student. Break: give the hook the wrapped model (DDP's) instead of the unwrapped one."""
    for strategy in ("ddp", "fsdp"):
        result = launch([*BYOL, "--strategy", strategy, "--runs-dir", str(tmp_path), "-n", strategy])
        assert result.returncode == 0, result.stderr[-3000:]
        probe = float(_rows(tmp_path / strategy)[-1]["val_probe_acc"])
        assert 0.5 < probe <= 1.0, probe
    ddp, fsdp = _last(tmp_path / "ddp")["model"], _last(tmp_path / "fsdp")["model"]
    for name in (k for k in ddp if k.startswith("teacher_") and "running" not in k and "num_batches" not in k):
        assert torch.allclose(ddp[name], fsdp[name], atol=1e-5), name
        student = ddp[name.removeprefix("teacher_")]
        assert not torch.equal(ddp[name], student), name


# ---------------------------------------------------------------- a family we do not ship: DINO's center

DINO = ["--task", "tests/hook_tasks.py:RecordingDino", "--optimizer", "sgd", "-l", "0.05", "-b", "16", "-e", "2",
        "--no-progress", "--log-interval", "5"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dino_task_written_from_the_docs_keeps_its_center_under_ddp_fsdp_and_a_resume(tmp_path, monkeypatch):
    """tests/hook_tasks.py (a teacher and a center kept by the hook, the center the task's own state, summed in loss()
    inside training steps only and gathered in the hook) on 2 ranks: FSDP ends where DDP does; SIGTERM + resume
    is bit-identical, center included, and resumed from the checkpoint's step. Break: leave the task's state out
    of the checkpoint (the center restarts at zero on resume), or let in_training_step() be true everywhere (the
    checks' and validation batches move the center)."""
    for strategy in ("ddp", "fsdp"):
        result = launch([*DINO, "--strategy", strategy, "--runs-dir", str(tmp_path), "-n", strategy])
        assert result.returncode == 0, result.stderr[-3000:]
    ddp, fsdp = (torch.load(tmp_path / "ddp" / "last.pt", weights_only=True), _last(tmp_path / "fsdp"))
    fsdp_task = checkpoint.load(tmp_path / "fsdp" / "last.dcp", "fsdp")["task"]
    assert torch.allclose(ddp["task"]["center"], fsdp_task["center"], atol=1e-5)
    assert ddp["task"]["center"].abs().sum() > 0
    assert all(torch.allclose(ddp["model"][k], fsdp["model"][k], atol=1e-5) for k in ddp["model"])
    argv = [*DINO, "--runs-dir", str(tmp_path), "-n", "p"]
    saved = _preempt(argv, tmp_path / "p", tmp_path / "before", monkeypatch)
    monkeypatch.setenv("HOOK_LOG", str(tmp_path / "after"))
    resumed = launch([*argv, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_resumed(tmp_path / "after", saved)
    assert _rows(tmp_path / "p") == _rows(tmp_path / "ddp")
    end = torch.load(tmp_path / "p" / "last.pt", weights_only=True)
    assert torch.equal(end["task"]["center"], ddp["task"]["center"])
    assert all(torch.equal(end["model"][k], ddp["model"][k]) for k in ddp["model"])


def _swap_on_shards(rank, world_size):
    """A sharded model whose root holds parameters (FSDP keeps them gathered after a forward without backward):
    its outputs before, inside and after the EMA's swapped_in, and the whole model's with each set of weights."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_tricks.shards import local
    from ddp_tricks.training.ema import ModelEma

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    whole = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)  # the root: model[2]'s parameters
    ema = ModelEma(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            local(p).add_(1.0)  # the weights move on: the EMA (still the start) differs from them
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model.eval()
    before = model(x).detach()  # the root's parameters stay gathered
    with ema.swapped_in(model):
        inside = model(x).detach()
    after = model(x).detach()
    with torch.no_grad():
        start = whole(x)
        for p in whole.parameters():
            p.add_(1.0)
        moved = whole(x)
    return before, inside, after, start, moved


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_ema_swapped_into_fsdp_shards_is_what_the_next_forwards_gather():
    """Inside swapped_in a sharded model computes with the EMA's weights, and after it with its own again, also where
    the root holds parameters that FSDP keeps gathered between forwards. Break: drop the _free_gathered calls: the
    forward inside, or the one after, uses the gathered weights of the other set."""
    from multiproc import run_ranks

    before, inside, after, start, moved = run_ranks(_swap_on_shards, 2, timeout=60)[0]
    assert torch.allclose(before, moved, atol=1e-6) and torch.allclose(after, moved, atol=1e-6)
    assert torch.allclose(inside, start, atol=1e-6)


@pytest.mark.xdist_group("ema-uninterrupted")  # on one worker: the module's shared runs are made once
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_best_pt_and_export_say_which_weights_they_hold(uninterrupted, tmp_path):
    """Every checkpoint says what its weights are; tools/export.py --weights ema writes the EMA's weights under
    'model' and says so. Break: export the trained weights for --weights ema."""
    import importlib.util

    best = torch.load(uninterrupted / "ddp" / "best.pt", weights_only=True)
    assert best["weights"]["model"] == "the trained weights"
    assert best["weights"]["ema"] == "the EMA of the weights, decay 0.9 with warmup"
    assert best["weights"]["best"] == "best.pt is the epoch with the best val_loss, that of the trained weights"
    sharded_best = torch.load(uninterrupted / "fsdp" / "best.pt", weights_only=True)
    assert sharded_best["ema"]["weights"].keys() == sharded_best["model"].keys()
    spec = importlib.util.spec_from_file_location("export", REPO / "tools" / "export.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    last = _last(uninterrupted / "fsdp")
    assert not torch.equal(last["ema"]["weights"]["head.weight"], last["model"]["head.weight"])  # two sets
    for which in ("trained", "ema"):
        out = tmp_path / f"{which}.pt"
        assert export.main([str(uninterrupted / "fsdp" / "last.dcp"), "-o", str(out), "--weights", which]) == 0
        written = torch.load(out, weights_only=True)
        expected = last["ema"]["weights"] if which == "ema" else last["model"]
        said = "the EMA of the weights, decay 0.9 with warmup" if which == "ema" else "the trained weights"
        assert written["weights"] == said
        assert all(torch.equal(written["model"][k], expected[k]) for k in expected)


def test_monitoring_the_ema_picks_best_pt_by_the_ema_s_metric(tmp_path):
    """--monitor-metric ema_acc: best.pt is the epoch whose val_ema_acc is highest, and says so. Break: monitor
    val_acc whatever the flag says."""
    flags = ["--model-ema", "0.9", "--model-ema-warmup", "--monitor-metric", "ema_acc", "-e", "3", "-b", "128",
             "--no-progress", "--runs-dir", str(tmp_path), "-n", "m"]  # fmt: skip
    import run

    assert run.main(flags) == 0
    rows = _rows(tmp_path / "m")
    best = torch.load(tmp_path / "m" / "best.pt", weights_only=True)
    accs = [float(r["val_ema_acc"]) for r in rows]
    assert best["best"]["metric"] == "val_ema_acc" and best["epoch"] == 1 + accs.index(max(accs))
    assert best["weights"]["best"] == "best.pt is the epoch with the best val_ema_acc, that of the EMA's weights"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_compile_the_hook_and_the_ema_see_the_unwrapped_model(tmp_path, monkeypatch):
    """--compile (one process, one training graph: 4 steps of 359): the hook runs once per step with the model
    torch.compile wraps, and the EMA's entries are that model's (no `_orig_mod.` prefix). Break: update the EMA
    from t.model (the compiled wrapper), whose entries are named otherwise."""
    import run

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # in this process: no pool of compile workers
    monkeypatch.setenv("HOOK_LOG", str(tmp_path / "hook"))
    flags = [*TASK, "--compile", "-b", "359", "--drop-last", "--model-ema", "0.9", "-e", "1"]
    assert run.main([*flags, "--runs-dir", str(tmp_path), "-n", "c"]) == 0
    last = _last(tmp_path / "c")
    assert (
        [c["step"] for c in hook_calls(tmp_path / "hook", 0)] == [1, 2, 3, 4] == list(range(1, last["global_step"] + 1))
    )
    assert last["ema"]["updates"] == 4 and last["ema"]["weights"].keys() == last["model"].keys()
    assert not any(k.startswith("_orig_mod") for k in last["ema"]["weights"])
