"""Every schedule's LR at chosen steps, against numbers computed by hand here."""

import argparse
import inspect
import math

import pytest
import torch

from ddp_tricks import plan
from ddp_tricks.schedules.curves import PolynomialWarmup, WarmupDecay
from lars import PolynomialWarmup as PolynomialWarmupFromLars


def optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs_used(scheduler, opt, steps):
    """The LR each optimizer step uses: read before the step, then advance the scheduler."""
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return used


def test_linear_warmup_trains_from_the_first_step():
    opt = optimizer(0.1)
    used = lrs_used(WarmupDecay(opt, warmup_steps=4, decay_steps=6), opt, 6)
    assert used == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def lrs_after_calls(scheduler, opt, calls):
    """The LR in the optimizer after s calls of scheduler.step(), for s = 0 .. calls."""
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(calls):
        opt.step()
        scheduler.step()
        seen.append(opt.param_groups[0]["lr"])
    return seen


def original_polynomial_warmup(s, base, decay_steps, warmup_steps, end_lr, power):
    """LARS-ImageNet-PyTorch's utils.PolynomialWarmup after s calls of step(), written out plainly."""
    if s < warmup_steps:
        return base * s / warmup_steps
    decay = decay_steps - warmup_steps
    return (base - end_lr) * (1 - min(s - warmup_steps, decay) / decay) ** power + end_lr


def test_polynomial_warmup_has_the_original_signature_and_defaults():
    assert PolynomialWarmupFromLars is PolynomialWarmup
    params = inspect.signature(PolynomialWarmup).parameters
    assert list(params) == ["optimizer", "decay_steps", "warmup_steps", "end_lr", "power", "last_epoch"]
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {"warmup_steps": 0, "end_lr": 0.0001, "power": 1.0, "last_epoch": -1}


def test_polynomial_warmup_follows_the_original_over_the_whole_run():
    # the numbers: decay_steps is the whole run (1000), 100 of them warmup, base 2.0 -> 0.1, power 2
    opt = optimizer(2.0)
    sched = PolynomialWarmup(opt, decay_steps=1000, warmup_steps=100, end_lr=0.1, power=2.0)
    seen = lrs_after_calls(sched, opt, 1003)
    original = [original_polynomial_warmup(s, 2.0, 1000, 100, 0.1, 2.0) for s in range(1004)]
    # the one documented change: the warmup is one step ahead, so the first step trains (the original's is 0)
    assert original[0] == 0.0 and seen[0] == pytest.approx(2.0 * 1 / 100) == pytest.approx(original[1])
    assert seen[:100] == pytest.approx(original[1:101])
    assert seen[99] == pytest.approx(2.0)  # the last warmup step at the base LR
    # from the end of warmup on, the original's values at the same counter
    assert seen[100:] == pytest.approx(original[100:], rel=1e-12)
    assert seen[100] == pytest.approx(2.0)
    assert seen[550] == pytest.approx(0.575)  # 1.9 * (1 - 450/900)^2 + 0.1 (the old code gave 0.675)
    assert seen[999] == pytest.approx(1.9 / 900**2 + 0.1)
    assert seen[1000] == pytest.approx(0.1) and seen[1003] == pytest.approx(0.1)  # the old code gave 0.119


def test_polynomial_warmup_without_warmup_starts_at_the_base_lr():
    opt = optimizer(1.0)
    sched = PolynomialWarmup(opt, decay_steps=4)
    expected = [original_polynomial_warmup(s, 1.0, 4, 0, 0.0001, 1.0) for s in range(6)]
    assert lrs_after_calls(sched, opt, 5) == pytest.approx(expected)
    assert expected[:2] == pytest.approx([1.0, 0.9999 * 0.75 + 0.0001]) and expected[4] == 0.0001


def test_polynomial_warmup_refuses_a_warmup_longer_than_the_run():
    with pytest.raises(ValueError, match="decay_steps is the whole run"):
        PolynomialWarmup(optimizer(), decay_steps=10, warmup_steps=20)


@pytest.mark.parametrize("decay", ["poly", "cosine"])
@pytest.mark.parametrize("warmup_epochs", [0.0, 1.0])
def test_poly_and_cosine_reach_end_lr_on_the_last_step_of_the_run(decay, warmup_epochs):
    epochs, steps_per_epoch, base, end = 3, 4, 0.8, 0.05
    opt = optimizer(base)
    schedule = _build(opt, steps_per_epoch, epochs=epochs, warmup_epochs=warmup_epochs, scheduler=decay, end_lr=end,
                      lr_power=2.0)  # fmt: skip
    used = []
    for _ in range(epochs * steps_per_epoch):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    total, warmup = epochs * steps_per_epoch, round(warmup_epochs * steps_per_epoch)

    def plain(k):  # step k (0-based) uses the curve's value after k + 1 steps
        done = k + 1
        if done <= warmup:
            return base * done / warmup
        progress = (done - warmup) / (total - warmup)
        if decay == "poly":
            return (base - end) * (1 - progress) ** 2 + end
        return end + (base - end) * (1 + math.cos(math.pi * progress)) / 2

    assert used == pytest.approx([plain(k) for k in range(total)], rel=1e-12)
    assert used[-1] == pytest.approx(end)
    peaks = [k for k, lr in enumerate(used) if lr == pytest.approx(base)]
    assert peaks == ([warmup - 1] if warmup else [])  # the base LR once, on the last warmup step
    if decay == "poly":  # the same curve as the original's PolynomialWarmup over the whole run, one step on
        original = [original_polynomial_warmup(k + 1, base, total, warmup, end, 2.0) for k in range(total)]
        assert used == pytest.approx(original, rel=1e-12)


def test_cosine_decay_to_end_lr():
    opt = optimizer(1.0)
    used = lrs_used(WarmupDecay(opt, 0, 4, decay="cosine"), opt, 5)
    # step k uses (1 + cos(pi * (k + 1) / 4)) / 2: the 4th and last step reaches end_lr, which then holds
    assert used == pytest.approx([(1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0, 0.0])


def test_step_decay():
    opt = optimizer(1.0)
    used = lrs_used(WarmupDecay(opt, 0, 10, decay="step", step_size=3, gamma=0.1), opt, 7)
    assert used == pytest.approx([1, 1, 1, 0.1, 0.1, 0.1, 0.01])


def _cfg(**kw):
    base = dict(
        epochs=4,
        warmup_epochs=1.0,
        warmup_type="linear",
        scheduler="plateau",
        end_lr=0.0,
        lr_power=1.0,
        step_epochs=30.0,
        step_gamma=0.1,
        plateau_factor=0.5,
        plateau_patience=0,
    )
    return argparse.Namespace(**(base | kw))


def _build(opt, steps_per_epoch, **kw):
    """The schedule run.py builds for these flags (run.make_schedule), with steps_per_epoch steps per epoch."""
    import run

    cfg = _cfg(**kw)
    total = cfg.epochs * steps_per_epoch
    warmup = min(round(cfg.warmup_epochs * steps_per_epoch), total)
    step_size = max(1, round(cfg.step_epochs * steps_per_epoch))
    lr = opt.param_groups[0]["lr"]
    the_plan = plan.Plan(steps_per_epoch, 1, 1, 1, 0, lr, 1, steps_per_epoch, total, warmup, lr_power=cfg.lr_power,
                         step_size=step_size)  # fmt: skip
    return run.make_schedule(cfg, the_plan, opt, "min")


def test_warmup_then_plateau_on_a_scripted_loss_sequence():
    opt = optimizer(0.1)
    schedule = _build(opt, 2)
    seen = []
    for loss in [1.0, 1.2, 0.5, 0.6]:
        for _ in range(2):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            schedule.step()
        schedule.epoch_end(loss)
    seen.append(opt.param_groups[0]["lr"])
    # epoch 1 warms up (0.05, 0.1); 1.2 is worse -> cut to 0.05; 0.5 improves; 0.6 is worse -> 0.025.
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.025])


def test_plateau_waits_for_warmup_and_warmup_never_undoes_a_cut():
    opt = optimizer(0.1)
    schedule = _build(opt, 2, warmup_epochs=2.0)
    for _ in range(2):
        opt.step()
        schedule.step()
    schedule.epoch_end(5.0)  # still warming up: ignored
    schedule.epoch_end(9.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.075)
    for _ in range(2):
        opt.step()
        schedule.step()
    schedule.epoch_end(1.0)
    schedule.epoch_end(2.0)  # cut
    for _ in range(3):
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_warmup_type_cosine_means_cosine_decay_after_warmup():
    opt = optimizer(1.0)
    schedule = _build(opt, 2, epochs=2, scheduler="constant", warmup_type="cosine")
    used = []
    for _ in range(4):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    # warmup 1/2, 2/2; cosine over the 2 remaining steps: (1 + cos(pi/2)) / 2, then end_lr 0 on the last step
    assert used == pytest.approx([0.5, 1.0, 0.5, 0.0])


def test_fractional_warmup_epochs_become_steps():
    numbers = dict(num_train=512, world_size=1, micro_batch=32, accum_steps=1, epochs=4, seed=0, base_lr=0.1,
                   lr_scaling="keep", base_batch=256)  # fmt: skip
    assert plan.make(**numbers, warmup_epochs=0.3125).steps_per_epoch == 16
    assert plan.make(**numbers, warmup_epochs=0.3125).warmup_steps == 5  # 0.3125 x 16


def test_schedule_state_dict_continues_exactly():
    def make():
        opt = optimizer(0.1)
        return opt, _build(opt, 2)

    opt, schedule = make()
    for loss in [1.0, 1.2]:
        for _ in range(2):
            opt.step()
            schedule.step()
        schedule.epoch_end(loss)
    opt2, schedule2 = make()
    opt2.load_state_dict(opt.state_dict())
    schedule2.load_state_dict(schedule.state_dict())
    for o, s in ((opt, schedule), (opt2, schedule2)):
        s.epoch_end(1.3)
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"] == pytest.approx(0.025)


def test_lr_scaling_rules():
    numbers = dict(num_train=4096, micro_batch=256, accum_steps=2, epochs=1, seed=0, base_lr=0.1, base_batch=256,
                   warmup_epochs=0)  # fmt: skip
    # global batch 256 x 2 processes x 2 accumulation steps = 1024, four times --base-batch-size
    assert plan.make(**numbers, world_size=2, lr_scaling="keep").lr == 0.1
    assert plan.make(**numbers, world_size=2, lr_scaling="linear").lr == pytest.approx(0.4)
    assert plan.make(**numbers, world_size=2, lr_scaling="sqrt").lr == pytest.approx(0.2)  # root of the ratio


def test_a_traced_run_scales_the_lr_to_its_reference_batch():
    # --lr-scaling takes --base-lr from --base-batch-size to the trace's reference batch (its first by default)
    traced = plan.make(num_train=1000, world_size=1, micro_batch=8, accum_steps=1, epochs=1, seed=0, base_lr=0.1,
                       lr_scaling="linear", base_batch=32, warmup_epochs=0, trace=[128, 256],
                       trace_end="repeat-last")  # fmt: skip
    assert traced.global_batch == 128 and traced.lr == pytest.approx(0.4)
