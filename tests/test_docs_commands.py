"""What the docs show still works (#42): every shell command in README.md and docs/*.md, in a ```bash block or in a
table's example cell, runs as written and exits 0, or, where the page marks it parse-only (a sweep, several nodes,
GPUs, data that is not here, minutes of work), its flags parse; every relative link and #anchor resolves.

A marker is an HTML comment (GitHub does not show it), on the line right before a block or a table, or inside a
table cell for that cell alone (docs/development.md#tested-docs):
    <!-- docs-test: parse-only (why) -->   the commands' flags are parsed, with the parsers the commands use
    <!-- docs-test: run -->                 run it (a cell of a parse-only table)
    <!-- docs-test: exits 2 -->             run it: it must exit 2 and print the lines of the ```text block after it
Unmarked commands run. `make` is only parsed (its target must exist; ARGS go through run.py's flags): it installs.
A command runs as a user types it from the repository root, `python` and `torchrun` being this interpreter's, in a
fresh folder that holds links to run.py, task.py, examples/, recipes/, tools/ and bench/, so that runs/ lands there.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddp_tricks import cli

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = ("run.py", "task.py", "examples", "recipes", "tools", "bench")  # what a command may name from the root
COMMAND_WORDS = ("python", "torchrun", "make")
SHELL_LANGUAGES = {"bash", "sh", "shell"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
RUN_TIMEOUT = 150  # seconds for one command; the longest here takes about 15 s on 2 busy cores


@dataclass
class Command:
    where: str  # page:line
    text: str  # as the page writes it (continuation lines joined)
    tokens: list[str]  # after the shell's quoting, loop variables and leading VAR=value taken out
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "run"  # run | parse
    exits: int = 0
    output: list[str] = field(default_factory=list)  # lines an `exits N` command must print


def read_marker(text: str, where: str, problems: list[str]) -> tuple[str, int] | None:
    if text == "run":
        return "run", 0
    if re.fullmatch(r"parse-only \(.+\)", text):
        return "parse", 0
    if match := re.fullmatch(r"exits (\d+)", text):
        return "run", int(match[1])
    problems.append(f"{where}: marker '{text}': write run, parse-only (why) or exits N")
    return None


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A block's lines with the backslash continuations joined, each with its first line's number."""
    joined, start, parts = [], None, []
    for number, line in lines:
        start = start if parts else number
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        joined.append((start, " ".join([*parts, line])))
        parts = []
    if parts:
        joined.append((start, " ".join(parts)))
    return joined


def commands_of(text: str, where: str, mode: str, exits: int, problems: list[str], loops: dict) -> list[Command]:
    """The commands of one shell line: `for X in A B; do` gives $X its first value, `done` and `export` and
    `VAR=$(...)` are the shell's, `srun ... torchrun ...` is the torchrun after it."""
    for name, values in re.findall(r"for\s+(\w+)\s+in\s+([^;]+);\s*do\b", text):
        loops[name] = values.split()[0]
    text = re.sub(r"for\s+\w+\s+in\s+[^;]+;\s*do\b", "", text)
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: loops.get(m[1], m[0]), text)
    if re.match(r"\s*\w+=\$\(", text):
        return []  # a shell variable set from a command's output
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as error:
        problems.append(f"{where}: {error}: {text}")
        return []
    if not tokens or tokens[0].rstrip(";") in ("done", "export"):
        return []
    env = {}
    while tokens and re.fullmatch(r"\w+=.*", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    if tokens and tokens[0] == "srun":
        tokens = tokens[next((i for i, t in enumerate(tokens) if t in COMMAND_WORDS), len(tokens)) :]
    if not tokens and env:
        return []  # a shell variable
    while tokens and tokens[-1] == "...":  # "and the rest of your flags"
        tokens.pop()
    if not tokens or tokens[0] not in COMMAND_WORDS:
        problems.append(f"{where}: not a command this test knows ({', '.join(COMMAND_WORDS)}): {text.strip()}")
        return []
    if tokens[0] == "make":
        mode = "parse"
    return [Command(where, " ".join(text.split()), tokens, env, mode, exits)]


def scan(page: Path) -> tuple[list[Command], list[str]]:
    """The shell commands of one page: ```bash blocks and table cells whose code starts with a command."""
    name = page.relative_to(REPO).as_posix()
    commands: list[Command] = []
    problems: list[str] = []
    pending = None  # a marker waiting for its block or table: ((mode, exits), line)
    fence = None  # (the fence's backticks, language, marker, lines)
    table_marker = None
    in_table = False
    expecting_output = None  # an `exits N` block's commands, waiting for their ```text block
    for number, line in enumerate(page.read_text().splitlines(), 1):
        where = f"{name}:{number}"
        if fence:
            ticks, language, marker, lines = fence
            if line.strip() == ticks:
                fence = None
                if language in SHELL_LANGUAGES:
                    mode, exits = marker or ("run", 0)
                    loops: dict[str, str] = {}
                    found = []
                    for start, text in logical_lines(lines):
                        found += commands_of(text, f"{name}:{start}", mode, exits, problems, loops)
                    commands += found
                    expecting_output = found if exits else None
                elif expecting_output and language == "text":
                    for command in expecting_output:
                        command.output = [text.strip() for _, text in lines if text.strip()]
                    expecting_output = None
            else:
                lines.append((number, line))
            continue
        stripped = line.strip()
        if match := FENCE.match(line):
            marker = pending[0] if pending else None
            pending = None
            fence = (match[1], match[2].lower(), marker, [])
            if expecting_output and match[2].lower() != "text":
                problems.append(f"{where}: an `exits N` block needs the ```text block of what it prints right after")
                expecting_output = None
            continue
        if (match := MARKER.fullmatch(stripped)) is not None:
            if pending:
                problems.append(f"{name}:{pending[1]}: a marker followed by another marker")
            marker = read_marker(match[1], where, problems)
            pending = (marker, number) if marker else None
            continue
        if stripped.startswith("|"):
            if not in_table:
                table_marker = pending[0] if pending else None
                pending = None
                in_table = True
            for cell in re.split(r"(?<!\\)\|", stripped):
                for code in re.findall(r"`([^`]+)`", cell):
                    code = code.replace("\\|", "|")
                    if code.split(" ", 1)[0] not in COMMAND_WORDS:
                        continue
                    marker = table_marker or ("run", 0)
                    if cell_marker := MARKER.search(cell):
                        marker = read_marker(cell_marker[1], where, problems) or marker
                    commands += commands_of(code, where, *marker, problems, {})
            continue
        in_table = False
        if stripped and pending:
            problems.append(f"{name}:{pending[1]}: a marker not on the line right before a block or a table")
            pending = None
        if stripped and expecting_output:
            problems.append(f"{where}: an `exits N` block needs the ```text block of what it prints right after")
            expecting_output = None
    return commands, problems


def collect() -> tuple[list[Command], list[str]]:
    """Every page's commands, each command once (the first place that shows it, the others named)."""
    seen: dict[tuple, Command] = {}
    problems: list[str] = []
    for page in PAGES:
        found, trouble = scan(page)
        problems += trouble
        for command in found:
            key = (command.text, command.mode, command.exits)
            if key in seen:
                seen[key].where += f", {command.where}"
            else:
                seen[key] = command
    return list(seen.values()), problems


COMMANDS, PROBLEMS = collect()
RUN = [c for c in COMMANDS if c.mode == "run"]
PARSE = [c for c in COMMANDS if c.mode == "parse"]


def test_every_block_table_and_marker_is_understood():
    assert PROBLEMS == []
    assert len(RUN) >= 4 and len(PARSE) >= 20  # the scan finds the pages' commands at all


def test_the_readme_is_a_front_page():
    size = len((REPO / "README.md").read_bytes())
    assert size <= 16 * 1024, f"README.md is {size} bytes: move detail into docs/ and link it"


# ---- running ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def root_like(folder: Path) -> Path:
    """A folder where a command typed at the repository root finds what it names, and writes only there."""
    folder.mkdir(exist_ok=True)
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    return folder


def interpreter(tokens: list[str]) -> list[str]:
    """`python` and `torchrun` as a user's PATH finds them: this interpreter, and torchrun's module under it."""
    if tokens[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *tokens[1:]]
    return [sys.executable, *tokens[1:]]


def writes_runs_here(tokens: list[str]) -> bool:
    return "run.py" in tokens and not any(t in ("-p", "--runs-dir", "--model_path", "--plot-lr") for t in tokens)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("command", RUN, ids=[c.where for c in RUN])
def test_the_command_runs_as_written(command, tmp_path):
    folder = root_like(tmp_path / "root")
    # torchrun without --standalone meets on port 29500 by default: a free one here (torchrun reads PET_MASTER_PORT)
    env = {**os.environ, **command.env, "PET_MASTER_PORT": str(free_port())}
    result = subprocess.run(
        interpreter(command.tokens), cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    said = result.stdout + result.stderr
    assert result.returncode == command.exits, (
        f"{command.where}: `{command.text}` exited {result.returncode}, not {command.exits}:\n{said[-3000:]}"
    )
    for line in command.output:
        assert line in said, f"{command.where}: `{command.text}` did not print {line!r}:\n{said[-3000:]}"
    if command.exits == 0 and writes_runs_here(command.tokens):
        assert list(folder.glob("runs/*/metrics.csv")), f"{command.where}: no run folder under runs/:\n{said[-2000:]}"


# ---- parsing ----


class Parsed(Exception):
    """A tool's own flags parsed: stop it there."""


def parse_run_py(args: list[str]) -> None:
    try:
        cli.parse(args)
    except cli.UserError as error:
        pytest.fail(f"run.py {' '.join(args)}: {error}")


def parse_launcher(parser: argparse.ArgumentParser, args: list[str]) -> None:
    launch = parser.parse_args(args)  # torch's own parser for torchrun and the legacy launcher
    parse_script(launch.training_script, launch.training_script_args)


def parse_tool(path: Path, args: list[str], monkeypatch) -> None:
    """tools/*.py and bench/*.py: the script's own argparse takes the flags (sweep.py: every cell's run.py flags
    too, as it checks them before its first cell); the run.py flags after `--` parse."""
    assert path.is_file(), f"no script {path}"
    monkeypatch.syspath_prepend(str(path.resolve().parent))  # as `python SCRIPT` puts the script's folder first
    spec = importlib.util.spec_from_file_location(f"docs_test_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise Parsed(original(parser, args, namespace))

    def stop(*_args, **_kwargs):
        raise Parsed()

    with monkeypatch.context() as patch:
        if path.name == "sweep.py":
            patch.setattr(module, "run_cell", stop)
        else:
            patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [str(path), *args])
        try:
            code = module.main(args) if inspect.signature(module.main).parameters else module.main()
        except Parsed:
            code = None
    assert code is None, f"{path} {' '.join(args)} stopped with {code} before running anything"
    if "--" in args and path.name != "sweep.py":
        parse_run_py(args[args.index("--") + 1 :])


def parse_script(script: str, args: list[str], monkeypatch=None) -> None:
    path = Path(script)
    if path.as_posix() == "run.py":
        parse_run_py(args)
    elif path.parts[0] in ("tools", "bench") and monkeypatch is not None:
        parse_tool(path, args, monkeypatch)
    else:
        pytest.fail(f"{script}: neither run.py nor a script in tools/ or bench/")


def parse_make(args: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for arg in args:
        name, equals, value = arg.partition("=")
        if not equals:
            assert name in targets, f"make {name}: no such target in the Makefile"
        elif name == "ARGS":
            parse_run_py(shlex.split(value))


@pytest.mark.parametrize("command", PARSE, ids=[c.where for c in PARSE])
def test_the_command_parses(command, tmp_path, monkeypatch, capsys):
    import torch.distributed.launch
    import torch.distributed.run

    monkeypatch.chdir(root_like(tmp_path / "root"))
    word, *args = command.tokens
    try:
        if word == "make":
            parse_make(args)
        elif word == "torchrun":
            parse_launcher(torch.distributed.run.get_args_parser(), args)
        elif args[:2] == ["-m", "torch.distributed.run"]:
            parse_launcher(torch.distributed.run.get_args_parser(), args[2:])
        elif args[:2] == ["-m", "torch.distributed.launch"]:
            parser = torch.distributed.run.get_args_parser()
            parser.add_argument("--use-env", "--use_env", action="store_true")  # as torch.distributed.launch adds
            parse_launcher(parser, args[2:])
        else:
            parse_script(args[0], args[1:], monkeypatch)
    except SystemExit as error:  # argparse refused a flag
        pytest.fail(f"{command.where}: `{command.text}`: {capsys.readouterr().err.strip()} (exit {error.code})")


# ---- links ----


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but hyphens dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_blocks(page: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    lines, inside = [], None
    for line in page.read_text().splitlines():
        if match := FENCE.match(line):
            if inside is None:
                inside = match[1]
                continue
            if line.strip() == inside:
                inside = None
                continue
        if inside is None:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    found, counts = set(), {}
    for line in outside_blocks(page):
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*$", line):
            base = slug(match[1])
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        for line in outside_blocks(page):
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):  # not in inline code
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                file = (page.parent / path_part).resolve() if path_part else page
                if not file.exists():
                    broken.append(f"{name}: {target}: no file {path_part}")
                elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                    broken.append(f"{name}: {target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == []


def test_slugs_follow_github():
    assert slug("The batch that follows the noise scale: `--batch-trace auto`") == (
        "the-batch-that-follows-the-noise-scale---batch-trace-auto"
    )
    assert slug("Sharded training: `--strategy fsdp`") == "sharded-training---strategy-fsdp"
    assert slug("Which batch size? The gradient noise scale") == "which-batch-size-the-gradient-noise-scale"


def test_performance_md_says_which_benches_make_bench_runs():
    """docs/performance.md's opening names the scripts `make bench` runs (the Makefile's bench target's, no more, no
    fewer) and those run on their own, every script of bench/ between them (bench/peer_loops.py is peers.py's).
    Broken on purpose: bench/peers.py added to the Makefile's bench target fails it (the page says it is not)."""
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    ran = set(re.findall(r"bench/(\w+)\.py", target))
    opening = (REPO / "docs" / "performance.md").read_text().split("\n## ", 1)[0]
    in_make, alone = opening.split("`make bench` runs", 1)[1].split(";", 1)
    assert set(re.findall(r"bench/(\w+)\.py", in_make)) == ran
    every = {p.stem for p in (REPO / "bench").glob("*.py")} - {"peer_loops"}
    assert ran | (set(re.findall(r"bench/(\w+)\.py", alone)) - {"NAME"}) == every
