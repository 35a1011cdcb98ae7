"""The command line: flags grouped by trick, the original projects' aliases, and checks of combinations.

`parse(argv)` loads the task the flags name (`--task`), adds its own flags, and returns the validated
`argparse.Namespace` and the task class; a user mistake raises `UserError` (one sentence). `--config FILE.toml`
reads flags from a file as if typed before the command line. No torch import here: `--help` and flag errors
answer at once.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

DEFAULT_TASK = "task.py:Task"
TASK_NEEDS = ("datasets", "model", "loss")
OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
SCHEDULERS = ("constant", "plateau", "poly", "cosine", "step")


class UserError(Exception):
    """A mistake in what the user asked for: run.py prints it as one line and exits with code 2.

    `rank_specific`: only this process is affected (say, its GPU), so it prints even when it is not rank 0.
    """

    def __init__(self, message: str, rank_specific: bool = False):
        super().__init__(message)
        self.rank_specific = rank_specific


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors on one line (exit code 2, as argparse does) and suggests the flag
    an unknown one was probably meant to be."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's own contract
        raise UserError(f"{message} (see `python run.py --help`)")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's own contract
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._did_you_mean(extras)}")
        return namespace

    def _did_you_mean(self, extras: list[str]) -> str:
        known = [option for action in self._actions for option in action.option_strings]
        for token in extras:
            flag = token.split("=", 1)[0]
            if flag in getattr(self, "builtin_task_flags", ()):
                return f"; {flag} is a flag of the built-in task (task.py), and --task names another"
            if flag.startswith("-") and len(flag) > 2:
                # suggest the dashed spellings; the original projects' snake_case ones only to snake_case
                candidates = known if "_" in flag else [option for option in known if "_" not in option]
                close = difflib.get_close_matches(flag, candidates, n=1)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (on/off flags: off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default is argparse.SUPPRESS
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        ):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_NUMBERS = (int, float, _positive_int)  # the types whose values a config file must write as TOML numbers


def build_parser() -> argparse.ArgumentParser:
    """The full command line. Long flags read as English; the original projects' spellings are aliases."""
    p = _Parser(
        prog="run.py",
        formatter_class=_HelpFormatter,
        description="Train with DistributedDataParallel and large-batch tricks. "
        "Launch with `torchrun --nproc_per_node=N run.py ...` or plain `python run.py ...`.",
        allow_abbrev=False,
    )

    g = p.add_argument_group("run")
    g.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE.toml",
        help="flags from a TOML file, keys named like the long flags (base-lr = 0.1, nesterov = true); flags on "
        "the command line override it; recipes/ holds published and tuned settings",
    )
    g.add_argument(
        "--task",
        default=DEFAULT_TASK,
        metavar="FILE.py[:NAME]",
        help="what is trained: a task class in a file (default: task.py:Task, image classification)",
    )
    g.add_argument(
        "--monitor-metric",
        "--monitor",
        dest="monitor",
        default=None,
        metavar="METRIC",
        help="the validation metric that picks best.pt and drives early stopping and plateau (default: the task's); "
        "under torchrun spell it --monitor-metric: torchrun takes --monitor for its own --monitor-interval",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run folder that holds a run (clears it); without it such a folder is refused",
    )
    g.add_argument(
        "-n",
        "--name",
        "--exp_name",
        dest="name",
        default=None,
        help="run folder name under --runs-dir (default: a timestamp)",
    )
    g.add_argument(
        "-p",
        "--runs-dir",
        "--model_path",
        dest="runs_dir",
        default="runs",
        help="parent folder of run folders (default: runs)",
    )
    g.add_argument("-e", "--epochs", type=_positive_int, default=10, help="epochs to train (default: 10)")
    g.add_argument("-s", "--seed", "--seed_num", dest="seed", type=int, default=0, help="random seed (default: 0)")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) for bit-reproducible runs",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the starting weights (fresh or --resume), write the metrics row, exit",
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from a checkpoint; `auto` takes runs/<name>/last.pt when it exists",
    )
    g.add_argument(
        "--checkpoint-every-steps",
        type=int,
        default=0,
        metavar="K",
        help="also write last.pt every K optimizer steps, mid-epoch (0: only after each epoch)",
    )
    g.add_argument(
        "--on-nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="a NaN/inf loss (without fp16's scaler): stop every rank (default), or skip that step "
        "on every rank (costs one host sync per step)",
    )
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    g.add_argument(
        "--plot-lr",
        action="store_true",
        help="draw the LR schedule these flags produce into runs/<name>/lr_schedule.png, and exit",
    )
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to runs/<name>/tb/")
    g.add_argument(
        "--log-interval",
        type=_positive_int,
        default=20,
        help="steps between progress updates (the only host syncs in the loop; default: 20)",
    )

    g = p.add_argument_group("launch and devices")
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda:LOCAL_RANK when CUDA is available, else cpu",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend (auto: nccl on cuda, gloo on cpu)",
    )
    g.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=None,
        help="set by the legacy `python -m torch.distributed.launch`; torchrun uses LOCAL_RANK",
    )
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds a collective may wait before the run fails instead of hanging (default: 600)",
    )

    g = p.add_argument_group("data loading")
    g.add_argument(
        "-b",
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=_positive_int,
        default=32,
        help="micro-batch per rank (default: 32)",
    )
    g.add_argument("--val-batch-size", type=_positive_int, default=256, help="evaluation batch per rank")
    g.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader workers per rank (default: 0, right for the in-memory default data)",
    )
    g.add_argument("--prefetch-factor", type=_positive_int, default=2, help="batches prefetched per worker")

    g = p.add_argument_group("optimizer")
    g.add_argument(
        "--optimizer",
        "--base-op",
        dest="optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="sgd, adam, adamw, lars (standalone), lamb (default: sgd)",
    )
    g.add_argument(
        "-l",
        "--base-lr",
        "--learning-rate",
        "--learning_rate",
        "--lr",
        dest="base_lr",
        type=float,
        default=0.05,
        help="learning rate before scaling (default: 0.05)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="SGD/LARS momentum (default: 0.9)")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD, LARS)")
    g.add_argument(
        "--wd", "--weight-decay", dest="weight_decay", type=float, default=5e-4, help="weight decay (default: 5e-4)"
    )
    g.add_argument("--lars-wrap", action="store_true", help="LARSWrapper over the chosen optimizer")
    g.add_argument("--trust-coefficient", type=float, default=0.001, help="LARS trust coefficient (default: 0.001)")
    g.add_argument("--epsilon", type=float, default=1e-8, help="LARS epsilon (default: 1e-8)")
    g.add_argument(
        "--bn-bias-separately",
        action="store_true",
        help="norm-layer parameters and biases: no LARS scaling, no weight decay",
    )
    g.add_argument("--lookahead", action="store_true", help="Lookahead over the optimizer")
    g.add_argument("--lookahead-k", type=_positive_int, default=5, help="Lookahead sync period (default: 5)")
    g.add_argument("--lookahead-alpha", type=float, default=0.5, help="Lookahead slow step (default: 0.5)")
    g.add_argument("--clip-grad-norm", type=float, default=0.0, help="clip the global gradient norm (0: off)")

    g = p.add_argument_group("learning-rate schedule")
    g.add_argument(
        "-w",
        "--warmup-epochs",
        "--warmup_epochs",
        dest="warmup_epochs",
        type=float,
        default=0.0,
        help="linear warmup length in epochs, fractions allowed (default: 0)",
    )
    g.add_argument(
        "-t",
        "--warmup-type",
        "--warmup_type",
        dest="warmup_type",
        choices=("linear", "cosine"),
        default="linear",
        help="cosine: warmup, then cosine decay to --end-lr (the same as --scheduler cosine)",
    )
    g.add_argument("--scheduler", choices=SCHEDULERS, default="constant", help="schedule after warmup")
    g.add_argument("--plateau-factor", type=float, default=0.1, help="plateau: LR multiplier on a cut")
    g.add_argument("--plateau-patience", type=int, default=2, help="plateau: epochs without improvement")
    g.add_argument("--lr-power", type=float, default=None, help="poly: decay power (default: 2 with LARS, else 1)")
    g.add_argument("--end-lr", type=float, default=0.0, help="poly/cosine: the LR of the run's last step (default: 0)")
    g.add_argument("--step-epochs", type=float, default=30.0, help="step: epochs between decays")
    g.add_argument("--step-gamma", type=float, default=0.1, help="step: LR multiplier at each decay")
    g.add_argument(
        "--lr-scaling",
        choices=("keep", "linear", "sqrt"),
        default="keep",
        help="scale --base-lr by global batch / --base-batch-size (or its square root)",
    )
    g.add_argument("--base-batch-size", type=_positive_int, default=256, help="reference batch of --lr-scaling")

    g = p.add_argument_group("batching and precision")
    g.add_argument(
        "--accum-steps",
        "--batches-per-allreduce",
        dest="accum_steps",
        type=_positive_int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation)",
    )
    g.add_argument("--amp", choices=("off", "fp16", "bf16"), default="off", help="mixed precision (torch.amp)")
    g.add_argument(
        "--amp-backend",
        choices=("native", "apex"),
        default="native",
        help="apex only where NVIDIA Apex's apex.amp imports",
    )

    g = p.add_argument_group("variable batch size (a trace)")
    g.add_argument(
        "--batch-trace",
        default=None,
        metavar="FILE",
        help="CSV `step,batchsize`: the global batch of every optimizer step (multiples of --batch-size)",
    )
    g.add_argument(
        "--trace-end",
        choices=("error", "repeat-last"),
        default="error",
        help="a trace shorter than the run: an error (default) or repeat its last batch size",
    )
    g.add_argument(
        "--batch-lr-rule",
        choices=("none", "linear", "root", "adascale"),
        default="none",
        help="LR of step i = LR x B_i / ref (linear), x sqrt of it (root), x AdaScale's gain",
    )
    g.add_argument(
        "--ref-batch-size",
        type=_positive_int,
        default=None,
        help="the batch the LR is given for (default: the trace's first batch size)",
    )

    g = p.add_argument_group("early stopping")
    g.add_argument("--early-stop-patience", type=int, default=0, help="epochs without improvement (0: off)")
    g.add_argument("--early-stop-delta", type=float, default=0.0, help="smallest change that counts")

    g = p.add_argument_group("DDP performance")
    g.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm before DDP")
    g.add_argument("--precise-bn", type=int, default=0, metavar="SAMPLES",
                   help="before each evaluation, recompute BatchNorm's running statistics with the current weights "
                        "as the average over about SAMPLES training samples (whole micro-batches, split over the "
                        "ranks; precise BN: for runs of few steps, such as very large batches); 0: off")  # fmt: skip
    g.add_argument("--static-graph", action="store_true", help="DDP static_graph=True")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default: 25)")
    g.add_argument("--find-unused-parameters", action="store_true", help="DDP find_unused_parameters=True")
    g.add_argument("--channels-last", action="store_true", help="channels-last memory format")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (eager with a warning if not)")
    return p


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, type]:
    """Parse and check the command line; returns (flags, task class). Raises UserError on any mistake.

    With `--config FILE`, the file's flags come first, as if typed before the command line, which overrides them."""
    global _from_file
    _from_file = None
    argv = sys.argv[1:] if argv is None else list(argv)
    early = _Parser(add_help=False, allow_abbrev=False)
    early.add_argument("--task", default=None)
    early.add_argument("--config", dest="config_file", default=None)
    first = early.parse_known_args(argv)[0]
    path = first.config_file
    table = read_config(path) if path else {}
    if first.task is None and "task" in table:  # the task adds flags: the file may name it
        if not isinstance(table["task"], str):
            raise UserError(f"--config {path}, key 'task': write it as a string, task = \"FILE.py:NAME\"")
        _from_file = (path, {"--task": "task"})
    task_spec = first.task or table.get("task") or DEFAULT_TASK
    try:
        task_class = load_task(task_spec)
    except UserError as error:
        raise blame(error) from None
    parser = build_parser()
    if hasattr(task_class, "add_arguments"):
        task_class.add_arguments(parser)
    if task_spec != DEFAULT_TASK:  # so that --dataset with another task is explained, not "did you mean"
        builtin = argparse.ArgumentParser(add_help=False)
        load_task(DEFAULT_TASK).add_arguments(builtin)
        parser.builtin_task_flags = {o for a in builtin._actions for o in a.option_strings} - {
            o for a in parser._actions for o in a.option_strings
        }
    file_argv, file_keys = config_argv(table, parser, path) if path else ([], {})
    cfg = parser.parse_args(file_argv + argv)
    if path:
        typed = given_flags(parser, argv)
        from_file = [action for action in parser._actions if action.dest in file_keys and action.dest not in typed]
        _from_file = (path, {option: file_keys[a.dest] for a in from_file for option in a.option_strings})
    try:
        check(cfg, given_flags(parser, file_argv + argv))
        cfg.monitor = monitored_metric(task_class, cfg.monitor)
    except UserError as error:
        raise blame(error) from None
    if cfg.config_file is not None:
        cfg.config_file = str(Path(cfg.config_file).resolve())
    if cfg.name is None:
        cfg.name = time.strftime("%Y%m%d-%H%M%S")
    if cfg.lr_power is None:
        cfg.lr_power = 2.0 if cfg.optimizer == "lars" else 1.0
    cfg.run_dir = str(Path(cfg.runs_dir) / cfg.name)
    return cfg, task_class


# The config file of the last parse() and which of its keys set each option the command line did not override:
# a later error that names such an option (say, from the task's datasets()) names the file and the key too.
_from_file: tuple[str, dict[str, str]] | None = None


def blame(error: UserError) -> UserError:
    """The error, naming the config file and its key when the first flag it mentions came from the file."""
    if _from_file is None or str(error).startswith("--config "):
        return error
    path, keys = _from_file
    for option in re.findall(r"--[A-Za-z][\w-]*", str(error)):
        if option in keys:
            return UserError(f"--config {path}, key {keys[option]!r}: {error}", error.rank_specific)
    return error


def read_config(path: str) -> dict:
    """The TOML table of a config file; a missing, unreadable or malformed file is a UserError."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise UserError("--config needs Python 3.11 or newer (its tomllib reads TOML)") from None
    if not Path(path).is_file():
        what = "is a folder" if Path(path).is_dir() else "does not exist"
        raise UserError(f"--config {path} {what}: give a TOML file of flags, like those in recipes/")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"--config {path} is not valid TOML ({error}); a flag is one line: base-lr = 0.1") from None
    except OSError as error:
        raise UserError(f"--config {path} cannot be read ({error.strerror}): check its permissions") from None


def config_argv(table: dict, parser: argparse.ArgumentParser, path: str) -> tuple[list[str], dict[str, str]]:
    """A config file's table as command-line tokens, checked one key at a time, and which key set each destination.

    A key is a long flag without its dashes (`base-lr` or `base_lr`); `true` gives an on/off flag, `false` leaves it
    off; a list gives a flag that takes several values. Numbers must be TOML numbers, not strings."""
    options = {option: action for action in parser._actions for option in action.option_strings}
    tokens: list[str] = []
    keys: dict[str, str] = {}
    for key, value in table.items():
        where = f"--config {path}, key {key!r}"
        if isinstance(value, dict):
            raise UserError(f"{where} is a table: write every flag as a top-level `key = value`, not under [sections]")
        action = options.get(f"--{key}") or options.get(f"--{key.replace('_', '-')}")
        if action is not None and action.dest in ("help", "config_file"):
            raise UserError(f"{where}: a config file holds settings, not {_flag(parser, action.dest)}: remove it")
        if action is None:
            names = [o[2:] for o, a in options.items() if o.startswith("--") and "_" not in o and a.dest != "help"]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "keys are the long flags of `python run.py --help`"
            raise UserError(f"--config {path}: unknown key {key!r} (no flag --{key}); {hint}")
        flag = _flag(parser, action.dest)
        if action.dest in keys:
            raise UserError(f"--config {path}: keys {keys[action.dest]!r} and {key!r} both set {flag}: keep one")
        keys[action.dest] = key
        tokens += _tokens(action, flag, key, value, where)
    return tokens, keys


def _tokens(action: argparse.Action, flag: str, key: str, value, where: str) -> list[str]:
    if action.nargs == 0:  # an on/off flag
        if not isinstance(value, bool):
            raise UserError(f"{where}: {flag} is an on/off flag: write {key} = true or {key} = false, not {value!r}")
        return [flag] if value else []
    several = action.nargs in ("*", "+") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, list) and not several and not isinstance(action, argparse._AppendAction):
        raise UserError(f"{where}: {flag} takes one value, not a list")
    texts = [_text(action, flag, item, where) for item in (value if isinstance(value, list) else [value])]
    if several:
        return [flag, *texts]
    return [f"{flag}={text}" for text in texts]  # `=`: a value that starts with '-' stays a value


def _text(action: argparse.Action, flag: str, value, where: str) -> str:
    """One value as the command line would spell it, after the conversion and choices of its flag."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UserError(
            f"{where}: {flag} takes a value, not {str(value).lower() if isinstance(value, bool) else value}"
        )
    if isinstance(value, str) and action.type in _NUMBERS:
        raise UserError(f"{where}: {flag} takes a number, not the string {value!r}: write it without quotes")
    text = str(value)
    convert = action.type if callable(action.type) else str
    try:
        converted = convert(text)
    except argparse.ArgumentTypeError as error:
        raise UserError(f"{where}: {flag} {error}") from None
    except (TypeError, ValueError):
        raise UserError(
            f"{where}: {flag} takes {getattr(convert, '__name__', 'another')} values, not {text!r}"
        ) from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(str(choice) for choice in action.choices)
        raise UserError(f"{where}: {flag} is one of {choices}, not {converted!r}")
    return text


def answer_early(argv: list[str]) -> None:
    """`run.py --help` and flag mistakes, answered before torch is imported: help exits 0 (argparse), a mistake
    prints one line (on rank 0 only: every rank parses the same flags) and exits 2."""
    try:
        parse(argv)
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            report(str(error))
        sys.exit(2)


def report(message: str, log_file: Path | None = None) -> None:
    """A user error: one line on stderr (and in the run's train.log when there is one)."""
    print(f"error: {message}", file=sys.stderr)
    if log_file is not None and log_file.exists():
        with open(log_file, "a") as f:
            f.write(f"error: {message}\n")


def load_task(spec: str) -> type:
    """`path/to/file.py:ClassName` (ClassName defaults to Task); a relative path is looked up from the current
    folder, then beside run.py. The class must have datasets(), model() and loss() (see task.py)."""
    path_text, _, name = spec.partition(":")
    name = name or "Task"
    path = Path(path_text)
    if not path.exists() and not path.is_absolute() and (Path(__file__).resolve().parent / path).exists():
        path = Path(__file__).resolve().parent / path
    if path.suffix != ".py" or not path.is_file():
        raise UserError(f"--task {spec!r}: no Python file {path_text!r}; give --task path/to/file.py:ClassName")
    module_spec = importlib.util.spec_from_file_location(f"task_{path.stem}_{abs(hash(str(path.resolve())))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # an error inside the user's file shows its traceback
    task_class = getattr(module, name, None)
    if not isinstance(task_class, type):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise UserError(
            f"--task {spec!r}: {path_text} has no class {name!r} (it defines: {', '.join(found) or 'no classes'}); "
            f"name one after the colon"
        )
    missing = [f"{m}()" for m in TASK_NEEDS if not callable(getattr(task_class, m, None))]
    if missing:
        raise UserError(
            f"--task {spec!r}: {name} lacks {', '.join(missing)}; a task needs datasets(), model() and "
            "loss(outputs, targets) (see task.py)"
        )
    return task_class


def monitored_metric(task_class: type, flag: str | None) -> str:
    """The validation metric the run follows, as `val_<name>`: --monitor (`acc` or `val_acc`) or the task's."""
    names = ["loss", *getattr(task_class, "better", {})]
    name = flag if flag is not None else getattr(task_class, "monitor", "loss")
    bare = name[4:] if name.startswith("val_") else name
    if bare not in names:
        where = "--monitor-metric" if flag is not None else f"the task's monitor {name!r}"
        raise UserError(f"{where} {name!r} is not a reported metric: use one of {', '.join(names)}")
    return f"val_{bare}"


def mode_of(task_class, monitor: str) -> str:
    """'min' or 'max': which way the monitored metric improves."""
    return "min" if monitor == "val_loss" else getattr(task_class, "better", {})[monitor[4:]]


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> set[str]:
    """The destinations of the flags the command line spells out (not left at their defaults)."""
    parser = copy.deepcopy(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


# Flags that act only with another setting: given without it, they would be accepted and ignored.
_ONLY_WITH = (
    (("lookahead_k", "lookahead_alpha"), lambda cfg: cfg.lookahead, "--lookahead"),
    (("plateau_factor", "plateau_patience"), lambda cfg: cfg.scheduler == "plateau", "--scheduler plateau"),
    (("step_epochs", "step_gamma"), lambda cfg: cfg.scheduler == "step", "--scheduler step"),
    (("lr_power",), lambda cfg: cfg.scheduler == "poly", "--scheduler poly"),
    (("end_lr",), lambda cfg: _decay(cfg) in ("poly", "cosine"), "--scheduler poly or --scheduler cosine"),
    (
        ("trust_coefficient", "epsilon"),
        lambda cfg: cfg.optimizer == "lars" or cfg.lars_wrap,
        "--optimizer lars or --lars-wrap",
    ),
    (("momentum", "nesterov"), lambda cfg: cfg.optimizer in ("sgd", "lars"), "--optimizer sgd or --optimizer lars"),
    (("trace_end",), lambda cfg: cfg.batch_trace, "--batch-trace FILE"),
    (
        ("ref_batch_size",),
        lambda cfg: cfg.batch_lr_rule in ("linear", "root") or (cfg.batch_trace and cfg.lr_scaling != "keep"),
        "--batch-lr-rule linear or --batch-lr-rule root (or a trace with --lr-scaling linear or sqrt)",
    ),
    (("early_stop_delta",), lambda cfg: cfg.early_stop_patience > 0, "--early-stop-patience N"),
    (("prefetch_factor",), lambda cfg: cfg.workers > 0, "--workers N"),
    (("base_batch_size",), lambda cfg: cfg.lr_scaling != "keep", "--lr-scaling linear or --lr-scaling sqrt"),
)


def _decay(cfg: argparse.Namespace) -> str:
    """What follows warmup (schedulers.decay_kind, without importing torch here)."""
    return "cosine" if cfg.warmup_type == "cosine" and cfg.scheduler == "constant" else cfg.scheduler


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    """The long spelling of a destination, as --help shows it first (e.g. `--end-lr`)."""
    for action in parser._actions:
        if action.dest == dest:
            return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    return dest


def check(cfg: argparse.Namespace, given: set[str] | frozenset[str] = frozenset()) -> None:
    """Impossible values and combinations, found before any process exists. `given`: the flags spelled out
    on the command line (`given_flags`), so a flag that would be ignored is refused rather than dropped."""
    _check_values(cfg)
    _check_combinations(cfg)
    ignored = [(dest, needs) for dests, acts, needs in _ONLY_WITH for dest in dests if dest in given and not acts(cfg)]
    if ignored:
        dest, needs = ignored[0]
        flag = _flag(build_parser(), dest)
        raise UserError(
            f"{flag} acts only with {needs}, so it would be ignored: add {needs.split(' or ')[0]} or drop {flag}"
        )


def _check_values(cfg: argparse.Namespace) -> None:
    """One flag at a time. Written `not value > 0` so that nan is refused too."""
    if not cfg.base_lr > 0:
        raise UserError(f"--base-lr must be > 0, got {cfg.base_lr}")
    if cfg.workers < 0:
        raise UserError(f"--workers must be >= 0, got {cfg.workers}")
    if cfg.precise_bn < 0:
        raise UserError(f"--precise-bn must be >= 0 (training samples; 0 turns it off), got {cfg.precise_bn}")
    if not cfg.warmup_epochs >= 0:
        raise UserError(f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}")
    if cfg.warmup_epochs > cfg.epochs:
        raise UserError(f"--warmup-epochs {cfg.warmup_epochs} exceeds --epochs {cfg.epochs}; shorten the warmup")
    if not 0.0 <= cfg.momentum < 1.0:
        raise UserError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if not cfg.weight_decay >= 0:
        raise UserError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if not 0.0 < cfg.lookahead_alpha <= 1.0:
        raise UserError(f"--lookahead-alpha must be in (0, 1], got {cfg.lookahead_alpha}")
    if not cfg.trust_coefficient > 0:
        raise UserError(f"--trust-coefficient must be > 0, got {cfg.trust_coefficient}")
    if not cfg.epsilon >= 0:
        raise UserError(f"--epsilon must be >= 0, got {cfg.epsilon}")
    if not 0.0 < cfg.plateau_factor < 1.0:
        raise UserError(f"--plateau-factor must be in (0, 1), got {cfg.plateau_factor}")
    if cfg.plateau_patience < 0:
        raise UserError(f"--plateau-patience must be >= 0 (epochs without improvement), got {cfg.plateau_patience}")
    if not cfg.step_epochs > 0:
        raise UserError(f"--step-epochs must be > 0 (epochs between decays), got {cfg.step_epochs}")
    if not 0.0 < cfg.step_gamma <= 1.0:
        raise UserError(f"--step-gamma must be in (0, 1], got {cfg.step_gamma}")
    if not cfg.end_lr >= 0:
        raise UserError(f"--end-lr must be >= 0, got {cfg.end_lr}")
    if cfg.lr_power is not None and not cfg.lr_power > 0:
        raise UserError(f"--lr-power must be > 0, got {cfg.lr_power}")
    if not cfg.dist_timeout > 0:
        raise UserError(f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    if not cfg.bucket_cap_mb > 0:
        raise UserError(f"--bucket-cap-mb must be > 0, got {cfg.bucket_cap_mb}")
    if not cfg.early_stop_delta >= 0:
        raise UserError(f"--early-stop-delta must be >= 0, got {cfg.early_stop_delta}")
    if cfg.checkpoint_every_steps < 0:
        raise UserError(f"--checkpoint-every-steps must be >= 0, got {cfg.checkpoint_every_steps}")
    if cfg.early_stop_patience < 0:
        raise UserError(f"--early-stop-patience must be >= 0, got {cfg.early_stop_patience}")
    if not cfg.clip_grad_norm >= 0:
        raise UserError(f"--clip-grad-norm must be >= 0, got {cfg.clip_grad_norm}")
    if cfg.name is not None and ("/" in cfg.name or cfg.name in ("", ".", "..")):
        raise UserError(f"--name {cfg.name!r} must be a plain folder name, without '/'")


def _check_combinations(cfg: argparse.Namespace) -> None:
    """Flags that contradict each other, and what the machine or the installed packages cannot do."""
    if cfg.optimizer == "lars" and cfg.lars_wrap:
        raise UserError(
            "--lars-wrap wraps the optimizer in LARS and --optimizer lars is LARS already: use one of them "
            "(--optimizer lars, or --optimizer sgd --lars-wrap)"
        )
    if cfg.warmup_type == "cosine" and cfg.scheduler not in ("constant", "cosine"):
        raise UserError(
            f"--warmup-type cosine means cosine decay after warmup, but --scheduler {cfg.scheduler} asks for "
            f"another decay: keep --scheduler {cfg.scheduler} with --warmup-type linear, or use --scheduler cosine"
        )
    if cfg.batch_trace and cfg.accum_steps > 1:
        raise UserError("--batch-trace sets the accumulation of every step itself: drop --accum-steps")
    if cfg.batch_lr_rule != "none" and not cfg.batch_trace:
        raise UserError("--batch-lr-rule needs --batch-trace FILE")
    if cfg.nesterov and cfg.momentum == 0:
        raise UserError("--nesterov needs --momentum > 0")
    if cfg.backend == "nccl" and (cfg.device == "cpu" or _runs_on_cpu(cfg)):
        raise UserError("--backend nccl needs CUDA devices; use --backend gloo with --device cpu")
    if cfg.sync_bn and _launch_world_size() > 1 and _runs_on_cpu(cfg):
        raise UserError("--sync-bn needs CUDA devices (SyncBatchNorm does not run on CPU/gloo); drop --sync-bn")
    if cfg.amp_backend == "apex":
        _check_apex()
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


def _launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _runs_on_cpu(cfg: argparse.Namespace) -> bool:
    import torch

    return cfg.device == "cpu" or not torch.cuda.is_available()


def _check_apex() -> None:
    try:
        from apex import amp  # noqa: F401
    except ImportError:
        raise UserError(
            "--amp-backend apex needs NVIDIA Apex with apex.amp (removed from Apex in release 25.07); "
            "use native mixed precision: --amp fp16 or --amp bf16"
        ) from None
