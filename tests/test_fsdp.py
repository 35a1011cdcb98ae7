"""Sharded training, `--strategy fsdp` (#21): the template's loop on FSDP2 shards gives a single process's weights
for every optimizer (accumulation and clipping too), LARS / LAMB / Lookahead are exact on shards with one
all-reduce per step for all the norms, and sharded checkpoints resume exactly, at another world size too, and
survive a kill mid-write."""

import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from multiproc import full_state, launch, preempted, run_ranks, torchrun
from resumed import assert_resumed, final_step, saved_state
from torch import nn

import run
from ddp_tricks.storage import checkpoint

OPTIMIZERS = {  # name -> (optimizer flags of optimizers.build, LR)
    "sgd": ({"name": "sgd"}, 0.1),
    "adamw": ({"name": "adamw"}, 0.01),
    "lars": ({"name": "lars", "trust_coefficient": 0.02}, 0.5),
    "lars, bn/bias apart": ({"name": "lars", "trust_coefficient": 0.02, "bn_bias_separately": True}, 0.5),
    "LARSWrapper(AdamW)": ({"name": "adamw", "lars_wrap": True, "trust_coefficient": 0.02}, 0.01),
    "lamb": ({"name": "lamb"}, 0.01),
    "Lookahead(LARS)": ({"name": "lars", "trust_coefficient": 0.02, "lookahead": True, "lookahead_k": 2}, 0.5),
}
GLOBAL_BATCH, STEPS = 24, 5


def _mlp(dtype=torch.float32):
    """No BatchNorm (its statistics are per rank by design); a LayerNorm, whose parameters bn/bias exclusion
    keeps out of LARS."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10)).to(dtype)


SETTINGS = {"plain": (1, 0.0), "accum-2": (2, 0.0), "clip": (1, 0.05)}  # (--accum-steps, --clip-grad-norm)


def _train(rank, world_size, sharded):
    """Every optimizer in every setting, STEPS steps of the template's loop on the digits, global batch 24: on
    `world_size` ranks (sharded with FSDP2, or one process). Returns {(setting, optimizer): full weights}."""
    from ddp_tricks import plan
    from ddp_tricks.data import images

    train_set, _ = images.digits()
    results = {}
    for setting, (accum, clip) in SETTINGS.items():
        micro = GLOBAL_BATCH // world_size // accum
        the_plan = plan.make(
            num_train=len(train_set),
            world_size=world_size,
            micro_batch=micro,
            accum_steps=accum,
            epochs=1,
            seed=0,
            base_lr=0.1,
            lr_scaling="keep",
            base_batch=24,
            warmup_epochs=0,
        )
        results |= _train_setting(rank, world_size, sharded, the_plan.epoch(1, rank)[:STEPS], clip, setting)
    return results


def _train_setting(rank, world_size, sharded, steps, clip, setting):
    from tiny import CPU, Classify

    from ddp_tricks.data import images, loaders
    from ddp_tricks.distributed import fsdp
    from ddp_tricks.optim import build as optimizers
    from ddp_tricks.schedules.curves import WarmupDecay
    from ddp_tricks.schedules.schedule import Schedule
    from ddp_tricks.training.loop import train_one_epoch
    from ddp_tricks.training.precision import Precision
    from ddp_tricks.training.state import Training

    train_set, _ = images.digits()
    results = {}
    for name, (options, lr) in OPTIMIZERS.items():
        model = _mlp()
        if sharded:
            model = fsdp.shard(model, fsdp.shard_units(Classify(), model))
        options = dict(options)
        optimizer = optimizers.build(model, options.pop("name"), lr=lr, weight_decay=1e-3, **options)
        t = Training(model, optimizer, Schedule(WarmupDecay(optimizer, 0, 0)), Classify(), ["acc"],
                     Precision("off", CPU, mesh=fsdp.mesh_of(model)), CPU, clip_grad_norm=clip, rank=rank,
                     world_size=world_size)  # fmt: skip
        loader = loaders.train_loader(train_set, rank, CPU, seed=0)
        loader.batch_sampler.start(steps)
        train_one_epoch(t, steps, loader)
        results[setting, name] = [p.full_tensor() if sharded else p.detach().clone() for p in model.parameters()]
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_training_gives_a_single_process_s_weights_with_accumulation_and_clipping():
    expected = _train(0, 1, False)
    for world_size in (2, 3):
        got = run_ranks(_train, world_size, True, timeout=400)[0]
        for key in expected:
            worst = max((a - b).abs().max().item() for a, b in zip(got[key], expected[key]))
            assert worst <= 1e-5, (world_size, key, worst)


def _grads(step, model):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in model.parameters()]


def _optimizer_alone(name, model):
    from ddp_tricks.optim import build as optimizers

    options, lr = OPTIMIZERS[name]
    options = dict(options)
    return optimizers.build(model, options.pop("name"), lr=lr, weight_decay=1e-3, **options)


def _sharded_float64_steps(rank, world_size):
    """Each optimizer alone on FSDP2 shards in float64, gradients given: the full weights after 4 steps and how
    many all-reduces each step made (any collective a DTensor op would start is counted too)."""
    from torch.distributed import _functional_collectives as functional
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    results = {}
    for name in OPTIMIZERS:
        model = _mlp(torch.float64)
        for unit in (model[1], model[2], model[4]):
            fully_shard(unit)
        fully_shard(model)
        optimizer = _optimizer_alone(name, model)
        counts = []
        for step in range(4):
            for p, g in zip(model.parameters(), _grads(step, model)):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            calls = []
            saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
            saved_functional = {n: getattr(functional, n) for n in ("all_reduce", "all_gather_tensor")}
            for n, fn in saved.items():
                setattr(dist, n, lambda *a, _n=n, _fn=fn, **k: calls.append(_n) or _fn(*a, **k))
            for n, fn in saved_functional.items():
                setattr(functional, n, lambda *a, _n=n, _fn=fn, **k: calls.append(_n) or _fn(*a, **k))
            try:
                optimizer.step()
            finally:
                for n, fn in saved.items():
                    setattr(dist, n, fn)
                for n, fn in saved_functional.items():
                    setattr(functional, n, fn)
            counts.append(calls)
        results[name] = ([p.full_tensor() for p in model.parameters()], counts)
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_lars_lamb_lookahead_are_exact_on_shards_with_one_all_reduce_per_step(world_size):
    got = run_ranks(_sharded_float64_steps, world_size, timeout=240)[0]
    for name in OPTIMIZERS:
        model = _mlp(torch.float64)
        optimizer = _optimizer_alone(name, model)
        for step in range(4):
            for p, g in zip(model.parameters(), _grads(step, model)):
                p.grad = g
            optimizer.step()
        weights, counts = got[name]
        assert max((a - b.detach()).abs().max().item() for a, b in zip(weights, model.parameters())) <= 1e-10, name
        layer_wise = "lars" in name.lower() or name == "lamb"
        # one all-reduce for every norm of the step (7 tensors), not one per tensor; the others need none
        assert counts == [["all_reduce"] if layer_wise else []] * 4, (name, counts)


# ---------------------------------------------------------------- run.py --strategy fsdp on 2 ranks

FLAGS = ["--strategy", "fsdp", "--no-progress", "--optimizer", "lamb", "-l", "0.01", "--lookahead", "-b", "16",
         "--log-interval", "5"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """One 2-epoch --strategy fsdp run under torchrun, as a user launches it, shared by the tests below that need
    a finished sharded run (they copy it before changing anything)."""
    runs = tmp_path_factory.mktemp("sharded")
    full = torchrun([*FLAGS, "--runs-dir", str(runs), "-n", "full", "-e", "2"])
    assert full.returncode == 0, full.stderr[-3000:]
    return runs / "full"


def _rows(run_dir):
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    keep = [i for i, h in enumerate(header) if h not in ("epoch_seconds", "samples_per_second")]
    return [[row.split(",")[i] for i in keep] for row in lines]


@pytest.mark.xdist_group("fsdp-sharded-run")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_and_resume_under_fsdp_are_bit_identical(sharded_run, tmp_path):
    argv = [*FLAGS, "--runs-dir", str(tmp_path), "-n", "pre", "-e", "2", "--checkpoint-every-steps", "10"]
    out, err = preempted(argv, tmp_path / "pre" / "last.dcp")
    assert "preempted" in out, (out + err)[-3000:]
    saved = saved_state(tmp_path / "pre" / "last.dcp")  # before the resume replaces it
    resumed = launch([*FLAGS, "--runs-dir", str(tmp_path), "-n", "pre", "-e", "2", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, saved, final_step(sharded_run))
    assert _rows(tmp_path / "pre") == _rows(sharded_run)
    a = torch.load(tmp_path / "pre" / "best.pt", weights_only=True)["model"]
    b = torch.load(sharded_run / "best.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # best.pt is a plain state dict of the whole model: it loads into the unwrapped model outside the template
    from ddp_tricks.models import build

    model = build("toy", 1, 10)
    model.load_state_dict(a)


def _reshard(rank, world_size, source, target):
    """Load the sharded checkpoint `source` on `world_size` ranks as run.py builds a run, and save it again,
    untouched, as `target` (a folder whose last.dcp then points to it)."""
    from tiny import CPU

    from ddp_tricks import cli
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.storage import checkpoint
    from ddp_tricks.training import preflight

    flags, task_class = cli.parse([*FLAGS, "-e", "1"])
    task = task_class(flags)
    train_set, _ = task.datasets()
    model = task.model()
    plan = run.make_plan(flags, len(train_set), world_size)
    plan, found = preflight.check(
        task, model, train_set, preflight.Setup(world_size, **cli.check_options(flags)), lambda _: plan
    )
    t = run.build_training(flags, task, model, found, plan, Dist(rank, world_size, rank, CPU, "gloo"))
    t.load_state_dict(checkpoint.load(source, "fsdp"), str(source))
    target.mkdir(exist_ok=True)
    checkpoint.Checkpoints(target, rank == 0, 0, None, vars(flags), "fsdp").save(t)
    return True


def _whole(path):
    return full_state(path)


@pytest.mark.xdist_group("fsdp-sharded-run")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_resumes_2_to_3_and_3_to_1_with_the_same_full_state(sharded_run, tmp_path):
    saved = _whole(sharded_run / "last.dcp")
    assert saved["optimizer"] and len(saved["model"]) == len(torch.load(sharded_run / "best.pt")["model"])
    run_ranks(_reshard, 3, sharded_run / "last.dcp", tmp_path / "three", timeout=240)
    run_ranks(_reshard, 1, tmp_path / "three" / "last.dcp", tmp_path / "one", timeout=240)
    for name in ("three", "one"):
        again = _whole(tmp_path / name / "last.dcp")
        for part in ("model", "optimizer"):
            assert again[part].keys() == saved[part].keys()
            assert all(torch.equal(again[part][k], saved[part][k]) for k in saved[part]), (name, part)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kill_during_a_sharded_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    """A checkpoint every 2 steps; rank 1 SIGKILLs itself 1000 bytes into its shard file of the second one
    (killed_writes.py): that file is left half-written in a checkpoint folder of its own, and last.dcp still names
    the first checkpoint, whole, which a resume loads. Broken on purpose: last.dcp moved to the new folder before its
    files are written (sharded.py) leaves it naming the torn one."""
    flags = [*FLAGS, "--task", "tests/killed_writes.py:ShardWriteKilled", "--runs-dir", str(tmp_path), "-n", "k",
             "-e", "1", "--checkpoint-every-steps", "2"]  # fmt: skip
    killed = launch(flags, env=os.environ | {"KILL_SHARD_WRITE": "1:2:1000"}, timeout=180)
    assert killed.exitcodes[1] == -signal.SIGKILL and killed.returncode != 0, (killed.exitcodes, killed.stderr[-3000:])
    run_dir = tmp_path / "k"
    kept = (run_dir / "last.dcp").resolve()
    (torn,) = [f for f in (run_dir / "sharded").iterdir() if f != kept]
    assert (torn / "__1_0.distcp").stat().st_size == 1000 and not (torn / "state.pt").exists()
    assert kept.name.startswith("step-000000002-") and (kept / "state.pt").exists() and (kept / ".metadata").exists()
    assert _whole(run_dir / "last.dcp")["model"] and checkpoint.load(kept, "fsdp")["global_step"] == 2
    resumed = launch([*flags, "--resume", "auto", "--eval-only"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.xdist_group("fsdp-sharded-run")  # on one worker: the module's shared run is made once
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_of_the_other_strategy_or_with_a_missing_shard_is_one_line(sharded_run, tmp_path, capsys):
    ddp = launch(["--no-progress", "--runs-dir", str(tmp_path), "-n", "d", "-e", "1"], nproc=None)  # a ddp last.pt
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    shutil.copytree(sharded_run, tmp_path / "f", symlinks=True)  # last.dcp is a relative link: it follows the copy
    shards = sorted((tmp_path / "f" / "last.dcp").resolve().glob("*.distcp"))
    cases = [
        ([*FLAGS, "-n", "d", "--resume", "auto"], "was written by --strategy ddp: resume that run with the strategy"),
        (["--no-progress", "-n", "f", "--resume", "auto"], "was written by --strategy fsdp"),
        (["--no-progress", "-n", "x", "--resume", str(tmp_path / "f" / "last.dcp")], "is sharded (written by "
         "--strategy fsdp): resume it with --strategy fsdp"),
        ([*FLAGS, "-n", "x", "--resume", str(tmp_path / "f" / "best.pt")], "holds the model's weights only"),
    ]  # fmt: skip
    for argv, message in cases:  # found before any process group: one process says it as every rank would
        assert run.main([*argv, "--runs-dir", str(tmp_path), "-e", "3"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    shards[1].unlink()
    missing = launch([*FLAGS, "--runs-dir", str(tmp_path), "-n", "f", "-e", "3", "--resume", "auto"])
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"misses 1 of its shard files ({shards[1].name})" in errors[0], (
        missing.exitcodes, missing.stderr[-3000:])  # fmt: skip
    assert shards[0].exists() and missing.returncode == 2


def test_what_fsdp_does_not_take_is_one_line(tmp_path, capsys):
    cases = [
        (["--batch-trace", "examples/traces/doubling.csv"], "--strategy fsdp does not take --batch-trace"),
        (["--static-graph"], "--static-graph acts only with --strategy ddp"),
        (["--bucket-cap-mb", "50"], "--bucket-cap-mb acts only with --strategy ddp"),
        (["--sync-bn"], "--sync-bn converts BatchNorm for DistributedDataParallel"),
        (["--channels-last"], "--channels-last gives convolution weights a memory order FSDP2 cannot shard"),
    ]
    for extra, message in cases:
        assert run.main(["--strategy", "fsdp", *extra, "--runs-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_a_dangling_last_dcp_or_a_ddp_file_given_to_fsdp_is_one_line(tmp_path, capsys):
    from ddp_tricks.storage import checkpoint

    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "last.dcp").symlink_to(tmp_path / "gone" / "sharded" / "step-000000010")
    checkpoint.save({"model": {}, "epoch": 1, "optimizer": {}, "strategy": "ddp"}, tmp_path / "whole.pt")
    cases = [
        (["-n", "gone", "--resume", "auto"], "which is gone: the run's checkpoint was moved or deleted"),
        (["-n", "x", "--resume", str(tmp_path / "whole.pt")], "holds a whole state written by --strategy ddp"),
    ]
    for extra, message in cases:
        assert run.main(["--strategy", "fsdp", *extra, "--runs-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert (tmp_path / "gone" / "last.dcp").is_symlink() and not (tmp_path / "x").exists()


class _Nested(nn.Module):
    """A unit inside another, and a module reachable under two names (`shared` and `block.0`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6)
        self.block = nn.Sequential(self.shared, nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.block(x))


def _nested_units(rank, world_size):
    from ddp_tricks.distributed import fsdp

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    expected = _Nested()(x)
    model = _Nested()
    fsdp.shard(model, [model.block, model.shared, model.block, model.head])  # outer first, one twice
    out = model(x)
    out.sum().backward()
    return torch.equal(out.detach(), expected.detach()), [p.grad is not None for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_units_inside_other_units_shared_or_repeated_are_each_sharded_once_inner_first():
    for same, grads in run_ranks(_nested_units, 2):
        assert same and all(grads)


BAD_UNITS = """
from torch import nn

from task import Task


class NewUnits(Task):
    def shard_units(self, model):
        return [nn.Linear(2, 2)]
"""


def test_shard_units_that_are_not_the_model_s_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(BAD_UNITS)
    argv = ["--strategy", "fsdp", "--task", f"{tmp_path / 'bad.py'}:NewUnits", "--runs-dir", str(tmp_path / "runs")]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shard_units() gave Linear, which is not a submodule of its model" in err
    assert not (tmp_path / "runs").exists()


def _inf_in_one_rank_s_slice(rank, world_size):
    """fp16 under FSDP: an inf in rank 1's gradient slices only; every rank must skip the step together."""
    from tiny import CPU

    from ddp_tricks.distributed import fsdp
    from ddp_tricks.shards import local
    from ddp_tricks.training.precision import Precision

    model = _mlp()
    fsdp.shard(model, [model[1], model[4]], torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", CPU, mesh=fsdp.mesh_of(model))
    before = [p.full_tensor() for p in model.parameters()]
    x, y = torch.randn(4, 64), torch.tensor([0, 1, 2, 3])
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    precision.backward(loss, optimizer)
    if rank == 1:
        local(model[1].weight.grad).fill_(float("inf"))
    scale = precision.scaler.get_scale()
    took = precision.step(optimizer, list(model.parameters()))
    after = [p.full_tensor() for p in model.parameters()]
    return took, precision.scaler.get_scale() < scale, all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fp16_under_fsdp_skips_a_step_on_every_rank_when_one_rank_s_slice_overflows():
    for took, scale_cut, unchanged in run_ranks(_inf_in_one_rank_s_slice, 2):
        assert not took and scale_cut and unchanged


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_runs_every_trick_and_its_evaluation_is_exact(tmp_path):
    """bf16 and fp16 (FSDP's policy), precise BN, plateau and early stopping, the language model's dict batches
    and per-token units on shards; the 2-rank evaluation equals one process's on best.pt's plain weights."""
    tricks = ["--precise-bn", "200", "--scheduler", "plateau", "--early-stop-patience", "2", "--accum-steps", "2",
              "--clip-grad-norm", "1"]  # fmt: skip
    # bf16 and fp16 (emulated on a CPU: 3x slower) in fewer, larger steps (-b 64): two epochs each all the same, so
    # training follows an evaluation and a second sharded checkpoint (with the GradScaler's state) replaces the first
    runs = {"bf16": ["--amp", "bf16", "-b", "64"], "fp16": ["--amp", "fp16", "-b", "64"], "tricks": tricks}
    for name, extra in runs.items():
        result = launch([*FLAGS, "--runs-dir", str(tmp_path), "-n", name, "-e", "2", *extra])
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert len(_rows(tmp_path / name)) == 3, name  # the header and both epochs
    lm = launch(["--strategy", "fsdp", "--task", "examples/language_model.py:PythonSourceLM", "--max-sequences",
                 "240", "--max-length", "32", "--width", "16", "--depth", "2", "--heads", "2", "-b", "4", "-e", "1",
                 "--no-progress", "--runs-dir", str(tmp_path), "-n", "lm", "--optimizer", "lamb"])  # fmt: skip
    assert lm.returncode == 0, lm.stderr[-3000:]
    from ddp_tricks import cli

    flags, task_class = cli.parse(["--precise-bn", "200"])
    task = task_class(flags)
    _, val = task.datasets()
    model = task.model()
    model.load_state_dict(torch.load(tmp_path / "tricks" / "best.pt", weights_only=True)["model"])
    model.eval()
    with torch.no_grad():
        logits = model(val.inputs)
    rows = (tmp_path / "tricks" / "metrics.csv").read_text().splitlines()
    header, best = (
        rows[0].split(","),
        min(rows[1:], key=lambda r: float(r.split(",")[rows[0].split(",").index("val_loss")])),
    )
    reported = float(best.split(",")[header.index("val_loss")])
    assert reported == pytest.approx(torch.nn.functional.cross_entropy(logits, val.targets).item(), rel=1e-5)
