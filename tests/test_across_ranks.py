"""Models as users bring them, across ranks (#28): weights tied across modules under FSDP (one unit for the modules
that share a parameter, the tie kept through checkpoints, resume and export), a frozen backbone under DDP and FSDP,
parameters a step does not use (a line at start, or a line within seconds of the step, never a hang), and a rank
that fails or stops answering (the job ends within seconds, the error shown once)."""

import os
import signal
import time

import pytest
import torch
from multiproc import RUN_PY, Job, free_port, full_state, launch, preempted, run_ranks
from resumed import assert_resumed, final_step, saved_state
from torch import nn

import run
from ddp_tricks.distributed import fsdp
from ddp_tricks.errors import UserError


class Tied(nn.Module):
    """A small language model whose output projection is its input embedding (GPT-2 style), written as a user
    writes one: children embed, blocks, norm, out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.norm(self.blocks(self.embed(tokens))))


class SharedModule(nn.Module):
    """One module under two children (`a.0` and `b.1`) and the root (`shared`)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.a = nn.Sequential(self.shared)
        self.b = nn.Sequential(nn.ReLU(), self.shared)


def test_default_units_keep_modules_that_share_a_parameter_in_one_unit():
    model = Tied()
    units = fsdp.default_units(model)
    assert units == [model.blocks, model.norm, [model.embed, model.out]]
    shared = SharedModule()  # its own unit first (the smallest), so `a` and `b` skip it: nothing to merge
    assert fsdp.default_units(shared) == [shared.shared, shared.a, shared.b]
    lonely = nn.Module()  # a child that shares its weight with the root's own parameter: left to the root
    lonely.head = nn.Linear(3, 3)
    lonely.weight = lonely.head.weight
    lonely.other = nn.Linear(3, 3)
    assert fsdp.default_units(lonely) == [lonely.other]


def test_shard_units_that_split_a_shared_parameter_are_one_line_before_any_process_group(tmp_path, capsys):
    (tmp_path / "split.py").write_text(
        "from examples.language_model import PythonSourceLM\n\n\n"
        "class Split(PythonSourceLM):\n"
        "    def shard_units(self, model):\n"
        "        return [*model.blocks.layers, model.embed]\n"
    )
    lm = ["--task", f"{tmp_path / 'split.py'}:Split", "--tie-weights", "--max-sequences", "40", "--width", "8",
          "--heads", "2", "--max-length", "16"]  # fmt: skip
    assert run.main(["--strategy", "fsdp", *lm, "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "runs").exists()
    assert "modules 'embed' and 'head' share a parameter ('embed.weight' = 'head.weight')" in err
    assert "the unit 'embed' and the rest of the model (its root)" in err
    assert "a list [model.embed, model.head]" in err
    model = SharedModule()

    class Both:
        def shard_units(self, model):
            return [model.a, model.b]

    with pytest.raises(UserError, match="module 'shared' sits under two of the task's shard_units"):
        fsdp.shard_units(Both(), model)


def _tied_on_default_units(rank, world_size, folder):
    """A tied model on default units: 3 SGD steps on this rank's half of each batch, then a sharded checkpoint
    (the template's) written and read back into a fresh tied model."""
    from ddp_tricks.storage import sharded

    model = Tied()
    fsdp.shard(model, fsdp.default_units(model))
    tied_after_sharding = model.embed.weight is model.out.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens, targets = torch.randint(0, 10, (2, 4, 5), generator=generator)
        half = slice(rank * 2, rank * 2 + 2)
        nn.functional.cross_entropy(model(tokens[half]).flatten(0, 1), targets[half].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = sharded.save({"model": model.state_dict()}, folder, "tied", rank == 0)
    again = Tied()
    fsdp.shard(again, fsdp.default_units(again))
    state = sharded.fill(sharded.read(saved), saved, again)
    again.load_state_dict(state["model"])
    whole = sharded.full_weights(again)
    return tied_after_sharding, again.embed.weight is again.out.weight, whole


def _frozen_backbone(rank, world_size):
    """A backbone with requires_grad=False and a trained head, 5 steps of LARS, LAMB and Lookahead(LARS): under
    FSDP (default units: the frozen ones get no gradient) and under DDP. Returns {(strategy, optimizer): weights}."""
    from ddp_tricks.optim import build as optimizers

    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(5, 8, 64, generator=generator), torch.randint(0, 10, (5, 8), generator=generator)
    results = {}
    for strategy in ("fsdp", "ddp"):
        for name, options in FROZEN_OPTIMIZERS.items():
            model = _backbone_and_head()
            trained = model
            if strategy == "fsdp":
                fsdp.shard(model, fsdp.default_units(model))
            else:
                trained = nn.parallel.DistributedDataParallel(model)
            optimizer = optimizers.build(model, weight_decay=1e-3, **options)
            half = slice(rank * 4, rank * 4 + 4)
            for x, y in zip(inputs, targets):
                nn.functional.cross_entropy(trained(x[half]), y[half]).backward()
                optimizer.step()
                optimizer.zero_grad()
            full = [p.full_tensor() if strategy == "fsdp" else p.detach().clone() for p in model.parameters()]
            results[strategy, name] = full
    return results


FROZEN_OPTIMIZERS = {
    "lars": {"name": "lars", "lr": 0.5, "trust_coefficient": 0.02},
    "lamb": {"name": "lamb", "lr": 0.01},
    "Lookahead(LARS)": {"name": "lars", "lr": 0.5, "trust_coefficient": 0.02, "lookahead": True, "lookahead_k": 2},
}


def _backbone_and_head():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    return model


def _tied_and_frozen(rank, world_size, folder):
    return _tied_on_default_units(rank, world_size, folder), _frozen_backbone(rank, world_size)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_default_units_train_tied_and_frozen_models_like_one_process_and_keep_the_tie_through_a_checkpoint(tmp_path):
    """Tied: 3 SGD steps equal one process's, and the sharded checkpoint loads into a fresh tied model with its tie.
    Frozen backbone: 5 steps of LARS, LAMB and Lookahead(LARS), under FSDP and DDP, equal one process's."""
    from ddp_tricks.optim import build as optimizers

    ((tied, tied_again, whole), results), _ = run_ranks(_tied_and_frozen, 2, tmp_path)
    reference = Tied()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens, targets = torch.randint(0, 10, (2, 4, 5), generator=generator)
        nn.functional.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert tied and tied_again
    assert whole.keys() == reference.state_dict().keys()  # both names, as a plain state dict has them
    for name, value in reference.state_dict().items():
        assert torch.allclose(whole[name], value, atol=1e-6), name
    fresh = Tied()
    fresh.load_state_dict(whole)
    assert fresh.embed.weight is fresh.out.weight

    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(5, 8, 64, generator=generator), torch.randint(0, 10, (5, 8), generator=generator)
    for name, options in FROZEN_OPTIMIZERS.items():
        model = _backbone_and_head()
        frozen = [p.detach().clone() for p in model.parameters()][:4]
        optimizer = optimizers.build(model, weight_decay=1e-3, **options)
        for x, y in zip(inputs, targets):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        expected = list(model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(expected[:4], frozen))  # the backbone did not move
        assert not torch.equal(expected[-1], _backbone_and_head()[-1].bias)  # the head did
        for strategy in ("fsdp", "ddp"):
            got = results[strategy, name]
            assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(got, expected)), (strategy, name)


def test_a_parameter_no_step_uses_is_refused_at_start_in_one_line(tmp_path, capsys, monkeypatch):
    """Under DDP on several processes (here: rank 0 of 2, refused before joining), without the flag."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = ["--task", "tests/rank_tasks.py:NeverUsedHead", "--runs-dir", str(tmp_path)]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not any(tmp_path.iterdir())
    assert "parameters 'aux.weight', 'aux.bias' get no gradient from the task's loss on 4 training samples" in err
    assert "pass --find-unused-parameters if some batches use them, or freeze them (requires_grad=False)" in err


def test_the_start_up_check_passes_frozen_and_used_parameters_and_changes_nothing():
    from ddp_tricks import cli
    from ddp_tricks.training import seam

    for name in ("SometimesAux", "FrozenBackbone"):
        flags, task_class = cli.parse(["--task", f"tests/rank_tasks.py:{name}", "--model", "toy3"])
        task = task_class(flags)
        train_set, _ = task.datasets()
        model = task.model()
        seam.check_task(task, model, train_set)
        buffers = [b.clone() for b in model.buffers()]
        assert buffers  # the toy model's BatchNorm statistics
        rng = torch.get_rng_state()
        seam.check_unused_parameters(task, model, train_set)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))
        assert all(p.grad is None for p in model.parameters()) and model.training


def _elapsed(args, stamps, timeout=120, stop_others=False):
    """run.py ARGS on 2 warm ranks, by default left to end by themselves: no launcher stops the survivor, as none
    does for the ranks of another node (stop_others: torchrun's agent on one node stops it). (The job, its stderr,
    seconds from the last training step any rank stamped to the end of the last rank.) Measured from the step, not
    the launch: start-up under a loaded machine is no part of the promise."""
    with Job(args, env=dict(os.environ, STEP_TIMES=str(stamps)), stop_others=stop_others) as job:
        _, err = job.communicate(timeout=timeout)
    ended = time.time()
    times = [float(t) for path in stamps.parent.glob(stamps.name + ".*") for t in path.read_text().split()]
    assert times, err[-3000:]
    return job, err, ended - max(times)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_branch_some_batches_skip_ends_the_run_in_one_line_within_seconds_and_trains_with_the_flag(tmp_path):
    """Without --find-unused-parameters, with the default --dist-timeout (600 s): the first step where a rank skips
    the auxiliary head ends the job (a step in the first few: about 4 in 10 batches of 8 skip it), exit 2 on every
    rank, also where that step writes a row (its all-gather would pair with the other rank's pending bucket
    all-reduce). Broken on purpose: no wrap.check_every_gradient at a row's step: the job hangs (the 120 s wait)."""
    args = ["--task", "tests/rank_tasks.py:SometimesAux", "-b", "8", "-e", "1", "--no-progress",
            "--runs-dir", str(tmp_path)]  # fmt: skip
    job, err, seconds = _elapsed([*args, "-n", "without"], tmp_path / "steps")
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, err[-3000:]
    assert "parameters 'aux.weight', 'aux.bias' got no gradient in a training step" in errors[0]
    assert "pass --find-unused-parameters" in errors[0] and job.exitcodes == [2, 2], job.exitcodes
    assert "Traceback" not in err  # no worker's
    assert seconds < 30, seconds  # from the mismatched step (the last one stamped); a hang takes --dist-timeout
    trained = launch([*args, "-n", "with", "--find-unused-parameters"])
    assert trained.returncode == 0, trained.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("agent", [False, True], ids=["ranks-alone", "agent-stops-the-rest"])
def test_a_rank_that_fails_in_its_fifth_step_ends_the_job_within_seconds_its_error_shown_once(tmp_path, agent):
    """Alone (another node's ranks), rank 0 ends by itself with the job's code; on one node, torchrun's agent sends
    it SIGTERM once rank 1 has failed, while it waits in the step's all-reduce: it ends quietly either way."""
    args = ["--task", "tests/rank_tasks.py:FailsOnRank1", "-b", "8", "--no-progress", "--runs-dir", str(tmp_path)]
    job, err, seconds = _elapsed(args, tmp_path / "steps", stop_others=agent)
    assert job.exitcodes[1] == 1 and seconds < 30, (job.exitcodes, seconds, err[-3000:])  # from the failing step
    assert job.exitcodes[0] in ((1, 143, -signal.SIGTERM) if agent else (1,)), (job.exitcodes, err[-3000:])
    assert err.count("RuntimeError: rank 1 breaks in its fifth step") == 1, err[-3000:]
    assert err.count("Traceback") == 1  # rank 1's: rank 0 ends quietly
    assert "Connection closed" not in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_mistake_every_rank_finds_is_said_though_the_launcher_stops_rank_0_before_it_has(tmp_path):
    """Rank 1 leaves first (rank 0 says the mistake), and the launcher, as torchrun's agent does, then sends rank 0
    SIGTERM while it still checks. Rank 0 still says it, once, and ends with 2 (watchdog.hold_sigterm). Before,
    SIGTERM killed it unheard: exit codes [-15, 2] and no error line."""
    args = ["--task", "tests/rank_tasks.py:MistakeBeforeTheGroup", "--no-progress", "--runs-dir", str(tmp_path)]
    result = launch(args, timeout=60)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.exitcodes == [2, 2], (result.exitcodes, result.stderr[-3000:])
    assert errors == ["error: the task's data is wrong (a test's own mistake)"], result.stderr[-3000:]


def gloo_timeout(group) -> float:
    """The seconds a gloo group's collectives wait for a peer, read back from its backend (torch >= 2.6)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _joined_timeouts(rank, world_size, port):
    """launch.setup as run.py calls it with --dist-timeout 7 (after the harness's group is gone): every rank of
    `world_size` > 1 joins afresh on `port`; one process gets a group of its own (FSDP's mesh of one). The default
    group's and the control group's timeouts."""
    import torch.distributed as dist

    from ddp_tricks.distributed import launch as launching

    dist.destroy_process_group()
    if world_size == 1:
        del os.environ["RANK"]  # plain `python run.py`: no launcher, a group of one only for FSDP
    os.environ["MASTER_PORT"] = str(port)
    joined = launching.setup(launching.detect(), "cpu", "gloo", 7, group=True)
    try:
        return gloo_timeout(dist.group.WORLD), gloo_timeout(joined.control_group)
    finally:
        launching.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_control_group_waits_as_long_as_dist_timeout(world_size):
    """Preemption's gloo group (an agreement there waits for every rank) takes --dist-timeout, as the default group
    does, when torchrun starts the ranks and for one process's FSDP group alike. Fails when it is made without the
    timeout: gloo's default of 30 minutes (1800 s)."""
    for timeouts in run_ranks(_joined_timeouts, world_size, free_port(), timeout=60):
        assert timeouts == (7.0, 7.0)


SLOW_START = """
import os, runpy, sys, time
if os.environ["RANK"] == "0":  # a slow start (a loaded machine, a fresh interpreter): SIGTERM not held yet
    time.sleep(2)
sys.argv[0] = {run_py!r}
runpy.run_path({run_py!r}, run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_mistake_every_rank_finds_is_said_though_rank_0_starts_after_the_others_have_failed(tmp_path):
    """Rank 0 starts 2 s late, before run.py holds SIGTERM; rank 1 finds the mistake meanwhile. Rank 1 lingers
    (watchdog.linger) until rank 0 has said it and ended, and the launcher's SIGTERM then ends rank 1. Broken on
    purpose (no linger): rank 1 ends at once, the launcher's SIGTERM kills rank 0 while it starts: [-15, 2], no line."""
    (tmp_path / "slow_start.py").write_text(SLOW_START.format(run_py=str(RUN_PY)))
    args = ["--task", "tests/rank_tasks.py:MistakeBeforeTheGroup", "--no-progress", "--runs-dir", str(tmp_path)]
    with Job(args, script=tmp_path / "slow_start.py") as job:
        _, err = job.communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert job.exitcodes == [2, 2], (job.exitcodes, err[-3000:])
    assert errors == ["error: the task's data is wrong (a test's own mistake)"], err[-3000:]


HELD = """
import os, signal, sys, time
from ddp_tricks.distributed import watchdog
def sigterm():
    print(time.time(), file=sys.stderr)  # when it was sent
    os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "checking":  # run.py before its process group
    watchdog.hold_sigterm()
    sigterm()
    print("checked")
    watchdog.joining()
    print("joined")
else:  # a failing process, SIGTERM while it says why
    watchdog.fail(2)
    sigterm()
    time.sleep(0.5)
    print("said why")
    if sys.argv[1] == "stuck":
        time.sleep(60)
    sys.exit(2)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "code", "said"), [("checking", 143, "checked\n"), ("failing", 2, "said why\n"),
                                                    ("stuck", 143, "said why\n")])  # fmt: skip
def test_a_held_sigterm_lets_a_process_say_why_then_ends_it(tmp_path, mode, code, said):
    """A SIGTERM before the process group ends the process when it would join (143); one after a failure leaves it
    to say why and end by itself (2), or ends it HOLD seconds later (143); the handler is put back after."""
    from ddp_tricks.distributed import watchdog

    script = tmp_path / "held.py"
    script.write_text(HELD)
    with Job([mode], nproc=None, script=script) as job:
        out, err = job.communicate(timeout=30)
    assert (job.returncode, out) == (code, said), err[-3000:]
    elapsed = time.time() - float(err.split()[0])  # from the SIGTERM to the end
    assert elapsed > watchdog.HOLD if mode == "stuck" else elapsed < watchdog.HOLD, elapsed
    before = signal.getsignal(signal.SIGTERM)  # this process's: hold and restore (as main() does at its end)
    watchdog.hold_sigterm()
    assert signal.getsignal(signal.SIGTERM) is not before
    watchdog.restore_signals()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_ends_workers_stuck_in_a_collective_within_seconds(tmp_path):
    """Rank 1 stops answering; rank 0 waits for it in a gradient all-reduce. SIGTERM to both, as torchrun forwards
    it (it would SIGKILL 30 s later): both workers end on their own, --sigterm-grace (here 5 s) after it."""
    stuck = tmp_path / "stuck"
    args = ["--task", "tests/rank_tasks.py:StuckOnRank1", "-b", "8", "--no-progress", "--runs-dir", str(tmp_path),
            "--sigterm-grace", "5"]  # fmt: skip
    with Job(args, env=dict(os.environ, STUCK_FILE=str(stuck)), stop_others=False) as job:
        deadline = time.time() + 90
        while not stuck.exists() and time.time() < deadline and job.poll() is None:
            time.sleep(0.05)
        time.sleep(1)  # rank 0 is in the step's all-reduce by now
        sent = time.time()
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    assert stuck.exists() and time.time() - sent < 20, err[-3000:]
    assert job.exitcodes == [143, 143], (job.exitcodes, err[-3000:])  # each on its own, none killed


LM = ["--task", "examples/language_model.py:PythonSourceLM", "--tie-weights", "--max-sequences", "89",
      "--max-length", "32", "--width", "16", "--depth", "2", "--heads", "2", "-b", "4", "-e", "2", "--no-progress",
      "--optimizer", "lamb", "-l", "0.01"]  # fmt: skip  # 80 training sequences: 10 steps of 8 per epoch, 20 in all


def _exported(path):
    return full_state(path)["model"]


def _tied_lm(weights):
    """The example's tied model with `weights` loaded (strictly), as a user loads best.pt or an export."""
    from examples.language_model import CausalTransformer

    model = CausalTransformer(16, 2, 2, 32, tie=True)
    model.load_state_dict(weights)
    assert model.head.weight is model.embed.weight
    return model


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_tied_language_model_under_fsdp_equals_ddp_resumes_bit_identically_and_loads_with_its_tie(tmp_path):
    runs = ["--runs-dir", str(tmp_path)]
    ddp = launch([*LM, *runs, "-n", "ddp"])
    full = launch([*LM, *runs, "-n", "full", "--strategy", "fsdp"])
    assert ddp.returncode == 0 and full.returncode == 0, ddp.stderr[-2000:] + full.stderr[-2000:]
    out, err = preempted([*LM, *runs, "-n", "pre", "--strategy", "fsdp", "--checkpoint-every-steps", "3"],
                         tmp_path / "pre" / "last.dcp")  # fmt: skip
    assert "preempted" in out, (out + err)[-3000:]
    saved = saved_state(tmp_path / "pre" / "last.dcp")  # before the resume replaces it
    resumed = launch([*LM, *runs, "-n", "pre", "--strategy", "fsdp", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed.stdout, saved, final_step(tmp_path / "full"))
    assert (tmp_path / "pre" / "metrics.csv").read_text().count("\n") == 3

    whole = torch.load(tmp_path / "ddp" / "last.pt", weights_only=True)["model"]
    sharded_full, sharded_resumed = _exported(tmp_path / "full" / "last.dcp"), _exported(tmp_path / "pre" / "last.dcp")
    assert whole.keys() == sharded_full.keys() == sharded_resumed.keys()
    for name in whole:  # 20 LAMB steps: FSDP within 1e-5 of DDP, the resumed run bit-identical to the full one
        assert torch.allclose(sharded_full[name], whole[name], atol=1e-5, rtol=0), name
        assert torch.equal(sharded_resumed[name], sharded_full[name]), name
    assert torch.equal(sharded_resumed["head.weight"], sharded_resumed["embed.weight"])  # still one parameter
    _tied_lm(sharded_resumed)
    best = torch.load(tmp_path / "pre" / "best.pt", weights_only=True)["model"]
    model = _tied_lm(best)
    assert torch.equal(model.head.weight, best["head.weight"]) and torch.equal(model.head.weight, best["embed.weight"])
