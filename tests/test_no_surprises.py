"""No surprises (#12): the command line says what it does, checkpoints and traces fail in plain words, files get
the usual permissions, the sweep's defaults fit its epochs. Bad-flag messages: test_bad_input's catalogue."""

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys

import pytest
import torch
from multiproc import REPO
from resumed import assert_resumed
from sweep_harness import load_sweep, recording_sweep

import run
from ddp_tricks import cli as config
from ddp_tricks.storage import checkpoint
from ddp_tricks.traces import batch_trace
from ddp_tricks.traces import original_api as trace_api


@pytest.mark.parametrize("flag", ["-l", "--base-lr", "--learning-rate", "--learning_rate", "--lr"])
def test_every_spelling_of_the_learning_rate(flag):
    assert config.parse([flag, "0.3"])[0].base_lr == 0.3


# Each optimizer's default LR, as the grid on the built-in task picked it (docs/tricks.md): written here, not read
# from the code, so a changed default is a changed test. LARS's is ~100x SGD's (its trust ratio is about 1e-3).
DEFAULT_LRS = {
    ("sgd",): 0.05,
    ("adam",): 0.003,
    ("adamw",): 0.003,
    ("lars",): 5.0,
    ("lamb",): 0.02,
    ("sgd", "--lars-wrap"): 5.0,
    ("adam", "--lars-wrap"): 0.003,
    ("adamw", "--lars-wrap"): 0.003,
    ("lamb", "--lars-wrap"): 0.02,
}


@pytest.mark.parametrize("optimizer", DEFAULT_LRS, ids=[" ".join(k) for k in DEFAULT_LRS])
def test_each_optimizer_has_its_own_default_learning_rate(optimizer, tmp_path):
    argv = ["--optimizer", *optimizer]
    cfg = config.parse(argv)[0]
    assert (cfg.base_lr, cfg.base_lr_default) == (DEFAULT_LRS[optimizer], True)
    typed = config.parse([*argv, "--base-lr", "0.7"])[0]  # given, on the command line or in a file: it wins
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'optimizer = "{optimizer[0]}"\nbase-lr = 0.7\n')
    from_file = config.parse(["--config", str(recipe), *optimizer[1:]])[0]
    assert (typed.base_lr, typed.base_lr_default) == (from_file.base_lr, from_file.base_lr_default) == (0.7, False)


def test_the_start_line_says_the_learning_rate_is_the_optimizer_s_default(tmp_path):
    lars = config.parse(["--optimizer", "lars"])[0]
    assert config.describe_lr(lars, 5.0) == "learning rate 5 (the default for --optimizer lars; --base-lr to change)"
    wrapped = config.parse(["--optimizer", "sgd", "--lars-wrap", "--lr-scaling", "linear"])[0]
    assert config.describe_lr(wrapped, 2.5) == (
        "learning rate 2.5 (--base-lr 5, the default for --optimizer sgd --lars-wrap, with --lr-scaling linear)"
    )
    given = config.parse(["--optimizer", "lars", "-l", "2"])[0]
    assert config.describe_lr(given, 2.0) == "learning rate 2 (--lr-scaling keep)"
    assert run.main(["--optimizer", "lars", "-e", "1", "-b", "256", "--no-progress", "-n", "r", "--runs-dir",
                     str(tmp_path)]) == 0  # fmt: skip
    log = (tmp_path / "r" / "train.log").read_text()
    assert "learning rate 5 (the default for --optimizer lars; --base-lr to change)" in log
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (saved["base_lr"], saved["base_lr_default"], saved["effective_lr"]) == (5.0, True, 5.0)


def _help_entries(monkeypatch) -> dict[str, str]:
    """--help as {invocation: help text}, one entry per option, on one line each."""
    monkeypatch.setenv("COLUMNS", "1000")
    text = config.build_parser().format_help()
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            invocation, _, help_text = line.strip().partition("  ")
            current = invocation
            entries[current] = help_text.strip()
        elif current is not None and line.startswith("    ") and line.strip():
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


def test_help_shows_every_default_once(monkeypatch):
    entries = _help_entries(monkeypatch)
    with_value = {inv: text for inv, text in entries.items() if " " in inv.split(",")[0].strip()}
    assert len(with_value) > 40  # every option that takes a value (on/off flags are off unless given)
    for invocation, text in with_value.items():
        assert len(re.findall(r"[(;] ?default\b", text)) == 1, (invocation, text)
    assert entries["--step-gamma STEP_GAMMA"] == "step: LR multiplier at each decay (default: 0.1)"
    assert entries["--plateau-patience PLATEAU_PATIENCE"].endswith("(default: 2)")
    assert entries["--resume auto|PATH"].endswith("(default: none)")
    assert entries["-e EPOCHS, --epochs EPOCHS"] == "epochs to train (default: 10)"  # said once, not twice
    assert entries["--end-lr END_LR"].endswith("(default: 0)")
    assert entries["-l BASE_LR, --base-lr BASE_LR, --learning-rate BASE_LR, --learning_rate BASE_LR, --lr BASE_LR"] == (
        "learning rate before scaling (default: the optimizer's: sgd 0.05, adam 0.003, adamw 0.003, lars 5, lamb "
        "0.02, muon 0.003; with --lars-wrap: sgd 5, the others their own)"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["-t", "cosine"],  # cosine decay after warmup
        ["-t", "cosine", "--scheduler", "cosine", "--end-lr", "0.01"],  # says the same thing twice: fine
        ["-t", "cosine", "--scheduler", "constant"],
        ["--optimizer", "sgd", "--lars-wrap", "--trust-coefficient", "0.01", "--epsilon", "0"],
        ["--scheduler", "step", "--step-epochs", "0.5", "--step-gamma", "1"],
        ["--scheduler", "plateau", "--plateau-patience", "0", "--plateau-factor", "0.5"],
        ["--scheduler", "poly", "--lr-power", "2", "--end-lr", "0"],
        ["--lookahead", "--lookahead-k", "3", "--lookahead-alpha", "1"],
        ["--dist-timeout", "0.5"],
        ["--optimizer", "lars", "--momentum", "0.8", "--nesterov"],
        ["--lr-scaling", "sqrt", "--base-batch-size", "64"],
        ["--early-stop-patience", "2", "--early-stop-delta", "0.01"],
    ],
)
def test_flags_that_act_are_accepted(argv):
    config.parse(argv)


def test_config_does_not_import_torch():
    code = (
        "import sys; from ddp_tricks import cli as config; config.parse(['--epochs', '2', '-t', 'cosine']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_gets_the_permissions_of_any_new_file(umask, tmp_path):
    previous = os.umask(umask)
    try:
        (tmp_path / "plain.txt").write_text("a file made the ordinary way")
        checkpoint.save({"model": {}, "epoch": 1}, tmp_path / "last.pt")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "last.pt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask
    assert checkpoint.load(tmp_path / "last.pt") == {"model": {}, "epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "plain.txt"]  # no temporary file left


def _not_a_multiple(path, where, batch, micro_batch):
    return (
        f"{str(path)!r} {where}: batch size {batch} is not a positive multiple of the micro-batch "
        f"(--batch-size {micro_batch})"
    )


def test_a_trace_error_names_the_file_line_and_step(tmp_path):
    path = tmp_path / "trace.csv"
    # line 1 the header, lines 2-3 steps 0-1, line 4 blank, line 5 step 3 (the file's own step numbers)
    path.write_text("step,batchsize\n0,32\n1,64\n\n3,48\n")
    with pytest.raises(batch_trace.UserError) as error:
        batch_trace.check_trace(batch_trace.load_trace(path), 32)
    assert str(error.value) == _not_a_multiple(path, "line 5 (step 3)", 48, 32)
    with pytest.raises(batch_trace.UserError) as error:  # the original API says the same
        trace_api.CustomSampler(list(range(100)), str(path), num_replicas=1, rank=0, minibatch_size=32)
    assert str(error.value) == _not_a_multiple(path, "line 5 (step 3)", 48, 32)


def test_a_trace_without_a_step_column_names_the_line(tmp_path):
    path = tmp_path / "sizes.csv"
    path.write_text("batchsize\n16\n0\n")
    with pytest.raises(batch_trace.UserError) as error:
        batch_trace.check_trace(batch_trace.load_trace(path), 16)
    assert str(error.value) == _not_a_multiple(path, "line 3", 0, 16)


def test_a_trace_given_as_a_list_still_names_the_step():
    assert batch_trace.load_trace([8, 16]) == [8, 16]
    with pytest.raises(batch_trace.UserError, match=r"^trace step 1: batch size 20 is not a positive multiple"):
        batch_trace.check_trace([16, 20], 8)
    with pytest.raises(batch_trace.UserError, match=r"^row B: batch size 20"):
        batch_trace.check_trace([16, 20], 8, where=["row A", "row B"])


def test_run_py_names_the_trace_line_and_step(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    path.write_text("step,batchsize\n0,32\n1,32\n2,40\n")
    argv = ["--batch-trace", str(path), "--batch-size", "16", "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: " + _not_a_multiple(path, "line 4 (step 2)", 40, 16)]


@pytest.mark.parametrize("epochs, warmup", [(1, 0.5), (3, 1.5), (4, 2.0), (10, 2.0)])
def test_sweep_warmup_fits_the_epochs(epochs, warmup):
    assert load_sweep().default_warmup(epochs) == warmup


TORCHRUN_REPORT = """W1122 06:15:50 torch/distributed/run.py:792] Setting OMP_NUM_THREADS environment variable to 1
{error}
E1122 06:15:53 api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 5475)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : 2 (pid: 5475)
  error_file: <N/A>
"""


def test_a_failed_sweep_cell_shows_run_py_s_error_first(tmp_path, monkeypatch, capsys):
    sweep = load_sweep()
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        error = "error: --momentum acts only with --optimizer sgd or --optimizer lars, so it would be ignored"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=TORCHRUN_REPORT.format(error=error))

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="error: cell adam-b32 failed"):
        sweep.main(["--batch-sizes", "32", "--optimizers", "adam", "--epochs", "1", "--out", str(tmp_path)])
    cmd = commands[0]
    assert cmd[cmd.index("--warmup-epochs") + 1] == "0.5" and cmd[cmd.index("--epochs") + 1] == "1"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: --momentum acts only with --optimizer sgd or --optimizer lars, so it would be ignored"
    assert "  error_file: <N/A>" in err  # the rest follows


@pytest.mark.parametrize(
    "line, expected",
    [
        ("error: --epochs: must be a positive integer", "error: --epochs: must be a positive integer"),
        ("[rank0]: error: the trace has 3 steps", "error: the trace has 3 steps"),
        ("error on rank 1: out of memory", "error on rank 1: out of memory"),
        ("  error_file: <N/A>", None),
    ],
)
def test_sweep_finds_run_py_s_error_line(line, expected):
    error, rest = load_sweep().split_error(f"noise before\n{line}\nnoise after\n")
    assert error == expected
    assert rest == ("noise before\nnoise after" if expected else f"noise before\n{line}\nnoise after\n")


def test_sweep_passes_no_reference_batch_to_keep_scaling(tmp_path, monkeypatch):
    sweep, commands = recording_sweep(monkeypatch)
    argv = ["--batch-sizes", "64", "--optimizers", "sgd", "--lr-scaling", "sgd=keep", "--out", str(tmp_path)]
    assert sweep.main(argv) == 0
    assert "--base-batch-size" not in commands[0] and config.parse(commands[0][commands[0].index("--optimizer") :])


def _metrics_rows(run_dir):
    return (run_dir / "metrics.csv").read_text().strip().splitlines()[1:]


def test_a_run_name_in_use_is_refused_and_overwrite_starts_over(tmp_path, capsys):
    flags = ["-n", "mlp", "--runs-dir", str(tmp_path), "--no-progress"]
    assert run.main([*flags, "-e", "2"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "mlp").iterdir() if p.is_file()}
    capsys.readouterr()
    assert run.main([*flags, "-e", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run: continue it with --resume auto" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "mlp").iterdir() if p.is_file()} == before  # untouched
    assert run.main([*flags, "-e", "1", "--overwrite"]) == 0
    assert len(_metrics_rows(tmp_path / "mlp")) == 1  # the old run is gone, not mixed in
    assert (tmp_path / "mlp" / "train.log").read_text().count("best val_loss") == 1


def test_a_failed_resume_leaves_no_run_folder(tmp_path, capsys):
    assert run.main(["--resume", str(tmp_path / "nope.pt"), "-n", "r", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_a_runs_dir_that_cannot_be_written_is_one_line_even_for_root(capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert run.main(["--runs-dir", "/proc/runs", "-e", "1"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before  # held through the checks and the failure, then put back
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the run folder '/proc/runs/" in err


def test_a_huge_learning_rate_says_no_checkpoint_was_written_and_logs_it(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert run.main(["-l", "1000", "-n", "hot", "--runs-dir", str(tmp_path), "--no-progress", "-e", "1"]) == 3
    assert signal.getsignal(signal.SIGTERM) is before  # held at the failure, over preemption's: both undone
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite loss" in err and "no checkpoint was written before it" in err
    assert not (tmp_path / "hot" / "last.pt").exists()
    assert "non-finite loss" in (tmp_path / "hot" / "train.log").read_text()


def test_a_global_batch_larger_than_the_training_set_is_refused(capsys):
    assert run.main(["-b", "5000"]) == 2
    err = capsys.readouterr().err
    assert "the global batch 5000" in err and "exceeds the 1438 training samples: lower --batch-size" in err


def test_help_answers_before_torch_is_imported():
    import subprocess
    import sys

    from multiproc import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "run.py"), "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and "--monitor-metric" in result.stdout and "--dataset" in result.stdout
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "ddp_tricks.cli" in imported


def test_a_run_continued_with_more_epochs_schedules_over_its_new_length(tmp_path):
    flags = ["-n", "grow", "--runs-dir", str(tmp_path), "--no-progress", "--scheduler", "cosine", "-b", "64"]
    assert run.main([*flags, "-e", "1"]) == 0
    saved = checkpoint.load(tmp_path / "grow" / "last.pt")
    assert run.main([*flags, "-e", "3", "--resume", "auto"]) == 0
    # 23 steps per epoch; the LR in each row is the one that epoch's last step applied, on a 69-step cosine
    total = 69
    assert_resumed((tmp_path / "grow" / "train.log").read_text(), saved, total)
    lrs = [float(r.split(",")[6]) for r in _metrics_rows(tmp_path / "grow")]
    expected = [0.05 * (1 + math.cos(math.pi * min(23 * e, total) / total)) / 2 for e in (2, 3)]
    assert lrs[1:] == pytest.approx(expected, abs=1e-12) and lrs[1] > 0  # not the 1-epoch run's finished decay


@pytest.mark.slow
def test_a_compiled_run_saves_plain_weights_that_resume(tmp_path, monkeypatch):
    # Training in steps of one size (4 of 359): one training graph. Validation meets a second size (256, then 103):
    # the compiled model runs at a batch size it was not compiled for, as every run without --drop-last does.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # in this process: no pool of compile workers
    flags = ["-n", "c", "--runs-dir", str(tmp_path), "--no-progress", "--compile", "-b", "359", "--drop-last",
             "--val-batch-size", "256"]  # fmt: skip
    assert run.main([*flags, "-e", "1"]) == 0
    saved = checkpoint.load(tmp_path / "c" / "last.pt")
    assert not any(k.startswith("_orig_mod") for k in saved["model"])
    assert run.main([*flags, "-e", "2", "--resume", "auto"]) == 0
    assert_resumed((tmp_path / "c" / "train.log").read_text(), saved, 2 * 4)  # 4 steps of 359 an epoch


def test_resume_auto_without_a_run_name_is_one_line(capsys):
    from ddp_tricks import UserError, cli

    with pytest.raises(UserError) as error:
        cli.parse(["--resume", "auto"])
    assert str(error.value) == "--resume auto continues the run named by -n NAME: give -n (the run's folder name)"


def test_a_run_on_several_nodes_without_a_name_is_named_alike_on_every_node(monkeypatch):
    from ddp_tricks import cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert cli.default_name() == "run-job42"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one node: the time it starts, as without torchrun
    assert cli.default_name()[:2] == "20" and len(cli.default_name()) == len("20261125-120000")


def test_a_collective_that_lost_its_peer_is_told_apart_from_a_bug():
    from ddp_tricks.distributed import watchdog

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5: Connection "
                        "reset by peer\nmore")  # fmt: skip
    assert watchdog.lost_peer(gloo).endswith("Connection reset by peer")
    assert watchdog.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert watchdog.lost_peer(ValueError("Connection reset by peer")) is None  # not a collective's
