"""`--config FILE.toml` (flags from a file, the command line overrides them), its bad-input catalogue, the sweep's
config file, and recipes/: every recipe resolves, the published ones hold the published numbers, and the ones for
the data that ships here train."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import REPO
from sweep_harness import load_sweep, recording_sweep

import run
from ddp_tricks import cli as config

RECIPES = REPO / "recipes"
MNIST = REPO.parent / "shared" / "data" / "mnist-t10k"


def _write(tmp_path, text: str, name: str = "flags.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def lr_power(cfg) -> float:
    """The poly decay's power these flags give (derived once, in the plan)."""
    import run

    return run.make_plan(cfg, num_train=100_000, world_size=1).lr_power


def test_file_values_act_as_typed_and_the_command_line_overrides_them(tmp_path):
    text = 'base_lr = 0.2\nepochs = 4\noptimizer = "lars"\nbn-bias-separately = true\nnesterov = false\n'
    path = _write(tmp_path, text + "warmup-epochs = 0.5\n")
    cfg, _ = config.parse(["--config", str(path), "--epochs", "2"])
    assert (cfg.base_lr, cfg.epochs, cfg.optimizer, cfg.warmup_epochs) == (0.2, 2, "lars", 0.5)
    assert cfg.bn_bias_separately is True and cfg.nesterov is False
    assert lr_power(cfg) == 2.0  # derived from the file's optimizer, as from a typed one
    assert cfg.config_file == str(path.resolve())


def test_a_false_on_off_key_is_not_a_given_flag(tmp_path):
    # --nesterov with adam is refused as ignored; `nesterov = false` gives no flag, so nothing is ignored
    cfg, _ = config.parse(["--config", str(_write(tmp_path, 'optimizer = "adam"\nnesterov = false\n'))])
    assert cfg.optimizer == "adam" and cfg.nesterov is False


def test_a_file_can_name_the_task_and_set_its_flags(tmp_path):
    path = _write(tmp_path, 'task = "examples/regression.py:Diabetes"\nhidden = 16\n')
    cfg, task_class = config.parse(["--config", str(path)])
    assert task_class.__name__ == "Diabetes" and cfg.hidden == 16 and cfg.monitor == "val_mae"


TASK_WITH_A_LIST = """
class Listy:
    @staticmethod
    def add_arguments(parser):
        parser.add_argument("--layers", type=int, nargs="+", default=[8])

    def datasets(self): ...
    def model(self): ...
    def loss(self, outputs, targets): ...
"""


def test_a_list_sets_a_flag_that_takes_several_values(tmp_path):
    (tmp_path / "listy.py").write_text(TASK_WITH_A_LIST)
    path = _write(tmp_path, f'task = "{tmp_path / "listy.py"}:Listy"\nlayers = [64, 32]\n')
    cfg, _ = config.parse(["--config", str(path)])
    assert cfg.layers == [64, 32]


def test_config_json_holds_the_file_path_and_the_resolved_flags(tmp_path):
    path = _write(tmp_path, 'optimizer = "lamb"\nbase-lr = 0.02\nscheduler = "cosine"\nwarmup-epochs = 1\n')
    argv = ["--config", str(path), "--base-lr", "0.01", "-n", "r", "--runs-dir", str(tmp_path / "runs"), "-e", "1",
            "-b", "256", "--no-progress"]  # fmt: skip
    assert run.main(argv) == 0
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    assert saved["config_file"] == str(path.resolve())
    assert (saved["optimizer"], saved["base_lr"], saved["scheduler"], saved["warmup_epochs"]) == (
        "lamb",
        0.01,
        "cosine",
        1.0,
    )


def test_a_typed_max_steps_replaces_the_files_epochs(tmp_path):
    # every recipe sets `epochs`: a run of one counted in steps types --max-steps, which replaces it
    cfg, _ = config.parse(["--config", str(RECIPES / "digits-lars.toml"), "--max-steps", "20"])
    assert (cfg.max_steps, cfg.optimizer) == (20, "lars")
    path = _write(tmp_path, "epochs = 4\nbase-lr = 0.1\n")
    argv = ["--config", str(path), "--max-steps", "3", "-b", "256", "-n", "r", "--runs-dir", str(tmp_path / "runs"),
            "--no-progress", "--log-interval", "0"]  # fmt: skip
    assert run.main(argv) == 0
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    # 1,438 digits in steps of 256: 6 a epoch, so 3 steps are one epoch (the file's 4 are not used, nor recorded)
    assert (saved["max_steps"], saved["epochs"], saved["total_steps"]) == (3, 1, 3)
    with open(tmp_path / "runs" / "r" / "metrics.csv") as f:
        assert len(f.read().strip().splitlines()) == 2  # the header and one epoch


def test_a_typed_epochs_replaces_the_files_max_steps(tmp_path):
    cfg, _ = config.parse(["--config", str(_write(tmp_path, "max-steps = 30\n")), "-e", "2"])
    assert (cfg.epochs, cfg.max_steps) == (2, 0)


def test_a_file_that_sets_both_lengths_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "epochs = 2\nmax-steps = 30\n")
    assert run.main(["--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --config {path}, key 'max-steps': --max-steps sets the run's length in place of --epochs: "
        "give one of them"
    ]


# file text -> the message after `error: --config FILE` (FILE stands for the file's path)
BAD_FILES = {
    "not TOML": ("epochs = \n", " is not valid TOML (Invalid value (at line 1, column 10))"),
    "not text": (b"\xff\xfe\x00binary", " is not valid TOML ("),
    "unknown key": ("bas-lr = 0.1\n", ": unknown key 'bas-lr' (no flag --bas-lr); did you mean 'base-lr'?"),
    "unknown key, no match": ("zzz = 1\n", ": unknown key 'zzz' (no flag --zzz); keys are the long flags of"),
    "a number in quotes": (
        'epochs = "10"\n',
        ", key 'epochs': --epochs takes a number, not the string '10': write it without quotes",
    ),
    "a word for a number": ('base_lr = "fast"\n', ", key 'base_lr': --base-lr takes a number, not the string 'fast'"),
    "a fraction for an integer": ("epochs = 1.5\n", ", key 'epochs': --epochs must be a positive integer, got '1.5'"),
    "zero epochs": ("epochs = 0\n", ", key 'epochs': --epochs must be a positive integer, got '0'"),
    "true for a value": ("epochs = true\n", ", key 'epochs': --epochs takes a value, not true"),
    "a date for a value": ("epochs = 2024-01-01\n", ", key 'epochs': --epochs takes a value, not 2024-01-01"),
    "a number for an on/off flag": (
        "nesterov = 1\n",
        ", key 'nesterov': --nesterov is an on/off flag: write nesterov = true or nesterov = false, not 1",
    ),
    "an unknown choice": (
        'optimizer = "rmsprop"\n',
        ", key 'optimizer': --optimizer is one of sgd, adam, adamw, lars, lamb, muon, not 'rmsprop'",
    ),
    "a list for one value": ("base-lr = [0.1, 0.2]\n", ", key 'base-lr': --base-lr takes one value, not a list"),
    "a section": ("[optimizer]\nname = 1\n", ", key 'optimizer' is a table: write every flag as a top-level"),
    "two spellings of one flag": (
        "lr = 0.1\nbase-lr = 0.2\n",
        ": keys 'lr' and 'base-lr' both set --base-lr: keep one",
    ),
    "a value the checks refuse": ("base-lr = -1\n", ", key 'base-lr': --base-lr must be > 0, got -1.0"),
    "a flag that would be ignored": (
        "lookahead-k = 3\n",
        ", key 'lookahead-k': --lookahead-k acts only with --lookahead, so it would be ignored: add --lookahead",
    ),
    "a value the task refuses": (
        "label-smoothing = 1.0\n",
        ", key 'label-smoothing': --label-smoothing must be in [0, 1), got 1.0",
    ),
    "an unknown model": ('model = "resnet9000"\n', ", key 'model': --model 'resnet9000' is unknown"),
    "a config file in a config file": ('config = "other.toml"\n', ", key 'config': a config file holds settings"),
    "help in a config file": ("help = true\n", ", key 'help': a config file holds settings, not --help: remove it"),
    "a task that is not a string": ("task = 3\n", ", key 'task': write it as a string, task = \"FILE.py:NAME\""),
    "a task file that does not exist": ('task = "nope.py"\n', ", key 'task': --task 'nope.py': no Python file"),
}


@pytest.mark.parametrize("text, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_config_file_is_one_line_naming_file_and_key(text, message, tmp_path, capsys):
    path = tmp_path / "flags.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    runs = tmp_path / "runs"
    assert run.main(["--config", str(path), "--runs-dir", str(runs), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --config {path}{message}"), err
    assert not runs.exists()


@pytest.mark.parametrize("make, message", [(lambda p: p, "does not exist"), (lambda p: p.mkdir(), "is a folder")])
def test_a_missing_config_file_or_a_folder_is_one_line(make, message, tmp_path, capsys):
    path = tmp_path / "flags.toml"
    make(path)
    assert run.main(["--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --config {path} {message}: give a TOML file of flags, like those in recipes/"]
    assert not (tmp_path / "runs").exists()


def test_a_typed_mistake_is_not_blamed_on_the_file(tmp_path, capsys):
    path = _write(tmp_path, "epochs = 3\nbase-lr = 0.1\n")
    assert run.main(["--config", str(path), "--base-lr", "-1", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --base-lr must be > 0, got -1.0"]


def test_the_command_line_can_replace_a_value_the_checks_would_refuse(tmp_path):
    cfg, _ = config.parse(["--config", str(_write(tmp_path, "base-lr = -1\n")), "--base-lr", "0.1"])
    assert cfg.base_lr == 0.1


def test_a_bad_file_answers_before_torch_is_imported(tmp_path):
    path = _write(tmp_path, "bas-lr = 0.1\n")
    result = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "run.py"), "--config", str(path)],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == 2 and "torch" not in imported
    assert lines == [f"error: --config {path}: unknown key 'bas-lr' (no flag --bas-lr); did you mean 'base-lr'?"]
    assert not (tmp_path / "runs").exists()


def test_the_sweep_gives_its_config_file_to_every_cell(tmp_path, monkeypatch):
    sweep, commands = recording_sweep(monkeypatch)
    _write(tmp_path, 'momentum = 0.8\nscheduler = "cosine"\nbase-lr = 9.0\n')
    monkeypatch.chdir(tmp_path)  # a path relative to where the sweep is started
    argv = ["--config", "flags.toml", "--batch-sizes", "64", "128", "--optimizers", "sgd", "--out", "out"]
    assert sweep.main(argv) == 0
    assert len(commands) == 2
    for cmd in commands:
        flags = cmd[cmd.index(str(REPO / "run.py")) + 1 :]
        assert flags[:2] == ["--config", str(tmp_path / "flags.toml")]
        cfg, _ = config.parse(flags)
        assert (cfg.momentum, cfg.scheduler) == (0.8, "cosine")  # from the file
        assert cfg.base_lr == 0.05  # the sweep's own LR for the cell wins over the file's


def test_the_sweep_refuses_a_bad_config_file_before_any_cell(tmp_path, monkeypatch, capsys):
    sweep = load_sweep()
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **kw: pytest.fail("a cell was started"))
    path = _write(tmp_path, "lookahead-k = 3\n")
    argv = ["--config", str(path), "--batch-sizes", "64", "--optimizers", "sgd", "--out", str(tmp_path / "out")]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: cell sgd-b64: --config {path}, key 'lookahead-k': --lookahead-k acts only with --lookahead, so it "
        "would be ignored: add --lookahead or drop --lookahead-k"
    ]
    assert not (tmp_path / "out").exists()


# --- recipes ---------------------------------------------------------------------------------------------------

# NUS-HPC-AI-Lab/LARS-ImageNet-PyTorch README, "Performance on ImageNet":
# effective batch -> (base LR, warmup epochs, epsilon, reported top-1)
IMAGENET = {
    512: (2**2, 10 / 2**6, 1e-5, "77.02 %"),
    1024: (2**2.5, 10 / 2**5, 1e-5, "76.96 %"),
    4096: (2**3.5, 10 / 2**3, 1e-5, "77.38 %"),
    8192: (2**4, 10 / 2**2, 1e-5, "77.14 %"),
    16384: (2**4.5, 5, 1e-5, "76.96 %"),
    32768: (2**5, 14, 0.0, "76.75 %"),
}
# cmpark0126/pytorch-LARS README, "Attempt 3" (He init): batch -> (base LR, SGD top-1, LARS top-1)
CIFAR10 = {
    128: (0.05, "89.76 %", "90.11 %"),
    256: (0.1, "90.08 %", "90.12 %"),
    512: (0.2, "89.34 %", "90.11 %"),
    1024: (0.4, "88.82 %", "90.02 %"),
    2048: (0.8, "89.29 %", "90.02 %"),
    4096: (1.6, "85.02 %", "88.38 %"),
    8192: (3.2, "77.72 %", "86.40 %"),
}
SMALL = [
    f"{data}-{optimizer}.toml"
    for data in ("digits", "mnist", "mnist-large-batch")
    for optimizer in ("sgd", "lars", "lamb")
] + ["mnist-auto-batch-sgd.toml"]  # the large-batch SGD recipe with --batch-trace auto
PHASES = {"lm-lamb-phase1.toml", "lm-lamb-phase2.toml"}  # the language model's; trained in test_task_recipes.py


def _resolve(path: Path, tmp_path: Path):
    """Flags and task of a recipe, with existing folders for the paths a user must give."""
    folders = ["--train-dir", str(tmp_path), "--val-dir", str(tmp_path)] if "imagefolder" in path.read_text() else []
    cfg, task_class = config.parse(["--config", str(path), *folders, "--runs-dir", str(tmp_path / "runs")])
    task_class(cfg)  # the task's own checks (model name, image folders named, label smoothing)
    return cfg


# #59's recipes: the file -> (optimizer, model, --aa, mixup, cutmix, the papers' top-1 figures its header gives)
IMAGE_RECIPES = {
    "deit-small-vit.toml": ("adamw", "vit_b_16", "rand-m9-mstd0.5-inc1", 0.8, 1.0, ["79.9 %", "81.8 %"]),
    "rsb-resnet50-a3.toml": ("lamb", "resnet50", "rand-m6-mstd0.5-inc1", 0.1, 1.0, ["80.4 %", "79.8 %", "78.1 %"]),
}


@pytest.mark.parametrize("name", IMAGE_RECIPES)
def test_the_image_recipes_parse_with_their_paper_s_settings_and_target(name, tmp_path):
    """DeiT's and "ResNet strikes back" A3's files: read by run.py's parser and the task's checks, with the recipe's
    optimizer, model, augmentation and mixing, the papers' ImageNet figures in the header, a cosine schedule after a
    warmup, and the launch's global batch (DeiT 1024, RSB 2048)."""
    optimizer, model, aa, mixup, cutmix, figures = IMAGE_RECIPES[name]
    cfg = _resolve(RECIPES / name, tmp_path)
    assert (cfg.optimizer, cfg.model, cfg.dataset, cfg.aa, cfg.mixup, cfg.cutmix) == (
        optimizer, model, "imagefolder", aa, mixup, cutmix
    )  # fmt: skip
    assert cfg.scheduler == "cosine" and cfg.warmup_epochs == 5.0
    text = (RECIPES / name).read_text()
    assert all(figure in text for figure in figures)
    processes = int(re.search(r"--nproc_per_node=(\d+)", text).group(1))
    assert cfg.batch_size * processes == (1024 if name.startswith("deit") else 2048)
    if name.startswith("deit"):
        assert cfg.model_ema == 0.99996 and cfg.reprob == 0.25 and cfg.label_smoothing == 0.1 and cfg.aug_repeats == 3


def test_recipes_holds_every_row_of_both_tables_and_our_own():
    expected = {f"imagenet-resnet50-lars-b{b}.toml" for b in IMAGENET}
    expected |= {f"cifar10-resnet50-{o}-b{b}.toml" for b in CIFAR10 for o in ("sgd", "lars")}
    assert {p.name for p in RECIPES.glob("*.toml")} == expected | set(SMALL) | PHASES | set(IMAGE_RECIPES)


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.toml")))
def test_every_recipe_resolves_to_a_valid_configuration(name, tmp_path):
    cfg = _resolve(RECIPES / name, tmp_path)
    task = "examples/language_model.py:PythonSourceLM" if name in PHASES else "task.py:Task"
    assert cfg.config_file == str((RECIPES / name).resolve()) and cfg.task == task


@pytest.mark.parametrize("batch", IMAGENET)
def test_imagenet_recipes_hold_the_published_row(batch, tmp_path):
    path = RECIPES / f"imagenet-resnet50-lars-b{batch}.toml"
    lr, warmup, epsilon, top1 = IMAGENET[batch]
    cfg = _resolve(path, tmp_path)
    assert cfg.base_lr == pytest.approx(lr, rel=1e-12) and cfg.warmup_epochs == pytest.approx(warmup, rel=1e-12)
    assert cfg.epsilon == epsilon and cfg.epochs == 90 and cfg.weight_decay == 1e-4 and cfg.momentum == 0.9
    assert (cfg.optimizer, cfg.model, cfg.dataset, cfg.scheduler, cfg.lr_scaling) == (
        "lars",
        "resnet50",
        "imagefolder",
        "poly",
        "keep",
    )
    assert cfg.bn_bias_separately and lr_power(cfg) == 2.0 and cfg.end_lr == 0.0 and cfg.trust_coefficient == 1e-3
    assert cfg.label_smoothing == 0.1
    text = path.read_text()
    processes = int(re.search(r"--nproc_per_node=(\d+)", text).group(1))
    assert cfg.batch_size * processes * cfg.accum_steps == batch  # the launch its comment gives
    assert f"Reported validation top-1: {top1}" in text


@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
@pytest.mark.parametrize("batch", CIFAR10)
def test_cifar10_recipes_hold_the_published_row(batch, optimizer, tmp_path):
    path = RECIPES / f"cifar10-resnet50-{optimizer}-b{batch}.toml"
    table_lr, sgd_top1, lars_top1 = CIFAR10[batch]
    cfg = _resolve(path, tmp_path)
    k = batch / 128
    assert table_lr == pytest.approx(0.05 * k)  # the table follows the linear scaling rule
    assert cfg.base_lr == pytest.approx(2 * table_lr)  # warmup_multiplier 2: the LR after warmup
    assert cfg.end_lr == pytest.approx(1e-5 * k) and lr_power(cfg) == 2.0 and cfg.scheduler == "poly"
    assert (cfg.batch_size, cfg.epochs, cfg.warmup_epochs, cfg.momentum) == (batch, 200, 5.0, 0.9)
    assert (cfg.dataset, cfg.model, cfg.init, cfg.optimizer, cfg.lr_scaling) == (
        "cifar10",
        "resnet50",
        "he",
        optimizer,
        "keep",
    )
    if optimizer == "lars":
        assert cfg.weight_decay == 5e-3 and cfg.trust_coefficient == 0.1 and not cfg.bn_bias_separately
    else:
        assert cfg.weight_decay == 5e-4
    assert f"Reported top-1: {sgd_top1 if optimizer == 'sgd' else lars_top1}" in path.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SMALL)
def test_the_recipes_for_data_that_ships_here_train_one_epoch(name, tmp_path, monkeypatch, capsys):
    if name.startswith("mnist") and not MNIST.is_dir():
        pytest.skip(f"no MNIST at {MNIST}")
    monkeypatch.chdir(REPO)  # the MNIST recipes name ../shared/data/mnist-t10k, as typed from the repository
    path = RECIPES / name
    cfg = _resolve(path, tmp_path)
    argv = ["--config", f"recipes/{name}", "--epochs", "1", "-n", "one", "--runs-dir", str(tmp_path), "--no-progress"]
    if cfg.warmup_epochs > 1:
        argv += ["--warmup-epochs", "1"]
    if cfg.batch_trace == "auto":  # one process here: two micro-batches a step to measure the noise scale from
        argv += ["--accum-steps", "2"]
    assert run.main(argv) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "one" / "config.json").read_text())
    assert saved["config_file"] == str(path.resolve()) and saved["optimizer"] == cfg.optimizer
    rows = (tmp_path / "one" / "metrics.csv").read_text().strip().splitlines()
    val_acc = float(rows[1].split(",")[rows[0].split(",").index("val_acc")])
    assert len(rows) == 2 and math.isfinite(val_acc) and val_acc > 0.5  # chance is 0.1


def test_the_sweep_runs_each_recipe_at_each_batch_and_seed(tmp_path, monkeypatch):
    """--recipes: the file says everything; the sweep sets only the per-process batch, the seed and the name."""
    sweep, commands = recording_sweep(monkeypatch)
    recipe = 'optimizer = "lamb"\nbase-lr = 0.03\nlr-scaling = "sqrt"\nbase-batch-size = 64\nepochs = 3\n'
    path = _write(tmp_path, recipe)
    argv = ["--recipes", str(path), "--batch-sizes", "512", "64", "--seeds", "1", "2", "--out", str(tmp_path / "out")]
    assert sweep.main(argv) == 0
    names, seen = [], []
    for cmd in commands:
        flags = cmd[cmd.index(str(REPO / "run.py")) + 1 :]
        cfg, _ = config.parse(flags)
        names.append(cfg.name)
        seen.append((cfg.optimizer, cfg.base_lr, cfg.epochs, cfg.batch_size, cfg.seed))
    assert names == ["flags-b64-s1", "flags-b64-s2", "flags-b512-s1", "flags-b512-s2"]
    assert seen == [(("lamb", 0.03, 3, b, s)) for b in (32, 256) for s in (1, 2)]


def test_the_sweep_gives_each_recipe_its_own_table_as_the_docs_say(tmp_path, monkeypatch):
    """Each recipe is one label, as each optimizer is: a table of its own (a batch a line) and a line of the figure.
    Broken on purpose: docs/tools.md's old "makes each recipe file one table line" fails it."""
    sweep, _ = recording_sweep(monkeypatch)
    handed = []
    monkeypatch.setattr(sweep, "over_seeds", lambda runs: {"batch": 0, "lr": 0.1, "value": 1.0, "best": 1.0,
                                                            "seconds": 1.0, "wall": 1.0, "runs": 1})  # fmt: skip
    monkeypatch.setattr(sweep, "write_results", lambda out, results, *a: handed.append(results))
    paths = [_write(tmp_path, f'optimizer = "{name}"\n', f"{name}.toml") for name in ("sgd", "lamb")]
    argv = ["--recipes", *map(str, paths), "--batch-sizes", "64", "512", "--out", str(tmp_path / "out")]
    assert sweep.main(argv) == 0
    (results,) = handed
    assert {label: len(cells) for label, cells in results.items()} == {"sgd": 2, "lamb": 2}
    metric = {"title": "top-1 accuracy", "unit": "%", "better": "max"}
    load_sweep().write_results(tmp_path, results, "python tools/sweep.py ...", metric)  # the real one
    text = (tmp_path / "results.md").read_text()
    assert text.count("| Batch |") == 2 and "## sgd" in text and "## lamb" in text
    said = (REPO / "docs" / "tools.md").read_text() + sweep.__doc__
    assert "gives each recipe file its own table" in said and "one table line" not in said
    assert "one line of the table" not in said


def test_the_sweep_refuses_recipes_with_optimizer_flags(tmp_path, capsys):
    sweep = load_sweep()
    path = _write(tmp_path, 'optimizer = "lamb"\n')
    argv = ["--recipes", str(path), "--optimizers", "sgd", "--batch-sizes", "64", "--out", str(tmp_path / "out")]
    assert sweep.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: --recipes files give each line's optimizer and LR")


def test_the_sweep_reports_mean_and_spread_over_seeds(tmp_path):
    """Mean, sample standard deviation, min-max and the gap to the best smallest-batch mean, by hand."""
    sweep = load_sweep()
    runs = lambda batch, accs: [  # noqa: E731
        {"batch": batch, "lr": 0.1, "value": a, "best": a + 1, "seconds": 2.0, "wall": 10.0} for a in accs
    ]
    results = {
        "sgd": [sweep.over_seeds(runs(64, [97.0, 98.0, 99.0])), sweep.over_seeds(runs(8000, [10.0, 12.0, 20.0]))],
        "lamb": [sweep.over_seeds(runs(64, [96.0, 96.5, 97.0])), sweep.over_seeds(runs(8000, [94.0, 95.0, 96.0]))],
    }
    cell = results["sgd"][1]
    assert cell["value"] == pytest.approx(14.0)
    assert cell["value_std"] == pytest.approx(((4.0**2 + 2.0**2 + 6.0**2) / 2) ** 0.5)
    assert (cell["value_min"], cell["value_max"], cell["runs"], cell["wall"]) == (10.0, 20.0, 3, 30.0)
    accuracy = {
        "name": "acc",
        "column": "val_acc",
        "title": "top-1 accuracy",
        "unit": "%",
        "better": "max",
        "scale": 100.0,
    }
    sweep.write_results(tmp_path, results, "python tools/sweep.py ...", accuracy)
    text = (tmp_path / "results.md").read_text()
    assert "| 8000 | 0.1 | 95.00 % ± 1.00 (94.00–96.00) | -3.00 pt | 96.00 % | 2.0 s | 3 |" in text
    assert "Wall time of the cells, start-up and evaluation included: 2.0 min" in text
    sweep.plots.accuracy_vs_batch(results, tmp_path / "acc.png", accuracy)
    assert (tmp_path / "acc.png").stat().st_size > 0


def test_the_sweep_runs_every_line_at_each_lr_of_the_grid(tmp_path, monkeypatch):
    """--lr-grid: each recipe's own LR times each factor, every batch and seed; the cell name says the LR."""
    sweep, commands = recording_sweep(monkeypatch)
    monkeypatch.setattr(sweep, "best_of_grid", lambda grid, better: (next(iter(grid)), {}))  # nothing was run
    path = _write(tmp_path, 'optimizer = "lamb"\nbase-lr = 0.03\nlr-scaling = "sqrt"\nbase-batch-size = 64\n')
    argv = ["--recipes", str(path), "--batch-sizes", "64", "--lr-grid", "0.5", "2", "--out", str(tmp_path / "out")]
    assert sweep.main(argv) == 0
    parsed = [config.parse(cmd[cmd.index(str(REPO / "run.py")) + 1 :])[0] for cmd in commands]
    assert [(cfg.name, cfg.base_lr) for cfg in parsed] == [("flags-b64-lr0.015", 0.015), ("flags-b64-lr0.06", 0.06)]


def test_the_sweep_reports_the_best_lr_of_the_grid_and_the_steps_to_a_target(tmp_path):
    sweep = load_sweep()
    cell = lambda lr, acc, reached: {  # noqa: E731
        "batch": 512, "lr": lr, "value": acc, "best": acc, "seconds": 1.0, "wall": 1.0, "to_target": reached,
    }  # fmt: skip
    grid = {0.5: sweep.over_seeds([cell(0.05, 97.0, None)]), 1.0: sweep.over_seeds([cell(0.1, 98.5, (300, 9600))]),
            2.0: sweep.over_seeds([cell(0.2, 98.1, (250, 8000)), cell(0.2, 98.3, (350, 11200))])}  # fmt: skip
    best, chosen = sweep.best_of_grid(grid, "max")
    assert best == 1.0 and chosen["value"] == 98.5  # the best mean final value, not the fastest to the target
    assert chosen["grid"] == [(0.05, 97.0, False), (0.1, 98.5, True), (0.2, pytest.approx(98.2), False)]
    assert grid[2.0]["steps_to_target"] == 300 and grid[2.0]["samples_to_target"] == 9600  # the mean of both runs
    assert grid[0.5]["reached"] == 0 and grid[0.5]["steps_to_target"] is None
    accuracy = {"name": "acc", "column": "val_acc", "title": "top-1 accuracy", "unit": "%", "better": "max",
                "scale": 100.0}  # fmt: skip
    sweep.write_results(tmp_path, {"sgd": [chosen]}, "python tools/sweep.py ...", accuracy, target=98)
    text = (tmp_path / "results.md").read_text()
    assert (
        "| 512 | 0.1 | 98.50 % | +0.00 pt | 98.50 % | 300 | 9,600 | 1.0 s | 1 "
        "| 0.05: 97.00, **0.1: 98.50**, 0.2: 98.20 |" in text
    )


def test_steps_and_samples_to_a_target_count_each_epoch_at_its_own_batch():
    sweep = load_sweep()
    rows = [
        {"step": 100, "global_batch": 64.0},
        {"step": 150, "global_batch": 128.0},
        {"step": 175, "global_batch": 256.0},
    ]
    assert sweep.to_target(rows, [90.0, 97.9, 98.0], 98, "max") == (175, 100 * 64 + 50 * 128 + 25 * 256)
    assert sweep.to_target(rows, [90.0, 98.5, 99.0], 98, "max") == (150, 100 * 64 + 50 * 128)
    assert sweep.to_target(rows, [90.0, 91.0, 92.0], 98, "max") is None
    assert sweep.to_target(rows, [3.0, 2.0, 1.0], 2.5, "min") == (150, 100 * 64 + 50 * 128)
