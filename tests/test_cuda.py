"""On a GPU: every optimizer's step without a host sync and inside a CUDA graph, LARS and LAMB against their
float64 references, run.py end to end (nccl, AMP, channels-last, compile, SyncBN, pinned workers, --deterministic),
fp16 overflow skipping a step, and the host syncs of a loop step (fp16, --on-nonfinite skip). Those tests are marked
`cuda` and skip without a CUDA device (`make gpu-check` runs them). The code paths a CUDA graph needs (capturable
LAMB and Lookahead) are also checked here on the CPU.
"""

import copy
import csv
import math
import time
import warnings

import pytest
import torch
from multiproc import python_run, torchrun
from test_lamb_lookahead import reference_lamb, reference_lookahead_sgd
from test_lars import STEPS, grads_for, initial, lr_at, make_params, reference_lars
from torch import nn

from lamb import LAMB
from lars import LARS, LARSWrapper
from lookahead import Lookahead

NO_CUDA = "no CUDA device visible"
HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0


def cuda_test(test):
    """Marked `cuda` (`pytest -m cuda` selects it) and skipped where torch sees no CUDA device."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)(test))


two_gpus = pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if not GPUS else f"needs 2 CUDA devices, {GPUS} visible")


def run_steps(opt, params, steps, first=0):
    """The test_lars schedule: LR lr_at(step) and gradients grads_for(step), on the parameters' device."""
    for step in range(first, first + steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g.to(p.device)
        opt.step()


def on_cuda(params):
    return [nn.Parameter(p.detach().cuda()) for p in params]


def max_error(params, expected) -> float:
    return max((p.detach().cpu().double() - e).abs().max().item() for p, e in zip(params, expected))


# --- The capturable code paths, on the CPU (no GPU needed) ---------------------------------------------------


@pytest.mark.parametrize("bias_correction, lars_on, wd", [(True, True, 0.01), (False, True, 0.0), (True, False, 0.01)])
def test_capturable_lamb_matches_algorithm_2(bias_correction, lars_on, wd):
    params = make_params()
    start = initial(params)
    opt = LAMB(
        [{"params": params, "lars": lars_on}],
        lr=0.01,
        weight_decay=wd,
        bias_correction=bias_correction,
        capturable=True,
    )
    run_steps(opt, params, STEPS)
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].item() == STEPS for s in opt.state.values())
    assert max_error(params, reference_lamb(start, STEPS, (0.9, 0.999), 1e-6, wd, bias_correction, lars_on)) <= 1e-6


def test_lamb_continues_a_run_across_capturable_and_plain_steps():
    params = make_params()
    start = initial(params)
    opt = LAMB(params, lr=0.01)
    run_steps(opt, params, 7)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a checkpoint's groups carry its own `capturable`
    for group in opt.param_groups:
        group["capturable"] = True
    run_steps(opt, params, 7, first=7)
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].item() == 14 for s in opt.state.values())
    for group in opt.param_groups:
        group["capturable"] = False
    run_steps(opt, params, STEPS - 14, first=14)
    assert all(s["step"] == STEPS for s in opt.state.values())
    assert max_error(params, reference_lamb(start, STEPS, (0.9, 0.999), 1e-6, 0.01, True, True)) <= 1e-6


def test_capturable_lookahead_syncs_after_steps_3_6_9_like_the_plain_one():
    params, twin = make_params(), make_params()
    start = initial(params)
    opt = Lookahead(torch.optim.SGD(params, lr=0.05), k=3, alpha=0.5, capturable=True)
    plain = Lookahead(torch.optim.SGD(twin, lr=0.05), k=3, alpha=0.5)
    for step in range(10):
        for ps, o in ((params, opt), (twin, plain)):
            for p, g in zip(ps, grads_for(step, ps)):
                p.grad = g
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twin)), step
    fast, slow, syncs = reference_lookahead_sgd(start, 10, 3, 0.5)
    assert syncs == [3, 6, 9] and opt.state_dict()["lookahead"]["step"] == 10
    assert max_error(params, fast) <= 1e-6 and max_error(opt.slow, slow) <= 1e-6


# --- Optimizers on the GPU --------------------------------------------------------------------------------------

SHAPES = [(64, 3, 7, 7), (64,), (256, 64, 1, 1), (1000, 2048), (1000,), (3,)]


def cuda_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]


def cuda_grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 1e-2).cuda() for s in SHAPES]


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4)


CAPTURABLE = {
    "LARS(foreach)": lambda ps: LARS(ps, lr=0.1, weight_decay=1e-4, trust_coefficient=0.02, foreach=True),
    "LARSWrapper(SGD)": lambda ps: LARSWrapper(sgd(ps), trust_coefficient=0.02),
    "LARSWrapper(AdamW)": lambda ps: LARSWrapper(torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, capturable=True)),
    "LAMB": lambda ps: LAMB(ps, lr=1e-3, capturable=True),
    "Lookahead(SGD)": lambda ps: Lookahead(sgd(ps), k=3, alpha=0.5, capturable=True),
}
# As users build them by default (run.py does): these must not sync either.
DEFAULTS = {
    "LAMB default": lambda ps: LAMB(ps, lr=1e-3),
    "Lookahead(SGD) default": lambda ps: Lookahead(sgd(ps), k=3),
    "LARSWrapper(AdamW) default": lambda ps: LARSWrapper(torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2)),
}


@cuda_test
@pytest.mark.parametrize("make", [*CAPTURABLE.values(), *DEFAULTS.values()], ids=[*CAPTURABLE, *DEFAULTS])
def test_step_makes_no_host_sync(make):
    params = cuda_params()
    opt = make(params)
    for step in range(3):  # steps 1 and 2 create the state; step 3 is checked (Lookahead, k=3, syncs there)
        for p, g in zip(params, cuda_grads(step)):
            p.grad = g
        torch.cuda.synchronize()
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in params)


@cuda_test
@pytest.mark.parametrize("make", CAPTURABLE.values(), ids=CAPTURABLE.keys())
def test_step_replays_in_a_cuda_graph_as_it_runs_eagerly(make):
    warmup, replays = 3, 7  # Lookahead k=3 syncs at steps 3 (eager), 6 and 9 (replayed)
    params, twin = cuda_params(), cuda_params()
    start = [p.detach().clone() for p in params]
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g
    opt = make(params)

    def load(step):
        for static, new in zip(static_grads, cuda_grads(step)):
            static.copy_(new)

    side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(warmup):
            load(step)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in range(warmup, warmup + replays):
        load(step)
        graph.replay()

    eager = make(twin)
    for step in range(warmup + replays):
        for p, g in zip(twin, cuda_grads(step)):
            p.grad = g
        eager.step()
    torch.cuda.synchronize()
    assert not any(torch.equal(p, s) for p, s in zip(params, start))  # the replays moved every weight
    for p, e in zip(params, twin):
        torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-6)


@cuda_test
@pytest.mark.parametrize(
    "momentum, wd, nesterov, lars_on",
    [(0.9, 0.0, False, True), (0.9, 1e-2, False, True), (0.9, 1e-2, True, True), (0.9, 1e-2, False, False)],
)
def test_lars_fp32_on_cuda_equals_the_float64_reference(momentum, wd, nesterov, lars_on):
    start = initial(make_params())
    params = on_cuda(start)
    opt = LARS(
        [{"params": params, "lars": lars_on}],
        lr=0.1,
        momentum=momentum,
        weight_decay=wd,
        trust_coefficient=0.02,
        nesterov=nesterov,
    )
    run_steps(opt, params, STEPS)
    assert max_error(params, reference_lars(start, STEPS, momentum, wd, 0.02, 1e-8, nesterov, lars_on)) <= 1e-5


@cuda_test
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("bias_correction, lars_on, wd", [(True, True, 0.01), (False, True, 0.0), (True, False, 0.01)])
def test_lamb_fp32_on_cuda_equals_the_float64_reference(bias_correction, lars_on, wd, capturable):
    start = initial(make_params())
    params = on_cuda(start)
    opt = LAMB(
        [{"params": params, "lars": lars_on}],
        lr=0.01,
        weight_decay=wd,
        bias_correction=bias_correction,
        capturable=capturable,
    )
    run_steps(opt, params, STEPS)
    assert max_error(params, reference_lamb(start, STEPS, (0.9, 0.999), 1e-6, wd, bias_correction, lars_on)) <= 1e-5


@cuda_test
@pytest.mark.parametrize("make", [sgd, lambda ps: LARS(ps, lr=0.1, weight_decay=1e-4)], ids=["SGD", "LARS"])
def test_fp16_overflow_skips_the_step_and_halves_the_scale(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(torch.randn(32, 8, device="cuda"))
    loss = out.float().pow(2).sum() * 1e30  # its gradient overflows float16 on the way back
    scaler.scale(loss).backward()
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0  # step() never ran: no momentum buffer either


# --- run.py end to end, as a user types it ----------------------------------------------------------------------

COMMON = ["--device", "cuda", "-e", "1", "--no-progress", "-n", "r"]
ONE_GPU_FLAGS = {
    "nccl": [],
    "amp fp16": ["--amp", "fp16"],
    "amp bf16": ["--amp", "bf16"],
    "channels-last": ["--channels-last"],
    "compile": ["--compile"],
    "workers 2 pinned": ["--workers", "2"],
    "lars": ["--optimizer", "lars"],
    "lamb lookahead": ["--optimizer", "lamb", "--lookahead"],
}


def assert_trained(result, run_dir):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "--compile is not available" not in result.stdout + result.stderr  # run.py's eager fallback
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and math.isfinite(float(rows[0]["val_loss"])), rows


@cuda_test
@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", ONE_GPU_FLAGS.values(), ids=ONE_GPU_FLAGS.keys())
def test_torchrun_one_gpu(flags, tmp_path):
    result = torchrun([*COMMON, "--backend", "nccl", "--runs-dir", str(tmp_path), *flags], nproc=1, timeout=540)
    assert_trained(result, tmp_path / "r")


@cuda_test
@pytest.mark.timeout(600)
def test_plain_python_on_one_gpu(tmp_path):
    assert_trained(python_run([*COMMON, "--runs-dir", str(tmp_path)], timeout=540), tmp_path / "r")


@cuda_test
@two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", [[], ["--sync-bn"]], ids=["nccl", "sync-bn"])
def test_torchrun_two_gpus(flags, tmp_path):
    result = torchrun([*COMMON, "--backend", "nccl", "--runs-dir", str(tmp_path), *flags], nproc=2, timeout=540)
    assert_trained(result, tmp_path / "r")


@cuda_test
@pytest.mark.timeout(600)
def test_deterministic_toy_run_on_cuda_trains_without_a_warning_and_repeats_bit_for_bit(tmp_path):
    """--deterministic with the default model on CUDA: AdaptiveAvgPool2d's backward has no deterministic kernel
    there, and with torch.use_deterministic_algorithms(True) the first backward raised. The toy's pooling tiles the
    8x8 digits, so it runs deterministic kernels only: no warning, and two runs agree to the bit."""
    weights = []
    for name in ("a", "b"):
        flags = ["--device", "cuda", "-e", "1", "--no-progress", "-n", name, "--deterministic"]
        result = python_run([*flags, "--runs-dir", str(tmp_path)], timeout=270)
        assert_trained(result, tmp_path / name)
        assert "does not have a deterministic implementation" not in result.stdout + result.stderr
        assert "--deterministic: an op without a deterministic kernel warns once" in result.stdout
        weights.append(torch.load(tmp_path / name / "last.pt", weights_only=True)["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@cuda_test
def test_deterministic_mode_on_cuda_warns_once_for_an_op_without_a_deterministic_kernel():
    """A user's model may use such an op: adaptive pooling whose windows overlap (7 -> 2). Its backward warns once,
    however many steps run, and the step goes on. The toy models' pooling, where it tiles, warns not at all and
    gives adaptive pooling's gradient."""
    from test_seeds_models import deterministic_mode, nondeterministic_warnings

    from ddp_tricks import models

    x = torch.randn(2, 3, 7, 7, device="cuda", requires_grad=True)
    tiled = torch.randn(2, 3, 8, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    weight = torch.arange(4.0, device="cuda", dtype=torch.float64).view(2, 2)
    toy_pool = models.build("toy", 3, 10).features[-1]
    with deterministic_mode() as caught:
        for _ in range(3):
            nn.functional.adaptive_avg_pool2d(x, 2).sum().backward()
        warned = nondeterministic_warnings(caught)
        ours = torch.autograd.grad((toy_pool(tiled) * weight).sum(), tiled)[0]
        assert nondeterministic_warnings(caught) == warned  # the toy's pooling added none
    assert len(warned) == 1 and warned[0].startswith("adaptive_avg_pool2d_backward_cuda"), warned
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    theirs = torch.autograd.grad((nn.functional.adaptive_avg_pool2d(tiled, 2) * weight).sum(), tiled)[0]
    torch.testing.assert_close(ours, theirs)


@cuda_test
def test_engine_training_step_makes_no_host_sync_between_logging_intervals():
    """run.py's loop (ddp_tricks.training.loop.train_one_epoch) on one GPU: from step 3 to step 11 any host-device
    synchronisation raises (`set_sync_debug_mode("error")`); the logging interval (1000) is never reached, so none is
    expected."""
    import tiny

    from ddp_tricks import plan
    from ddp_tricks.data import images as image_data
    from ddp_tricks.data import loaders as data
    from ddp_tricks.training.loop import train_one_epoch
    from ddp_tricks.training.precision import Precision

    device = torch.device("cuda")
    train_set, _ = image_data.digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    t = tiny.training(model, opt)
    t.device, t.precision = device, Precision("off", device)
    steps = plan.make(num_train=len(train_set), world_size=1, micro_batch=32, accum_steps=2, epochs=1, seed=0,
                      base_lr=0.05, lr_scaling="keep", base_batch=64, warmup_epochs=0).epoch(1, 0)[:12]  # fmt: skip
    loader = data.train_loader(train_set, 0, device, seed=0)
    loader.batch_sampler.start(steps)
    seen = []

    def after_step(t):
        done = t.progress.step_in_epoch
        seen.append(done)
        torch.cuda.set_sync_debug_mode("error" if 2 <= done < 11 else 0)
        return False

    try:
        row = train_one_epoch(t, steps, loader, after_step=after_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert seen == list(range(1, 13)) and math.isfinite(row["train_loss"])


SYNC_CASES = {  # (--amp, --on-nonfinite, what goes wrong, host syncs per step): docs/performance.md's table
    "fp32": ("off", "stop", None, 0),
    "fp16": ("fp16", "stop", None, 1),  # GradScaler's own read of its inf flag
    "fp16 overflowing": ("fp16", "stop", "overflow", 1),
    "skip fp32, a NaN step": ("off", "skip", "nan", 1),
    "skip bf16, a NaN step": ("bf16", "skip", "nan", 1),
}


@cuda_test
@pytest.mark.parametrize("amp, on_nonfinite, trouble, per_step", SYNC_CASES.values(), ids=SYNC_CASES.keys())
def test_a_step_makes_exactly_its_documented_host_syncs_on_cuda(amp, on_nonfinite, trouble, per_step):
    """test_host_syncs.py's counts, by CUDA's own detector: set_sync_debug_mode("warn") warns at every synchronising
    call (a read, a blocking copy either way, an op of data-dependent shape), from step 2 to the last."""
    import tiny

    from ddp_tricks import plan
    from ddp_tricks.data import images as image_data
    from ddp_tricks.training.loop import train_one_epoch
    from ddp_tricks.training.precision import Precision

    device = torch.device("cuda")
    train_set, _ = image_data.digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    t = tiny.training(model, opt, on_nonfinite=on_nonfinite)
    t.device, t.precision = device, Precision(amp, device)
    if trouble == "overflow":  # every step's fp16 gradients overflow: the scaler skips them all
        t.precision.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**60)
    steps = plan.make(num_train=len(train_set), world_size=1, micro_batch=32, accum_steps=1, epochs=1, seed=0,
                      base_lr=0.05, lr_scaling="keep", base_batch=32, warmup_epochs=0).epoch(1, 0)[:6]  # fmt: skip
    batches = list(tiny.loader_for(train_set, steps))  # on the host; the loop copies them (non-blocking)
    if trouble == "nan":
        batches[3] = (torch.full_like(batches[3][0], float("nan")), batches[3][1])
    syncs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def after_step(t):
            syncs.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in caught))
            caught.clear()
            torch.cuda.set_sync_debug_mode("warn")  # from the end of step 1 on
            return False

        try:
            train_one_epoch(t, steps, batches, after_step=after_step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert syncs[1:] == [per_step] * (len(steps) - 1)
    skipped = {None: 0, "overflow": len(steps), "nan": 1}[trouble]
    assert t.progress.skipped_steps == skipped and t.progress.global_step == len(steps)


@cuda_test
@pytest.mark.timeout(300)
def test_processes_shown_one_gpu_each_use_it_and_two_on_one_gpu_are_one_line(tmp_path):
    """Two ranks started as SLURM's --gpu-bind starts them (RANK, LOCAL_RANK, WORLD_SIZE set; each process shown
    one GPU by CUDA_VISIBLE_DEVICES): with two GPUs each trains on its own, as cuda:0; with one, both are shown the
    same GPU, and nccl cannot put two ranks on it: one of them says so in one line, exit 2 (the second GPU run found
    the test reading whichever rank ended first: the other rank may end first, its store's host gone)."""
    import os
    import subprocess
    import sys

    from multiproc import REPO, free_port

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(GPUS)]
    shown = [ids[0], ids[1]] if GPUS >= 2 else [ids[0], ids[0]]
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        env = os.environ | launcher | {"RANK": str(rank), "LOCAL_RANK": str(rank), "CUDA_VISIBLE_DEVICES": shown[rank]}
        command = [sys.executable, str(REPO / "run.py"), "-e", "1", "--no-progress", "-n", "r", "--runs-dir",
                   str(tmp_path), "--dist-timeout", "60"]  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    try:
        if GPUS >= 2:
            outputs = [p.communicate(timeout=240) for p in procs]
            assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
            assert "device cuda:0" in outputs[0][0]  # rank 0's start line; rank 1 uses its own GPU as cuda:0 too
            return
        deadline = time.time() + 120
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.2)
        # the other rank waits for it in the rendezvous, or ends as the store's host goes (exit 1, torch's c10d
        # warnings): which ends first is a race (the first GPU run saw both), so both are read once one has ended
        ends = time.time() + 30
        while any(p.poll() is None for p in procs) and time.time() < ends:
            time.sleep(0.2)
        for p in procs:  # a rank that waits for the one that refused: ended here, as SLURM ends the job's tasks
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate(timeout=30)[1].strip().splitlines() for p in procs]
        refused = [err for p, err in zip(procs, outputs) if p.returncode == 2]
        assert len(refused) == 1 and len(refused[0]) == 1, [(p.returncode, err[-3:]) for p, err in zip(procs, outputs)]
        assert "shares its GPU" in refused[0][0] and "nccl needs one GPU per rank" in refused[0][0], refused
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


# --- cuDNN's RNN dropout: a state of its own, drawn anew only when torch's generator is set -------------------------


class TwoLayerLSTM(nn.Module):
    """Sequences (n, 6, 4) -> one value each: an LSTM of 2 layers with dropout 0.5 between them (on CUDA, cuDNN's
    RNN dropout, which keeps its own dropout state), its last step's output through a linear layer."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 16, num_layers=2, dropout=0.5, batch_first=True)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.lstm(x)[0][:, -1]).squeeze(1)


class Regress:
    """A per-sample loss: the mean squared error."""

    def loss(self, outputs, targets):
        return nn.functional.mse_loss(outputs, targets)


def rng_now(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def lstm_gradients_cached_and_plain(device: torch.device):
    """One step of 2 micro-batches of 8 by cached accumulation (training/cached.py, as the loop runs it), and from the
    same random state by plain accumulation that sets the generator's state before each micro-batch's forward (so
    cuDNN draws that micro-batch's dropout from it, as cached accumulation's second pass does); a per-sample loss, so
    the two gradients are the same when both passes of the cached step drop the same units. A third gradient, plain
    from another random state, shows that the dropout draws matter."""
    import tiny

    from ddp_tricks.plan import Step
    from ddp_tricks.training import cached
    from ddp_tricks.training.precision import Precision

    torch.manual_seed(0)
    model = TwoLayerLSTM().to(device).train()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(8, 6, 4, device=device), torch.randn(8, device=device)) for _ in range(2)]
    with torch.no_grad():
        model(batches[0][0])  # cuDNN's dropout state drawn and cached, as after any earlier step
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.1))
    t.device, t.precision = device, Precision("off", device)
    tiny.retask(t, Regress(), [])
    start = rng_now(device)
    list(cached.cached_accumulation(t, Step([[0] * 8, [0] * 8], 16, 16), iter(batches), None))

    def plain(state):
        reference.zero_grad(set_to_none=True)
        set_rng(state)
        for x, y in batches:
            set_rng(rng_now(device))  # this micro-batch's dropout drawn from here (cuDNN's: drawn anew)
            (Regress().loss(reference(x), y) * len(x) / 16).backward()
        return [p.grad.clone() for p in reference.parameters()]

    from_start = plain(start)
    torch.manual_seed(1)
    elsewhere = plain(rng_now(device))
    return [p.grad.clone() for p in model.parameters()], from_start, elsewhere


@cuda_test
def test_cached_accumulation_of_an_lstm_with_cudnn_dropout_gets_plain_accumulation_s_gradient():
    """An nn.LSTM with num_layers=2 and dropout=0.5 under cached accumulation: the gradient plain accumulation gets
    from the same random state, one micro-batch at a time. Fails when cached accumulation's first pass only reads each
    micro-batch's random state (cuDNN then drops units from its own cached dropout state in the first pass and from
    one drawn anew in the second: the loss's gradient is taken at other outputs than the ones back-propagated)."""
    assert torch.backends.cudnn.enabled
    cached_, plain, elsewhere = lstm_gradients_cached_and_plain(torch.device("cuda"))
    for a, b in zip(cached_, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any((a - b).abs().max().item() > 1e-3 for a, b in zip(plain, elsewhere))  # the dropout draws count


def lstm_outputs_after_a_checkpoint(device: torch.device):
    """The LSTM's next training forward after Training.state_dict() (a checkpoint), going on; and after restore_rng of
    the state that checkpoint saved (a resume)."""
    import tiny

    from ddp_tricks.training.state import Best, restore_rng

    torch.manual_seed(0)
    model = TwoLayerLSTM().to(device).train()
    x = torch.randn(8, 6, 4, device=device)
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.1), best=Best("loss", "min"))
    t.device = device
    with torch.no_grad():
        model(x)  # cuDNN's dropout state drawn and cached, as after the steps before the checkpoint
        state = t.state_dict()
        going_on = model(x)
        restore_rng(state["rng"][0])
        resumed = model(x)
    return going_on, resumed


@cuda_test
def test_after_a_checkpoint_cudnn_rnn_dropout_draws_what_the_resumed_run_draws():
    """A mid-epoch resume sets torch's CUDA generator from the checkpoint, which makes cuDNN draw its RNN dropout
    state anew; the run that wrote the checkpoint goes on with the same draws. Fails when Training.state_dict only
    reads the random state (the run going on keeps cuDNN's cached dropout state: a resume is not bit-exact)."""
    going_on, resumed = lstm_outputs_after_a_checkpoint(torch.device("cuda"))
    torch.testing.assert_close(going_on, resumed, rtol=0, atol=0)
