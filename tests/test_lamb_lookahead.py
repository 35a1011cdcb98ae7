"""LAMB and Lookahead against their formulas, written plainly here; Lookahead under DDP on 2 gloo ranks."""

import copy
import math

import pytest
import torch
from multiproc import run_ranks
from test_lars import STEPS, grads_for, initial, lr_at, make_params, norm, run_optimizer
from torch import nn

from lamb import LAMB
from lars import LARS, LARSWrapper
from lookahead import Lookahead


def reference_lamb(start, steps, betas, eps, wd, bias_correction, lars_on):
    w = [p.double().clone() for p in start]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for step in range(steps):
        lr, t = lr_at(step), step + 1
        for i, g in enumerate(grads_for(step, start)):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat = m[i] / (1 - betas[0] ** t) if bias_correction else m[i]
            v_hat = v[i] / (1 - betas[1] ** t) if bias_correction else v[i]
            u = m_hat / (v_hat.sqrt() + eps) + wd * w[i]
            wn, un = norm(w[i]), norm(u)
            r = wn / un if (lars_on and wn > 0 and un > 0) else 1.0
            w[i] = w[i] - lr * r * u
    return w


@pytest.mark.parametrize("bias_correction, lars_on, wd", [(True, True, 0.01), (False, True, 0.0), (True, False, 0.01)])
def test_lamb_matches_algorithm_2(bias_correction, lars_on, wd):
    params = make_params()
    start = initial(params)
    run_optimizer(
        lambda ps: LAMB([{"params": ps, "lars": lars_on}], lr=0.01, weight_decay=wd, bias_correction=bias_correction),
        params,
        STEPS,
    )
    expected = reference_lamb(start, STEPS, (0.9, 0.999), 1e-6, wd, bias_correction, lars_on)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6


def test_lamb_zero_weight_uses_ratio_one_and_leaves_grad_alone():
    params = make_params(zero_weight=True)
    start = initial(params)
    opt = LAMB(params, lr=lr_at(0), weight_decay=0.0)
    for p, g in zip(params, grads_for(0, params)):
        p.grad = g.clone()
    opt.step()
    grads = grads_for(0, params)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    expected = reference_lamb(start, 1, (0.9, 0.999), 1e-6, 0.0, True, True)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6
    assert params[1].abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs", [dict(lr=-1), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)), dict(eps=-1), dict(weight_decay=-1)]
)
def test_lamb_invalid_arguments(kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        LAMB(make_params(), **kwargs)


def reference_lookahead_sgd(start, steps, k, alpha, lr=0.05):
    """Plain SGD as the fast optimizer; slow weights start at the initial weights."""
    fast = [p.double().clone() for p in start]
    slow = [p.clone() for p in fast]
    sync_steps = []
    for step in range(1, steps + 1):
        for i, g in enumerate(grads_for(step - 1, start)):
            fast[i] = fast[i] - lr * g.double()
        if step % k == 0:
            sync_steps.append(step)
            for i in range(len(fast)):
                slow[i] = slow[i] + alpha * (fast[i] - slow[i])
                fast[i] = slow[i].clone()
    return fast, slow, sync_steps


def test_lookahead_syncs_after_steps_3_6_9():
    params = make_params()
    start = initial(params)
    opt = Lookahead(torch.optim.SGD(params, lr=0.05), k=3, alpha=0.5)
    synced = []
    for step in range(1, 11):
        for p, g in zip(params, grads_for(step - 1, params)):
            p.grad = g
        before = [s.clone() for s in opt.slow]
        opt.step()
        if any(not torch.equal(a, b) for a, b in zip(before, opt.slow)):
            synced.append(step)
            assert all(torch.equal(p, s) for p, s in zip(params, opt.slow))  # fast = slow after a sync
    fast, slow, expected_syncs = reference_lookahead_sgd(start, 10, 3, 0.5)
    assert synced == expected_syncs == [3, 6, 9]
    for p, e in zip(params, fast):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6
    for s, e in zip(opt.slow, slow):
        assert (s.double() - e).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "make_base",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        lambda ps: LARS(ps, lr=0.05, weight_decay=1e-3),
        lambda ps: LARSWrapper(torch.optim.Adam(ps, lr=0.01)),
    ],
    ids=["SGD", "LARS", "LARSWrapper(Adam)"],
)
def test_lookahead_state_dict_continues_a_run_exactly(make_base):
    def make(ps):
        return Lookahead(make_base(ps), k=3, alpha=0.5)

    params = make_params()
    opt = run_optimizer(make, params, 7)
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    assert saved["lookahead"]["step"] == 7 and len(saved["lookahead"]["slow"]) == 3
    for step in range(7, 14):
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g
        opt.step()
    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    for step in range(7, 14):
        for p, g in zip(resumed, grads_for(step, resumed)):
            p.grad = g
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))
    assert all(torch.equal(a, b) for a, b in zip(opt.slow, opt2.slow))


def test_lookahead_is_an_optimizer_for_schedulers_and_scalers():
    params = make_params()
    opt = Lookahead(LARS(params, lr=0.1), k=2)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.optimizer.param_groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(2):
        loss = sum((p * g).sum() for p, g in zip(params, grads_for(0, params)))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
    assert opt.lookahead_step == 2 and math.isclose(opt.optimizer.param_groups[0]["lr"], 0.025)
    assert all(p.grad is None for p in params)
    # A step the scaler skips (inf gradient) is not a Lookahead step.
    params[0].grad = torch.full_like(params[0], float("inf"))
    scaler.unscale_(opt)
    scaler.step(opt)
    assert opt.lookahead_step == 2


def test_lookahead_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k"):
        Lookahead(torch.optim.SGD(make_params(), lr=0.1), k=0)
    with pytest.raises(ValueError, match="alpha"):
        Lookahead(torch.optim.SGD(make_params(), lr=0.1), alpha=1.5)


def _ddp_lookahead(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = Lookahead(LARS(ddp.parameters(), lr=0.5, weight_decay=1e-3), k=2, alpha=0.5)
    torch.manual_seed(100 + rank)  # every rank sees different data
    for _ in range(5):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [s.clone() for s in opt.slow]


@pytest.mark.slow
def test_lookahead_under_ddp_keeps_ranks_identical():
    (params0, slow0), (params1, slow1) = run_ranks(_ddp_lookahead, 2)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert all(torch.equal(a, b) for a, b in zip(slow0, slow1))
    assert not all(torch.equal(p, s) for p, s in zip(params0, slow0))  # step 5: fast moved since the sync
