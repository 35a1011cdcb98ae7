"""The catalogue of bad input: each case is one line on stderr naming the problem and the fix, exit code 2,
no traceback, nothing written or overwritten. (Multi-rank exit codes: test_end_to_end.)"""

import pickle
from pathlib import Path

import pytest
import torch

import run

CASES = {
    "zero epochs": (["--epochs", "0"], "--epochs: must be a positive integer"),
    "zero batch": (["--batch-size", "0"], "--batch_size: must be a positive integer"),
    "negative lr": (["--base-lr", "-1"], "--base-lr must be > 0"),
    "unknown optimizer": (["--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    "unknown flag": (["--bogus"], "unrecognized arguments: --bogus"),
    "not a number": (["--base-lr", "fast"], "invalid float value: 'fast'"),
    "momentum too big": (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
    "nesterov without momentum": (["--nesterov", "--momentum", "0"], "--nesterov needs --momentum > 0"),
    "warmup longer than run": (["--epochs", "2", "--warmup-epochs", "3"], "exceeds --epochs 2"),
    "label smoothing 1": (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1)"),
    "lookahead alpha 0": (["--lookahead", "--lookahead-alpha", "0"], "--lookahead-alpha must be in (0, 1]"),
    "apex without apex": (["--amp-backend", "apex"], "use native mixed precision"),
    "name with slash": (["-n", "a/b"], "must be a plain folder name"),
    "nccl on cpu": (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs CUDA"),
    "imagefolder without dirs": (["--dataset", "imagefolder"], "needs --train-dir and --val-dir"),
    "train-dir without imagefolder": (["--train-dir", "x"], "--train-dir is read only with --dataset imagefolder, and"),
    "val-dir with mnist": (["--dataset", "mnist", "--val-dir", "x"], "this run trains on --dataset mnist: add --dat"),
    "unknown model": (["--model", "resnet9000"], "--model 'resnet9000' is unknown"),
    # no surprises (#12): argparse's own words replaced, typos get a suggestion, ignored flags refused
    "epochs not an integer": (["-e", "1.5"], "argument -e/--epochs: must be a positive integer, got '1.5'"),
    "flag close to a real one": (["--epoch", "3"], "unrecognized arguments: --epoch 3; did you mean --epochs?"),
    "typo with =": (["--wramup-epochs=2"], "did you mean --warmup-epochs?"),
    "not a number lr": (["--base-lr", "nan"], "--base-lr must be > 0, got nan"),
    "betas outside [0, 1)": (["--optimizer", "adamw", "--betas", "0.9", "1"], "--betas must be two numbers in [0, 1)"),
    "betas with sgd": (["--betas", "0.9", "0.95"], "--betas acts only with --optimizer adamw, adam, lamb or muon"),
    "trust clip with adamw": (["--optimizer", "adamw", "--trust-clip"], "--trust-clip acts only with --optimizer lamb"),
    "negative eps": (["--optimizer", "adam", "--eps", "-1"], "--eps must be >= 0, got -1.0"),
    "lars wrapped in lars": (["--optimizer", "lars", "--lars-wrap"], "--optimizer lars is LARS already: use one of"),
    "cosine warmup type with poly": (
        ["-t", "cosine", "--scheduler", "poly"],
        "--warmup-type cosine means cosine decay after warmup, but --scheduler poly asks for another decay",
    ),
    "cosine warmup type with plateau": (
        ["--warmup-type", "cosine", "--scheduler", "plateau"],
        "use --scheduler cosine",
    ),
    "step every 0 epochs": (["--scheduler", "step", "--step-epochs", "0"], "--step-epochs must be > 0"),
    "step every -1 epochs": (["--scheduler", "step", "--step-epochs", "-1"], "--step-epochs must be > 0"),
    "step gamma 0": (["--scheduler", "step", "--step-gamma", "0"], "--step-gamma must be in (0, 1], got 0.0"),
    "step gamma above 1": (["--scheduler", "step", "--step-gamma", "1.5"], "--step-gamma must be in (0, 1]"),
    "negative plateau patience": (
        ["--scheduler", "plateau", "--plateau-patience", "-1"],
        "--plateau-patience must be >= 0",
    ),
    "zero dist timeout": (["--dist-timeout", "0"], "--dist-timeout must be > 0 seconds, got 0.0"),
    "negative dist timeout": (["--dist-timeout", "-5"], "--dist-timeout must be > 0 seconds"),
    "zero heartbeat timeout": (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be > 0, got 0.0"),
    "zero hang factor": (["--hang-factor", "0"], "--hang-factor must be > 0, got 0.0"),
    "nan hang timeout": (["--hang-timeout", "nan"], "--hang-timeout must be > 0, got nan"),
    "negative end lr": (["--scheduler", "poly", "--end-lr", "-0.1"], "--end-lr must be >= 0, got -0.1"),
    "zero lr power": (["--scheduler", "poly", "--lr-power", "0"], "--lr-power must be > 0"),
    "zero bucket": (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0"),
    "negative precise bn": (["--precise-bn", "-1"], "--precise-bn must be >= 0 (training samples; 0 turns it off)"),
    "image size for cifar10": (["--dataset", "cifar10", "--image-size", "14"], "--image-size does not apply to"),
    "negative early stop delta": (["--early-stop-patience", "2", "--early-stop-delta", "-1"], "must be >= 0"),
    "lookahead k without lookahead": (
        ["--lookahead-k", "3"],
        "--lookahead-k acts only with --lookahead, so it would be ignored: add --lookahead or drop --lookahead-k",
    ),
    "end lr with a constant schedule": (["--end-lr", "0.01"], "--end-lr acts only with --scheduler poly or"),
    "plateau patience without plateau": (["--plateau-patience", "3"], "add --scheduler plateau or drop"),
    "step gamma without step": (["--scheduler", "poly", "--step-gamma", "0.5"], "--step-gamma acts only with"),
    "lr power without poly": (
        ["--scheduler", "cosine", "--lr-power", "2"],
        "--lr-power acts only with --scheduler poly",
    ),
    "nesterov with adam": (["--optimizer", "adam", "--nesterov"], "--nesterov acts only with --optimizer sgd or"),
    "trust coefficient without lars": (["--trust-coefficient", "0.01"], "add --optimizer lars or drop"),
    "base batch without scaling": (["--base-batch-size", "64"], "--base-batch-size acts only with --lr-scaling"),
    "trace end without trace": (["--trace-end", "repeat-last"], "--trace-end acts only with --batch-trace FILE"),
    # model EMA (#37)
    "model ema decay 1": (["--model-ema", "1"], "--model-ema DECAY must be in (0, 1), e.g. 0.999, got 1.0"),
    "model ema decay 0": (["--model-ema", "0"], "--model-ema DECAY must be in (0, 1)"),
    "model ema decay nan": (["--model-ema", "nan"], "--model-ema DECAY must be in (0, 1)"),
    "model ema warmup without ema": (["--model-ema-warmup"], "--model-ema-warmup acts only with --model-ema DECAY"),
    "monitor the ema without one": (["--monitor-metric", "ema_acc"], "follows the EMA's weights: add --model-ema"),
    # a newcomer's try of #51's flags
    "an example task's flag without its task": (
        ["--strategy", "fsdp", "--pack"],
        "--pack is a flag of the task examples/language_model.py:PythonSourceLM: give --task examples/language_",
    ),
    "an example task's flag close to a run's": (["--max-length", "64"], "--max-length is a flag of the task examples"),
    "a flag of several example tasks": (
        ["--width", "3"],
        "--width is a flag of the tasks examples/byol.py:BYOL, examples/contrastive.py:SimCLR, examples/language_model"
        ".py:PythonSourceLM: give --task with one of them",
    ),
    "a flag another task lacks": (
        ["--task", "examples/regression.py:Diabetes", "--width", "3"],
        "unrecognized arguments: --width 3; did you mean --wd?",  # the user's task named: no example's said
    ),
    "checkpointing mode unknown": (["--activation-checkpointing", "foo"], "must be none, full, ops or a positive"),
    "checkpointing every 0th block": (["--activation-checkpointing", "0"], "integer K (every K-th block), got '0'"),
    "checkpointing a digit int() refuses": (["--activation-checkpointing", "\u00b2"], "block), got '\u00b2'"),
}


@pytest.mark.parametrize("argv, message", CASES.values(), ids=CASES.keys())
def test_bad_flag_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert run.main([*argv, "--runs-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not any(tmp_path.iterdir())


def _fails(argv, message, capsys):
    assert run.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_data_root(tmp_path, capsys):
    _fails(["--dataset", "mnist", "--data-root", str(tmp_path / "none")], "MNIST not found under --data-root", capsys)


def test_missing_image_folder(tmp_path, capsys):
    _fails(
        ["--dataset", "imagefolder", "--train-dir", str(tmp_path / "t"), "--val-dir", str(tmp_path / "v")],
        "is not a folder",
        capsys,
    )


def test_empty_image_folder(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    (tmp_path / "v").mkdir()
    _fails(
        ["--dataset", "imagefolder", "--train-dir", str(tmp_path / "t"), "--val-dir", str(tmp_path / "v")],
        "one sub-folder of images per class",
        capsys,
    )


def test_image_folder_with_one_class_is_refused(tmp_path, capsys):
    for split in ("t", "v"):
        (tmp_path / split / "cats").mkdir(parents=True)
        (tmp_path / split / "cats" / "a.png").write_bytes(b"")  # listed by extension, never opened
    _fails(
        ["--dataset", "imagefolder", "--train-dir", str(tmp_path / "t"), "--val-dir", str(tmp_path / "v")],
        "has 1 class folder: a classifier needs at least two",
        capsys,
    )


def test_run_folder_not_writable(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    _fails(["--runs-dir", str(blocker / "runs")], "cannot write the run folder", capsys)


def test_more_processes_than_validation_samples(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "400")
    _fails([], "fewer than the 400 processes", capsys)


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_sync_bn_on_cpu_processes(world_size, monkeypatch, tmp_path, capsys):
    """One process as two: the same line. Broken on purpose: the check asking for 2+ processes again fails the one
    process (accepted silently, its BatchNorm kept as it is)."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    message = "--sync-bn needs CUDA devices (SyncBatchNorm does not run on CPU/gloo); drop --sync-bn"
    _fails(["--sync-bn", "--device", "cpu", "-e", "1", "--runs-dir", str(tmp_path)], message, capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_sync_bn_with_a_batch_trace_is_refused(world_size, monkeypatch, tmp_path, capsys):
    # A traced run is not DDP-wrapped (wrap.wrap converts to SyncBatchNorm), and its ranks run different numbers of
    # micro-batches per step: --sync-bn was silently dropped before; now it is one line, before the CPU check too.
    monkeypatch.setenv("WORLD_SIZE", world_size)
    trace = str(Path(run.__file__).parent / "examples" / "traces" / "doubling.csv")
    message = "--sync-bn cannot work with --batch-trace: a traced step gives the ranks different numbers of micro-"
    _fails(["--sync-bn", "--batch-trace", trace, "--device", "cpu", "-e", "1", "--runs-dir", str(tmp_path)], message,
           capsys)  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_resume_missing_file(tmp_path, capsys):
    _fails(["--resume", str(tmp_path / "nope.pt"), "--runs-dir", str(tmp_path)], "does not exist", capsys)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_from_a_folder_that_is_not_a_checkpoint_says_what_it_lacks(strategy, tmp_path, capsys):
    # A folder is a sharded checkpoint only with .metadata or state.pt; any other folder was taken for one before.
    empty, run_folder, sharded_run = tmp_path / "empty", tmp_path / "r", tmp_path / "s"
    for folder in (empty, run_folder, sharded_run):
        folder.mkdir()
    (run_folder / "last.pt").write_bytes(b"")
    (sharded_run / "last.dcp").symlink_to(tmp_path / "s" / "sharded")
    (sharded_run / "sharded").mkdir()
    lacks = "is a folder without .metadata or state.pt, not a checkpoint"
    cases = {
        empty: f"{lacks}: give the path of a last.pt/best.pt, a run's last.dcp with --strategy fsdp, or --resume auto "
        "with --name RUN",
        run_folder: f"{lacks}: it looks like a run folder; resume from {str(run_folder / 'last.pt')!r}",
        sharded_run: f"{lacks}: it looks like a sharded run's folder; resume from "
        f"{str(sharded_run / 'last.dcp')!r} with --strategy fsdp",
    }
    for folder, message in cases.items():
        argv = ["--resume", str(folder), "--strategy", strategy, "-n", "new", "--runs-dir", str(tmp_path)]
        _fails(argv, f"error: checkpoint {str(folder)!r} {message}", capsys)
    assert not (tmp_path / "new").exists()


def _not_ours(path):
    return (
        f"error: checkpoint {str(path)!r} is not a checkpoint written by this project (or is corrupt); "
        "pick another file or start without --resume"
    )


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00garbage" * 100, b"PK\x03\x04truncated", bytes(range(256)) * 40],
    ids=["empty", "garbage", "zip", "random"],
)
def test_corrupt_checkpoint(content, tmp_path, capsys):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    _fails(["--resume", str(path), "--runs-dir", str(tmp_path)], _not_ours(path), capsys)
    assert path.read_bytes() == content


def test_truncated_checkpoint(tmp_path, capsys):
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.zeros(1000)}, "epoch": 1}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _fails(["--resume", str(bad), "--runs-dir", str(tmp_path)], _not_ours(bad), capsys)


class _Exploit:
    def __reduce__(self):
        return (print, ("this checkpoint ran code",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": _Exploit(), "epoch": 1}, f)
    assert run.main(["--resume", str(path), "--runs-dir", str(tmp_path), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [_not_ours(path)] and "this checkpoint ran code" not in out


def test_checkpoint_not_from_run_py(tmp_path, capsys):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    _fails(
        ["--resume", str(path), "--runs-dir", str(tmp_path)],
        "is not a checkpoint written by this project (it has no model/epoch entries)",
        capsys,
    )


def test_checkpoint_of_another_model(tmp_path, capsys):
    path = tmp_path / "other.pt"
    torch.save({"model": {"fc.weight": torch.zeros(3, 3)}, "epoch": 1, "config": {"model": "mlp"}}, path)
    _fails(["--resume", str(path), "--runs-dir", str(tmp_path)], "do not fit this task's model", capsys)


def test_checkpoint_of_another_optimizer_leaves_it_intact(tmp_path, capsys):
    assert run.main(["--epochs", "1", "-n", "r", "--runs-dir", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    last = tmp_path / "r" / "last.pt"
    before = last.read_bytes()
    _fails(
        ["--resume", "auto", "-n", "r", "--runs-dir", str(tmp_path), "--optimizer", "adam", "--epochs", "2"],
        "was trained with SGD, these flags build Adam",
        capsys,
    )
    assert last.read_bytes() == before


@pytest.mark.parametrize("value, mode", [("none", None), ("full", "full"), ("ops", "ops"), ("2", "2"), ("02", "2")])
def test_activation_checkpointing_takes_none_as_off(value, mode):
    """--activation-checkpointing none is the default said by --help (a config file or sweep can name it); K is kept
    as its number."""
    from ddp_tricks import cli

    flags, _ = cli.parse(["--activation-checkpointing", value])
    assert flags.activation_checkpointing == mode
