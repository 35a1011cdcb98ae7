"""Which task a run trains: `--task FILE.py[:NAME]` loaded from its file, checked for the methods the loop calls,
and the validation metric the run follows (`--monitor-metric`, or the task's own) with its direction.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ddp_tricks import moved
from ddp_tricks.errors import UserError

DEFAULT_TASK = "task.py:Task"
TASK_NEEDS = ("datasets", "model", "loss")
REPO = Path(__file__).resolve().parents[2]  # where run.py and task.py stand


def load_task(spec: str) -> type:
    """`path/to/file.py:ClassName` (ClassName defaults to Task); a relative path is looked up from the current
    folder, then beside run.py. The file may import the modules beside it (its folder joins the end of sys.path).
    The class must have datasets(), model() and loss() (see task.py)."""
    path_text, _, name = spec.partition(":")
    name = name or "Task"
    path = Path(path_text)
    if not path.exists() and not path.is_absolute() and (REPO / path).exists():
        path = REPO / path
    if path.suffix != ".py" or not path.is_file():
        raise UserError(f"--task {spec!r}: no Python file {path_text!r}; give --task path/to/file.py:ClassName")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # the modules beside the task file import as they would beside a script
        sys.path.append(folder)
    module_spec = importlib.util.spec_from_file_location(f"task_{path.stem}_{abs(hash(str(path.resolve())))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)  # an error inside the user's file shows its traceback
    except ModuleNotFoundError as error:
        if error.name not in moved.NEW_HOMES:
            raise
        raise UserError(f"--task {spec!r}: {moved.message(error.name)}") from None
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


def examples_owning(flag: str) -> list[str]:
    """The example tasks (`examples/FILE.py:NAME`) that add `flag` to the command line: a task's flag given without
    its --task is said as such, not matched to a flag of the run's (--max-length is no --max-steps). Only the files
    that name the flag are loaded, on this error path alone, and what they imported beside them is forgotten."""
    import argparse

    owners, folder = [], str(REPO / "examples")
    before = set(sys.modules)
    sys.path.append(folder)
    try:
        for path in sorted((REPO / "examples").glob("*.py")):
            if f'"{flag}"' not in path.read_text():
                continue
            module_spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except Exception:  # an example that does not import here (a missing extra): it names no flag then
                continue
            for name, task_class in vars(module).items():
                if isinstance(task_class, type) and task_class.__module__ == module.__name__:
                    if callable(getattr(task_class, "add_arguments", None)):
                        parser = argparse.ArgumentParser(add_help=False)
                        task_class.add_arguments(parser)
                        if any(flag in action.option_strings for action in parser._actions):
                            owners.append(f"examples/{path.name}:{name}")
    finally:
        sys.path.remove(folder)
        for name in set(sys.modules) - before:  # the examples' own modules (contrastive, imported by byol)
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(folder):
                del sys.modules[name]
    return owners


def example_hint(flag: str) -> str | None:
    """What to say of `flag`, unknown to the built-in task's run, where examples have it (examples_owning)."""
    owners = examples_owning(flag) if flag.startswith("--") else []
    if len(owners) == 1:
        return f"{flag} is a flag of the task {owners[0]}: give --task {owners[0]}"
    return f"{flag} is a flag of the tasks {', '.join(owners)}: give --task with one of them" if owners else None


def monitored_metric(task_class: type, flag: str | None, ema: bool = False) -> str:
    """The validation metric the run follows, as `val_<name>`: --monitor (`mae` or `val_mae`; with --model-ema
    (`ema`) also the EMA weights' `ema_mae`) or the task's."""
    names = ["loss", *getattr(task_class, "better", {})]
    name = flag if flag is not None else getattr(task_class, "monitor", "loss")
    bare = name[4:] if name.startswith("val_") else name
    if bare.startswith("ema_") and bare[4:] in names and bare not in names:
        if not ema:
            raise UserError(f"--monitor-metric {name!r} follows the EMA's weights: add --model-ema DECAY")
        return f"val_{bare}"
    if bare not in names:
        where = "--monitor-metric" if flag is not None else "the task's monitor"
        raise UserError(
            f"{where} {name!r} is not a reported metric: use one of {', '.join(names)}, or name it in the task's "
            f"`better` (e.g. better = {{{bare!r}: 'max'}})"
        )
    if bare == "loss" and hasattr(task_class, "score"):
        where = "--monitor-metric loss" if flag is not None else "the task monitors its loss (monitor = 'loss')"
        named = ", ".join(getattr(task_class, "better", {})) or "none yet: name them in `better`"
        raise UserError(
            f"{where}, but the task scores its validation set with score(), which reports no validation loss: set "
            f"monitor = 'NAME' in the task (or pass --monitor-metric NAME), NAME one of its metrics ({named})"
        )
    return f"val_{bare}"


def mode_of(task_class, monitor: str) -> str:
    """'min' or 'max': which way the monitored metric improves (the EMA's `val_ema_<name>` as `val_<name>`)."""
    name = monitor[4:]
    name = name[4:] if name.startswith("ema_") and name not in getattr(task_class, "better", {}) else name
    return "min" if name == "loss" else getattr(task_class, "better", {})[name]
