"""No surprises (#12): the command line says what it does, checkpoints and traces fail in plain words, files get
the usual permissions, the sweep's defaults fit its epochs. Bad-flag messages: test_bad_input's catalogue."""

import os
import re
import stat
import subprocess
import sys

import pytest
from multiproc import REPO

import checkpoint
import config


@pytest.mark.parametrize("flag", ["-l", "--base-lr", "--learning-rate", "--learning_rate", "--lr"])
def test_every_spelling_of_the_learning_rate(flag):
    assert config.parse([flag, "0.3"]).base_lr == 0.3


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
    code = "import sys, config; config.parse(['--epochs', '2', '-t', 'cosine']); print('torch' in sys.modules)"
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
