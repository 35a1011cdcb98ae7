"""`--config FILE.toml`: a file of flags read as if typed before the command line. Each key is checked against
the parser (an unknown key gets a suggestion, a value of the wrong type one line), and an error about a flag the
file set names the file and the key (`blame`).
"""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

from ddp_tricks.cli.checks import flag_name
from ddp_tricks.cli.flags import NUMBERS
from ddp_tricks.errors import UserError

# The config file of the last parse and which of its keys set each option the command line did not override:
# a later error that names such an option (say, from the task's datasets()) names the file and the key too.
_from_file: tuple[str, dict[str, str]] | None = None


def remember(path: str | None, keys: dict[str, str]) -> None:
    """Record which option each key of the file at `path` set (None: no file)."""
    global _from_file
    _from_file = (path, keys) if path else None


def blame(error: UserError) -> UserError:
    """The error, naming the config file and its key when the first flag it mentions came from the file."""
    if _from_file is None or str(error).startswith("--config "):
        return error
    path, keys = _from_file
    for option in re.findall(r"--[A-Za-z][\w-]*", str(error)):
        if option in keys:
            return UserError(f"--config {path}, key {keys[option]!r}: {error}", error.rank_specific)
    return error


# Flags that set one thing in two ways: the run's length in epochs or in optimizer steps. A recipe sets `epochs`; the
# other one typed on the command line replaces it, as a typed flag overrides the file's.
ALTERNATIVES = (("epochs", "max_steps"),)


def replaced_by_typed(
    cfg: argparse.Namespace, parser: argparse.ArgumentParser, file_keys: dict[str, str], typed: set[str]
) -> set[str]:
    """The destinations the file set whose alternative the command line types (`ALTERNATIVES`): each is set back to
    its default in `cfg`, as if the file had not set it, and returned, so that no check counts it as given."""
    replaced = set()
    for alternatives in ALTERNATIVES:
        if typed.isdisjoint(alternatives):
            continue
        for dest in alternatives:
            if dest in file_keys and dest not in typed:
                setattr(cfg, dest, parser.get_default(dest))
                replaced.add(dest)
    return replaced


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
            raise UserError(f"{where}: a config file holds settings, not {flag_name(parser, action.dest)}: remove it")
        if action is None:
            names = [o[2:] for o, a in options.items() if o.startswith("--") and "_" not in o and a.dest != "help"]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "keys are the long flags of `python run.py --help`"
            raise UserError(f"--config {path}: unknown key {key!r} (no flag --{key}); {hint}")
        flag = flag_name(parser, action.dest)
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
    if isinstance(value, str) and action.type in NUMBERS:
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
