"""The command line: `parse(argv)` loads the task the flags name (`--task`), adds its flags, reads `--config FILE`,
checks everything, and returns the validated `argparse.Namespace` and the task class; a user mistake raises
`UserError` (one sentence). No torch import here: `--help` and flag errors answer at once.

    flags.py        the flags, by trick          config_file.py  --config FILE.toml
    tasks.py        --task and the monitored metric          checks.py  values and combinations
    large_models.py --activation-checkpointing, --fsdp-replicas (a group after flags.py's)
    step_flags.py   per-step rows (--log-interval, --wandb), --max-steps, --eval-every-steps
    init_flags.py   --init-from: a new run from another run's checkpoint or a weights file
    image_flags.py  the image recipe by timm's names (--mean, --aa, --reprob, --mixup, --aug-repeats, ...)
    options.py      what each component (plan, optimizer, schedule, loaders, start-up checks) takes from the flags
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ddp_tricks import optim
from ddp_tricks.cli import config_file
from ddp_tricks.cli.checks import check, given_flags
from ddp_tricks.cli.config_file import blame
from ddp_tricks.cli.flags import Parser
from ddp_tricks.cli.image_flags import image_options, mixing_options
from ddp_tricks.cli.init_flags import init_options
from ddp_tricks.cli.large_models import build_parser
from ddp_tricks.cli.options import (
    check_options,
    hang_options,
    loader_options,
    model_options,
    optimizer_options,
    plan_options,
    schedule_options,
)
from ddp_tricks.cli.step_flags import step_log_options, step_sink_options
from ddp_tricks.cli.tasks import DEFAULT_TASK, load_task, mode_of, monitored_metric
from ddp_tricks.errors import UserError, report

__all__ = [
    "parse",
    "answer_early",
    "describe_lr",
    "build_parser",
    "model_options",
    "blame",
    "load_task",
    "mode_of",
    "DEFAULT_TASK",
    "plan_options",
    "optimizer_options",
    "schedule_options",
    "loader_options",
    "check_options",
    "hang_options",
    "step_log_options",
    "step_sink_options",
    "init_options",
    "image_options",
    "mixing_options",
]


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, type]:
    """Parse and check the command line; returns (flags, task class). Raises UserError on any mistake.

    With `--config FILE`, the file's flags come first, as if typed before the command line, which overrides them."""
    config_file.remember(None, {})
    argv = sys.argv[1:] if argv is None else list(argv)
    early = Parser(add_help=False, allow_abbrev=False)
    early.add_argument("--task", default=None)
    early.add_argument("--config", dest="config_file", default=None)
    first = early.parse_known_args(argv)[0]
    path = first.config_file
    table = config_file.read_config(path) if path else {}
    if first.task is None and "task" in table:  # the task adds flags: the file may name it
        if not isinstance(table["task"], str):
            raise UserError(f"--config {path}, key 'task': write it as a string, task = \"FILE.py:NAME\"")
        config_file.remember(path, {"--task": "task"})
    task_spec = first.task or table.get("task") or DEFAULT_TASK
    try:
        task_class = load_task(task_spec)
    except UserError as error:
        raise blame(error) from None
    parser = build_parser()
    if hasattr(task_class, "add_arguments"):
        task_class.add_arguments(parser)
    parser.default_task = task_spec == DEFAULT_TASK  # an example's flag without its --task is explained
    if task_spec != DEFAULT_TASK:  # so that --dataset with another task is explained, not "did you mean"
        builtin = argparse.ArgumentParser(add_help=False)
        load_task(DEFAULT_TASK).add_arguments(builtin)
        parser.builtin_task_flags = {o for a in builtin._actions for o in a.option_strings} - {
            o for a in parser._actions for o in a.option_strings
        }
    file_argv, file_keys = config_file.config_argv(table, parser, path) if path else ([], {})
    cfg = parser.parse_args(file_argv + argv)
    cfg.base_lr_default = cfg.base_lr is None  # neither typed nor in the file: the optimizer's own
    if cfg.base_lr_default:
        cfg.base_lr = optim.default_lr(cfg.optimizer, cfg.lars_wrap)
    replaced: set[str] = set()  # the file's `epochs` where --max-steps is typed: not used, not given
    if path:
        typed = given_flags(parser, argv)
        replaced = config_file.replaced_by_typed(cfg, parser, file_keys, typed)
        kept = set(file_keys) - typed - replaced
        from_file = [action for action in parser._actions if action.dest in kept]
        config_file.remember(path, {option: file_keys[a.dest] for a in from_file for option in a.option_strings})
    try:
        check(cfg, parser, given_flags(parser, file_argv + argv) - replaced)
        cfg.monitor = monitored_metric(task_class, cfg.monitor, ema=cfg.model_ema is not None)
    except UserError as error:
        raise blame(error) from None
    if cfg.config_file is not None:
        cfg.config_file = str(Path(cfg.config_file).resolve())
    if cfg.name is None:
        if cfg.resume == "auto":  # else every start (a launcher's restart too) would name a new run: none to continue
            raise UserError("--resume auto continues the run named by -n NAME: give -n (the run's folder name)")
        cfg.name = default_name()
    cfg.run_dir = str(Path(cfg.runs_dir) / cfg.name)
    return cfg, task_class


def default_name() -> str:
    """A run's name without -n: the time it starts; in a torchrun job of several nodes or with restarts, the job's
    rendezvous id (--rdzv-id), which every node and every restart knows alike (clocks may not agree to the second)."""
    several = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if several and os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"run-{os.environ['TORCHELASTIC_RUN_ID']}"
    return time.strftime("%Y%m%d-%H%M%S")


def describe_lr(flags: argparse.Namespace, lr: float) -> str:
    """The run's learning rate for its start line, and where it comes from when --base-lr was not given."""
    scaling = f"--lr-scaling {flags.lr_scaling}"
    if not flags.base_lr_default:
        return f"learning rate {lr:.6g} ({scaling})"
    whose = f"--optimizer {flags.optimizer}{' --lars-wrap' if flags.lars_wrap else ''}"
    if flags.lr_scaling == "keep":
        return f"learning rate {lr:.6g} (the default for {whose}; --base-lr to change)"
    return f"learning rate {lr:.6g} (--base-lr {flags.base_lr:g}, the default for {whose}, with {scaling})"


def answer_early(argv: list[str]) -> None:
    """`run.py --help` and flag mistakes, answered before torch is imported: help exits 0 (argparse), a mistake
    prints one line (on rank 0 only: every rank parses the same flags) and exits 2, another rank lingering first.
    run.py calls it first, as a script: SIGTERM is held from here on (before the task file and torch are imported),
    so the SIGTERM a launcher sends every worker once one has ended cannot kill rank 0 before it says a mistake
    (watchdog: the hold, and the linger that leaves rank 0 time to say it)."""
    from ddp_tricks.distributed import watchdog

    watchdog.hold_sigterm()
    try:
        parse(argv)
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            report(str(error))
        else:
            watchdog.linger()
        sys.exit(2)
