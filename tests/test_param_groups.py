"""Parameter groups from the task (#37): `param_groups(model)` gives LR multipliers and weight decay per group. Every
optimizer honours them (LARS/LAMB with bn/bias apart, --lars-wrap, Lookahead), the schedules keep each group at its
multiplier x the schedule (warmup, cosine to --end-lr, plateau cuts, a resumed schedule, --plot-lr), under DDP and
FSDP; a group that names a parameter twice, or none that names one, is one line at start."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import run
from ddp_tricks.errors import UserError
from ddp_tricks.optim import build as optimizers
from ddp_tricks.schedules import schedule
from ddp_tricks.training import seam


def copy_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _groups(net):
    """The body at 0.1x with weight decay 0.01, the head at 1x without: as the task's param_groups() says them."""
    return seam.param_groups(_Task(), net)


class _Task:
    def param_groups(self, model):
        return [
            {"params": [*model[0].parameters(), *model[1].parameters()], "lr_mult": 0.1, "weight_decay": 0.01,
             "name": "body"},
            {"params": model[3].parameters(), "lr_mult": 1.0, "weight_decay": 0.0, "name": "head"},
        ]  # fmt: skip


# ---------------------------------------------------------------- mistakes: one line


def _refused(groups, net=None) -> str:
    net = net or _net()
    task = type("T", (), {"param_groups": lambda self, model: groups(model)})()
    with pytest.raises(UserError) as error:
        seam.param_groups(task, net)
    return str(error.value)


def test_a_parameter_named_twice_or_left_out_or_not_the_model_s_is_one_line():
    """Break: drop the check for a parameter named twice."""
    twice = _refused(lambda m: [{"params": m.parameters()}, {"params": m[3].parameters(), "name": "head"}])
    assert "'head', names the parameter '3.weight' that 'group 0' names too: give each parameter one group" in twice
    missing = _refused(lambda m: [{"params": m[0].parameters()}])
    assert "leaves out the trainable parameter(s) '1.weight', '1.bias', '3.weight', '3.bias'" in missing
    stranger = _refused(lambda m: [{"params": [*m.parameters(), nn.Parameter(torch.zeros(1))]}])
    assert "which is not a parameter of the model it was given" in stranger
    assert "has the key 'lr'" in _refused(lambda m: [{"params": m.parameters(), "lr": 0.1}])
    assert "lr_mult must be a number > 0, got 0" in _refused(lambda m: [{"params": m.parameters(), "lr_mult": 0}])
    assert "weight_decay must be a number >= 0" in _refused(lambda m: [{"params": m.parameters(), "weight_decay": -1}])
    assert "gave generator, not a list of groups" in _refused(lambda m: m.parameters())


def test_frozen_parameters_may_be_left_out_or_named():
    """Break: keep the frozen parameters a group names: the groups differ."""
    net = _net()
    net[0].requires_grad_(False)
    task = type("T", (), {"param_groups": lambda self, m: [{"params": m.parameters()}]})()
    assert seam.param_groups(task, net) == ({"params": ["1.weight", "1.bias", "3.weight", "3.bias"], "name": "group 0",
                                             "lr_mult": 1.0},)  # fmt: skip
    task = type("T", (), {"param_groups": lambda self, m: [{"params": m[1:].parameters()}]})()
    assert len(seam.param_groups(task, net)[0]["params"]) == 4


def test_a_task_whose_groups_name_a_parameter_twice_ends_at_start_in_one_line(tmp_path, capsys):
    """run.py in one process: exit 2, one line, no run folder. Break: drop the check for a parameter named twice."""
    argv = ["--task", "tests/step_tasks.py:NamedTwice", "--runs-dir", str(tmp_path), "--no-progress"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names the parameter 'head.weight' that 'group 0' names too" in err[0], err
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- every optimizer honours them

OPTIMIZERS = {  # name -> build()'s options
    "sgd": {"name": "sgd", "momentum": 0.9},
    "adamw": {"name": "adamw"},
    "lars, bn/bias apart": {"name": "lars", "bn_bias_separately": True, "trust_coefficient": 0.02},
    "lamb, bn/bias apart": {"name": "lamb", "bn_bias_separately": True},
    "LARSWrapper(SGD)": {"name": "sgd", "lars_wrap": True, "trust_coefficient": 0.02},
    "Lookahead(LARS)": {"name": "lars", "lookahead": True, "lookahead_k": 2},
}


@pytest.mark.parametrize("options", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_every_optimizer_steps_each_group_at_its_multiplier_and_weight_decay(options):
    """Each group of a run's optimizer moves as the same optimizer over that group alone at LR x multiplier and the
    group's weight decay (these optimizers update each tensor from its own gradient and state). Break: build the
    groups without `lr` (the run's LR for all) or without their weight decay: the body moves 10x too far."""
    options = dict(options)
    name, lr = options.pop("name"), 0.5
    net = _net()
    optimizer = optimizers.build(net, name, lr=lr, weight_decay=0.1, groups=_groups(net), **options)
    alone = {}  # each group's modules copied, with the same optimizer over them alone
    for label, mult, wd, modules in (("body", 0.1, 0.01, [net[0], net[1]]), ("head", 1.0, 0.0, [net[3]])):
        copy = nn.Sequential(*(copy_module(m) for m in modules))
        other = optimizers.build(copy, name, lr=lr * mult, weight_decay=wd, **options)
        alone[label] = (list(copy.parameters()), other, [p for m in modules for p in m.parameters()])
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for copies, _, params in alone.values():
            for c, p in zip(copies, params):
                c.grad = p.grad.clone()
        optimizer.step()
        for _, other, _ in alone.values():
            other.step()
    for label, (copies, _, params) in alone.items():
        worst = max((c - p).abs().max().item() for c, p in zip(copies, params))
        assert worst <= 1e-6, (label, worst)


# ---------------------------------------------------------------- the schedules keep every group at its multiplier

LR, END_LR, STEPS_PER_EPOCH = 0.1, 0.01, 23  # digits at -b 32 on 2 ranks: ceil(1438 / 64) steps per epoch


def warmup_cosine(k: int, total: int, warmup: int, base: float, end: float) -> float:
    """The LR of step k (0-based) as docs/tricks.md writes it: linear warmup from base / warmup, then cosine to end."""
    if k < warmup:
        return base * (k + 1) / warmup
    return end + (base - end) * (1 + math.cos(math.pi * (k - warmup + 1) / (total - warmup))) / 2


def _train_finetune(rank, world_size, strategy):
    """run.py's build of tests/step_tasks.py:Finetune (body 0.1x, head 1x) on `world_size` ranks, plain SGD (no
    momentum, no weight decay: a step moves each weight by -LR x its gradient), 1 warmup epoch then cosine to
    --end-lr over 2 epochs. For every step and group on this rank: (the group's LR, the LR its update shows:
    -<dw, g> / <g, g> over the group's tensors, this rank's slices under FSDP)."""
    from tiny import CPU

    from ddp_tricks import cli
    from ddp_tricks.data import loaders
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.shards import local
    from ddp_tricks.training import loop, preflight

    schedule_flags = ["--warmup-epochs", "1", "--scheduler", "cosine", "--end-lr", str(END_LR)]
    sgd = ["--optimizer", "sgd", "--momentum", "0", "--wd", "0", "-l", str(LR)]
    flags, task_class = cli.parse(
        ["--task", "tests/step_tasks.py:Finetune", *sgd, *schedule_flags, "-b", "32", "-e", "2", "--strategy", strategy]
    )
    task = task_class(flags)
    train_set, val_set = task.datasets()
    model = task.model()
    setup = preflight.Setup(world_size, **cli.check_options(flags))
    plan, found = preflight.check(
        task, model, train_set, setup, lambda equal: run.make_plan(flags, len(train_set), world_size, None, equal)
    )
    dist = Dist(rank, world_size, rank, CPU, "gloo")
    t = run.build_training(flags, task, model, found, plan, dist)
    loader, _ = loaders.both(train_set, val_set, dist, found.collate, **cli.loader_options(flags))
    seen, before = [], {}

    def pre(optimizer, *_):
        for group in optimizer.param_groups:
            before[group["name"]] = [(local(p).clone(), local(p.grad).clone()) for p in group["params"]]

    def post(optimizer, *_):
        step = {}
        for group in optimizer.param_groups:
            moved = sum(((local(p) - w) * g).sum() for p, (w, g) in zip(group["params"], before[group["name"]]))
            norm = sum((g * g).sum() for _, g in before[group["name"]])
            step[group["name"]] = (group["lr"], (-moved / norm).item())
        seen.append(step)

    t.optimizer.register_step_pre_hook(pre)
    t.optimizer.register_step_post_hook(post)
    for epoch in (1, 2):
        steps = plan.epoch(epoch, rank)
        loop.train_one_epoch(t, steps, loader, loop.start_epoch(t, epoch, loader, steps, flags.seed))
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_group_s_effective_lr_is_its_multiplier_times_the_schedule(strategy):
    """Over 1 warmup epoch and a cosine decay to --end-lr, on 2 ranks: each group's LR, and the LR its update shows,
    is its multiplier x the schedule written out here, at every step (end_lr multiplied too). Break: leave end_lr
    unscaled in WarmupDecay.lr_at."""
    seen = run_ranks(_train_finetune, 2, strategy, timeout=240)[0]
    total = 2 * STEPS_PER_EPOCH
    assert len(seen) == total
    for k, step in enumerate(seen):
        for name, mult in (("backbone", 0.1), ("head", 1.0)):
            expected = warmup_cosine(k, total, STEPS_PER_EPOCH, mult * LR, mult * END_LR)
            lr, effective = step[name]
            assert lr == pytest.approx(expected, rel=1e-12), (k, name)
            assert effective == pytest.approx(expected, rel=1e-3), (k, name, effective)


def test_plateau_cuts_every_group_alike_and_a_resumed_schedule_keeps_the_multipliers():
    """ReduceLROnPlateau after warmup cuts each group by its factor (also at an LR below torch's eps, 1e-8, which it
    would leave uncut); a schedule saved mid-warmup and loaded again sets each group to multiplier x the schedule.
    Break: build the plateau with torch's default eps: the body's 1e-9 is not cut."""
    net = _net()
    base = 1e-8  # the body's LR 1e-9: a cut of 9e-10 is smaller than torch's eps
    optimizer = optimizers.build(net, "sgd", lr=base, groups=_groups(net))
    plateau = schedule.build(optimizer, total_steps=10, warmup_steps=2, kind="plateau", plateau_patience=0)
    for _ in range(2):
        optimizer.step()
        plateau.step()
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert lrs == pytest.approx([0.1 * base, base], rel=1e-12)
    plateau.epoch_end(1.0)
    plateau.epoch_end(2.0)  # worse: a cut
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01 * base, 0.1 * base], rel=1e-12)

    warm = schedule.build(optimizer, total_steps=10, warmup_steps=4, kind="cosine", end_lr=0.001)
    warm.step()
    saved = warm.state_dict()
    again = optimizers.build(_net(), "sgd", lr=0.5, groups=_groups(net))
    resumed = schedule.build(again, total_steps=10, warmup_steps=4, kind="cosine", end_lr=0.001)
    resumed.load_state_dict(saved)
    assert [g["lr"] for g in again.param_groups] == pytest.approx([0.1 * 0.5 * 2 / 4, 0.5 * 2 / 4], rel=1e-12)


def test_plot_lr_draws_each_group_at_its_multiplier(tmp_path):
    """--plot-lr of a task with parameter groups lists and draws every group's LR. Break: draw one probe group."""
    schedule_flags = ["--warmup-epochs", "1", "--scheduler", "cosine", "-e", "3", "--end-lr", "0.001", "-l", "0.2"]
    argv = [
        "--task",
        "tests/step_tasks.py:Finetune",
        "--plot-lr",
        *schedule_flags,
        "--runs-dir",
        str(tmp_path),
        "-n",
        "p",
    ]
    assert run.main(argv) == 0
    with open(tmp_path / "p" / "lr_schedule.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "lr_backbone (x0.1)", "lr_head (x1)"]
    total, warmup = len(rows), len(rows) // 3
    for k, row in enumerate(rows):
        assert float(row["lr_head (x1)"]) == pytest.approx(warmup_cosine(k, total, warmup, 0.2, 0.001), rel=1e-12)
        assert float(row["lr_backbone (x0.1)"]) == pytest.approx(
            warmup_cosine(k, total, warmup, 0.02, 0.0001), rel=1e-12
        )
    assert (tmp_path / "p" / "lr_schedule.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_parameter_groups_resumes_bit_identically(tmp_path):
    """One process, warmup + cosine over 2 epochs: stopped after epoch 1 and resumed, the run ends with the
    uninterrupted run's weights and optimizer groups (their LRs, multipliers and weight decay). Break: drop the
    groups' multipliers once the optimizer's state is loaded: the schedule sets the backbone to the run's LR."""
    flags = ["--task", "tests/step_tasks.py:Finetune", "--warmup-epochs", "1", "--scheduler", "cosine", "-b", "64",
             "--no-progress", "--runs-dir", str(tmp_path)]  # fmt: skip
    assert run.main([*flags, "-e", "2", "-n", "full"]) == 0
    assert run.main([*flags, "-e", "1", "-n", "part"]) == 0
    assert run.main([*flags, "-e", "2", "-n", "part", "--resume", "auto"]) == 0
    a, b = (torch.load(tmp_path / name / "last.pt", weights_only=True) for name in ("full", "part"))
    assert a["global_step"] == b["global_step"] == 2 * 23
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in b["optimizer"]["param_groups"]]
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in a["optimizer"]["param_groups"]]
    assert [(g["name"], g["lr_mult"], g["weight_decay"]) for g in groups] == [
        ("backbone", 0.1, 5e-4),
        ("head", 1.0, 0.0),
    ]
