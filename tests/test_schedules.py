"""Every schedule's LR at chosen steps, against numbers computed by hand here."""

import argparse
import math

import pytest
import torch

import plan
from lars import PolynomialWarmup as PolynomialWarmupFromLars
from schedulers import PolynomialWarmup, WarmupDecay


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


def test_polynomial_warmup_has_the_original_signature_and_values():
    assert PolynomialWarmupFromLars is PolynomialWarmup
    opt = optimizer(1.0)
    sched = PolynomialWarmup(opt, decay_steps=4, warmup_steps=2, end_lr=0.01, power=2.0, last_epoch=-1)
    # warmup 1/2, 2/2; then 0.99 * (1 - t/4)^2 + 0.01 for t = 0..4, then end_lr
    expected = [0.5, 1.0, 1.0, 0.99 * 0.75**2 + 0.01, 0.99 * 0.25 + 0.01, 0.99 * 0.0625 + 0.01, 0.01, 0.01]
    assert lrs_used(sched, opt, 8) == pytest.approx(expected)


def test_cosine_decay_to_end_lr():
    opt = optimizer(1.0)
    used = lrs_used(WarmupDecay(opt, 0, 4, decay="cosine"), opt, 5)
    assert used == pytest.approx([1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0])


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
    the_plan = plan.Plan(steps_per_epoch, 1, 1, 1, 0, opt.param_groups[0]["lr"], 1, steps_per_epoch, total,
                         min(round(cfg.warmup_epochs * steps_per_epoch), total))  # fmt: skip
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
    assert used == pytest.approx([0.5, 1.0, 1.0, 0.5])


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
