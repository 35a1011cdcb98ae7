"""LARS, LARSWrapper and create_optimizer_lars against the formulas, written plainly here in float64."""

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from lars import LARS, LARSWrapper, PolynomialWarmup, create_optimizer_lars  # noqa: F401 (import path is API)

STEPS = 20


def lr_at(step):
    return 0.1 * (1 + step) / STEPS  # changes every step


def make_params(seed=0, zero_weight=False):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(5, 4, generator=g), torch.randn(7, generator=g), torch.randn(3, 2, 2, generator=g)]
    if zero_weight:
        params[1].zero_()
    return [nn.Parameter(p) for p in params]


def grads_for(step, params, zero_grad_index=None):
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    if zero_grad_index is not None:
        grads[zero_grad_index].zero_()
    return grads


def norm(t):
    return math.sqrt(sum(x * x for x in t.flatten().tolist()))


def reference_lars(params, steps, momentum, wd, tc, eps, nesterov, lars_on, zero_grad_index=None):
    """Algorithm 1, one tensor at a time, in float64."""
    w = [p.double().clone() for p in params]
    v = [torch.zeros_like(x) for x in w]
    for step in range(steps):
        lr = lr_at(step)
        for i, g in enumerate(grads_for(step, params, zero_grad_index)):
            g = g.double()
            wn, gn = norm(w[i]), norm(g)
            r = tc * wn / (gn + wd * wn + eps) if (lars_on and wn > 0 and gn > 0) else 1.0
            d = g + wd * w[i]
            v[i] = momentum * v[i] + lr * r * d
            w[i] = w[i] - (momentum * v[i] + lr * r * d if nesterov else v[i])
    return w


def initial(params):
    return [p.detach().clone() for p in params]


def run_optimizer(make, params, steps, zero_grad_index=None):
    opt = make(params)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for p, g in zip(params, grads_for(step, params, zero_grad_index)):
            p.grad = g
        opt.step()
    return opt


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    "momentum, wd, nesterov, lars_on",
    [
        (0.9, 0.0, False, True),
        (0.9, 1e-2, False, True),
        (0.9, 1e-2, True, True),
        (0.0, 1e-3, False, True),
        (0.9, 1e-2, False, False),
    ],
)
def test_lars_matches_algorithm_1(momentum, wd, nesterov, lars_on, foreach):
    params = make_params()
    start = initial(params)
    run_optimizer(
        lambda ps: LARS(
            [{"params": ps, "lars": lars_on}],
            lr=0.1,
            momentum=momentum,
            weight_decay=wd,
            trust_coefficient=0.02,
            eps=1e-8,
            nesterov=nesterov,
            foreach=foreach,
        ),
        params,
        STEPS,
    )
    expected = reference_lars(start, STEPS, momentum, wd, 0.02, 1e-8, nesterov, lars_on)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6


@pytest.mark.parametrize("foreach", [False, True])
def test_zero_weight_and_zero_gradient_use_ratio_one(foreach):
    params = make_params(zero_weight=True)
    start = initial(params)
    run_optimizer(
        lambda ps: LARS(ps, lr=0.1, weight_decay=1e-3, trust_coefficient=0.02, foreach=foreach),
        params,
        3,
        zero_grad_index=2,
    )
    expected = reference_lars(start, 3, 0.9, 1e-3, 0.02, 1e-8, False, True, zero_grad_index=2)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6
    assert params[1].abs().sum() > 0  # a zero weight is not frozen: it moves with r = 1


def test_lars_groups_mix_lars_and_plain_with_their_own_weight_decay():
    params = make_params()
    start = initial(params)
    run_optimizer(
        lambda ps: LARS(
            [{"params": ps[:2]}, {"params": ps[2:], "lars": False, "weight_decay": 0.0}],
            lr=0.1,
            weight_decay=1e-2,
            trust_coefficient=0.02,
        ),
        params,
        STEPS,
    )
    scaled = reference_lars(start, STEPS, 0.9, 1e-2, 0.02, 1e-8, False, True)
    plain = reference_lars(start, STEPS, 0.9, 0.0, 0.02, 1e-8, False, False)
    for p, e in zip(params, scaled[:2] + plain[2:]):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6


def test_step_leaves_grad_untouched():
    params = make_params()
    opt = LARS(params, lr=0.1, weight_decay=1e-2)
    grads = grads_for(0, params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LARS(ps, lr=0.1, weight_decay=1e-2, trust_coefficient=0.02),
        lambda ps: LARSWrapper(torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2), trust_coefficient=0.02),
        lambda ps: LARSWrapper(torch.optim.Adam(ps, lr=0.01, weight_decay=1e-2)),
    ],
    ids=["LARS", "LARSWrapper(SGD)", "LARSWrapper(Adam)"],
)
def test_state_dict_round_trip_mid_run_continues_identically(make):
    params = make_params()
    opt = run_optimizer(make, params, 10)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    for step in range(10, STEPS):  # the uninterrupted run
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g
        opt.step()
    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved_state)
    for step in range(10, STEPS):
        for p, g in zip(resumed, grads_for(step, resumed)):
            p.grad = g
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


@pytest.mark.parametrize("foreach", [False, True])
def test_bf16_parameters_follow_the_fp32_update(foreach):
    """One LARS step on bf16 parameters (per-tensor loop, multi-tensor kernels) lands where the same step in fp32
    lands, from the same start (bf16 values): the difference is bf16's rounding, measured 2 % of the update's size
    (lr 5: a step well above bf16's resolution; at lr 0.5 rounding is 11 % of it), asserted under 10 %. Broken on
    purpose: bf16 parameters not updated (lars.py's bf16 path, either one) gives 100 %."""
    start = [p.detach().bfloat16().float() for p in make_params()]
    params32 = [nn.Parameter(w.clone()) for w in start]
    params16 = [nn.Parameter(w.bfloat16()) for w in start]
    for ps in (params32, params16):
        opt = LARS(ps, lr=5.0, weight_decay=1e-3, trust_coefficient=0.02, foreach=foreach)
        for p, g in zip(ps, grads_for(0, ps)):
            p.grad = g.to(p.dtype)
        opt.step()
    assert all(b.dtype == torch.bfloat16 for b in params16)
    update = torch.cat([(a.detach() - w).flatten() for a, w in zip(params32, start)])
    error = torch.cat([(a.detach() - b.detach().float()).flatten() for a, b in zip(params32, params16)])
    assert update.norm() > 0.5  # the step itself (0.66)
    assert error.norm() < 0.1 * update.norm()
    assert error.abs().max() < 0.1 * update.abs().max()


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        LARS(emb.parameters(), lr=0.1).step()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1), "learning rate"),
        (dict(lr=0.1, momentum=-0.1), "momentum"),
        (dict(lr=0.1, weight_decay=-1), "weight_decay"),
        (dict(lr=0.1, trust_coefficient=0), "trust_coefficient"),
        (dict(lr=0.1, eps=-1), "eps"),
        (dict(lr=0.1, momentum=0, nesterov=True), "nesterov"),
    ],
)
def test_invalid_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LARS(make_params(), **kwargs)


def reference_wrapped_sgd(params, steps, momentum, wd, tc, eps):
    """torchlars: SGD (no weight decay) on r * (g + wd * w)."""
    w = [p.double().clone() for p in params]
    buf = [None] * len(w)
    for step in range(steps):
        lr = lr_at(step)
        for i, g in enumerate(grads_for(step, params)):
            g = g.double()
            wn, gn = norm(w[i]), norm(g)
            r = tc * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
            d = r * (g + wd * w[i])
            buf[i] = d.clone() if buf[i] is None else momentum * buf[i] + d
            w[i] = w[i] - lr * buf[i]
    return w


def test_wrapper_over_sgd_equals_torchlars_formula():
    params = make_params()
    start = initial(params)
    run_optimizer(
        lambda ps: LARSWrapper(torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2), trust_coefficient=0.02),
        params,
        STEPS,
    )
    expected = reference_wrapped_sgd(start, STEPS, 0.9, 1e-2, 0.02, 1e-8)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6


def reference_wrapped_adam(params, steps, wd, tc, eps, betas=(0.9, 0.999), adam_eps=1e-8):
    """Adam (no weight decay of its own) on r * (g + wd * w)."""
    w = [p.double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for step in range(steps):
        lr, t = lr_at(step) / 10, step + 1
        for i, g in enumerate(grads_for(step, params)):
            g = g.double()
            wn, gn = norm(w[i]), norm(g)
            r = tc * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
            d = r * (g + wd * w[i])
            m[i] = betas[0] * m[i] + (1 - betas[0]) * d
            v[i] = betas[1] * v[i] + (1 - betas[1]) * d * d
            m_hat, v_hat = m[i] / (1 - betas[0] ** t), v[i] / (1 - betas[1] ** t)
            w[i] = w[i] - lr * m_hat / (v_hat.sqrt() + adam_eps)
    return w


def test_wrapper_over_adam_feeds_adam_the_scaled_gradient_and_restores_its_settings():
    params = make_params()
    start = initial(params)
    opt = LARSWrapper(torch.optim.Adam(params, lr=0.01, weight_decay=1e-2), trust_coefficient=0.02)
    grads = []
    for step in range(STEPS):
        opt.param_groups[0]["lr"] = lr_at(step) / 10
        grads = grads_for(step, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        assert opt.optimizer.param_groups[0]["weight_decay"] == 1e-2
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    expected = reference_wrapped_adam(start, STEPS, 1e-2, 0.02, 1e-8)
    for p, e in zip(params, expected):
        assert (p.detach().double() - e).abs().max().item() <= 1e-6


def test_wrapper_passes_plain_groups_through():
    params = make_params()
    base = torch.optim.SGD([{"params": params, "lars": False}], lr=0.1, momentum=0.9)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    opt = LARSWrapper(base)
    for step in range(3):
        for ps, o in ((params, opt), (reference, plain)):
            for p, g in zip(ps, grads_for(step, ps)):
                p.grad = g
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, reference))


def test_wrapper_is_an_optimizer_for_schedulers_scalers_pickle_and_copy():
    params = make_params()
    opt = LARSWrapper(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    loss = sum((p * g).sum() for p, g in zip(params, grads_for(0, params)))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.05
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.param_groups is clone.optimizer.param_groups
        assert clone.state_dict()["param_groups"][0]["lr"] == 0.05


def test_update_with_grad_scaler_equals_update_without_when_nothing_overflows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    opt = LARS(model.parameters(), lr=0.5, weight_decay=1e-3, trust_coefficient=0.02)
    opt_twin = LARS(twin.parameters(), lr=0.5, weight_decay=1e-3, trust_coefficient=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(5):
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        nn.functional.cross_entropy(twin(x), y).backward()
        opt_twin.step()
        opt_twin.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_create_optimizer_lars_puts_norms_and_biases_in_a_plain_group():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 3, bias=False),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.LazyLinear(3),
        nn.LayerNorm(3),
    )
    model(torch.randn(2, 1, 8, 8))
    opt = create_optimizer_lars(
        model=model, lr=0.1, epsilon=1e-8, momentum=0.9, weight_decay=5e-4, bn_bias_separately=True
    )
    scaled, plain = opt.param_groups
    assert scaled["lars"] and scaled["weight_decay"] == 5e-4
    assert not plain["lars"] and plain["weight_decay"] == 0.0
    weights = {id(model[0].weight), id(model[2].weight), id(model[5].weight)}
    assert {id(p) for p in scaled["params"]} == weights
    everything = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(everything) == sorted(id(p) for p in model.parameters())  # each exactly once
    single = create_optimizer_lars(model, lr=0.1, bn_bias_separately=False)
    assert len(single.param_groups) == 1 and len(single.param_groups[0]["params"]) == len(everything)


def test_every_lars_the_run_or_the_factory_builds_takes_its_settings_through_one_helper(monkeypatch):
    """lars.lars_over hands LARS's settings on, for create_optimizer_lars, --optimizer lars and --lars-wrap alike, and
    what each builds holds them. Broken on purpose: a call that builds LARS or LARSWrapper itself again (as build.py
    and create_optimizer_lars did) fails it (that call never reaches the helper)."""
    import inspect

    import lars
    from ddp_tricks.optim import build as optimizers

    model, made, helper = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), [], lars.lars_over
    monkeypatch.setattr(lars, "lars_over", lambda target, **kw: made.append((target, kw)) or helper(target, **kw))
    settings = {"momentum": 0.8, "weight_decay": 1e-3, "trust_coefficient": 0.02, "eps": 1e-6, "nesterov": True}
    but_eps = {k: v for k, v in settings.items() if k != "eps"}
    factory = lars.create_optimizer_lars(model, lr=0.5, epsilon=1e-6, **but_eps)
    run = optimizers.build(model, "lars", lr=0.5, bn_bias_separately=True, **settings)
    wrapped = optimizers.build(model, "sgd", lr=0.5, lars_wrap=True, **settings)
    assert [type(optimizer).__name__ for optimizer in (factory, run, wrapped)] == ["LARS", "LARS", "LARSWrapper"]
    # the run's builds hand on the mesh's shard group too (None: an unsharded model)
    assert len(made) == 3 and all(
        kw | {"shard_group": None} == {"lr": 0.5, **settings, "shard_group": None} for _, kw in made
    )
    for optimizer in (factory, run):
        assert {k: optimizer.defaults[k] for k in settings} == settings
    assert (wrapped.trust_coefficient, wrapped.eps) == (0.02, 1e-6)
    assert wrapped.optimizer.defaults["momentum"] == 0.8 and wrapped.optimizer.defaults["nesterov"] is True
    # the public signatures, as the original LARS project's code calls them
    assert list(inspect.signature(lars.create_optimizer_lars).parameters) == [
        "model", "lr", "momentum", "weight_decay", "bn_bias_separately", "epsilon", "trust_coefficient", "nesterov"
    ]  # fmt: skip
    wrapper = inspect.signature(lars.LARSWrapper).parameters  # the positional ones; a sharded model's group: keyword
    assert [n for n, p in wrapper.items() if p.kind != p.KEYWORD_ONLY] == ["optimizer", "trust_coefficient", "eps"]
