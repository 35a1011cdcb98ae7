"""Where a thread is, read from its Python stack: the torch.distributed call it waits in (or the template's read of a
collective's result, marked with `waits_for`), whether it compiles, the first frame of the user's code; every
thread's stacks; and what a peer that aborted left in its stacks file (faulthandler's dump). The watchdog's
heartbeats (heartbeat.py) and the failure lines (failures.py) are read from these."""

from __future__ import annotations

import re
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

ABORTED = "Fatal Python error: Aborted"  # faulthandler's first line after SIGABRT


def main_frames(thread_id: int) -> list:
    """The main thread's frames, outermost first."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


_PACKAGE = Path(__file__).resolve().parent.parent
_TEMPLATE = {
    _PACKAGE.parent / name for name in ("run.py", "lars.py", "lamb.py", "lookahead.py", "customized_function.py")
}
_WATCH = {
    Path(__file__).resolve().parent / name for name in ("stacks.py", "heartbeat.py", "watchdog.py")
}  # never where a rank waits
_LIBRARY = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})


_HOST_READS: dict[tuple[str, str], str] = {}  # (file, function) -> the collective whose result it reads (waits_for)


def waits_for(op: str):
    """Marks a function of the template that runs collective `op` and reads its result on the host: a thread in it
    waits in `op`. On nccl a collective returns once queued and the host waits where it reads the result, outside any
    torch.distributed call; the template's reads (collectives.py) run their collectives so on gloo too."""

    def mark(function):
        _HOST_READS[function.__code__.co_filename, function.__code__.co_name] = op
        return function

    return mark


def collective(frames: list) -> str:
    """The torch.distributed call the thread waits in (all_reduce, barrier, ...), or whose result it reads on the
    host in the template (`waits_for`), else ''."""
    for frame in frames:
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py"):
            return code.co_name
        if (code.co_filename, code.co_name) in _HOST_READS:
            return _HOST_READS[code.co_filename, code.co_name]
    return ""


def compiling(frames: list) -> bool:
    """The thread compiles (torch.compile's Dynamo or Inductor on its stack): long work at any step, not a hang
    (the last, shorter batch of an epoch compiles again, as does the first evaluation)."""
    names = [frame.f_code.co_filename for frame in frames]
    return any(("/torch/_dynamo/" in name or "/torch/_inductor/" in name) for name in names)


def where(frames: list) -> str:
    """The innermost frame of the user's code (task.py, an example, a --task file), else the template's stage (the
    innermost frame of the package, under run.py's stage)."""
    user, stage, inner = None, None, None
    for frame in frames:  # outermost first: the user's code counts once the template has called it
        path = Path(frame.f_code.co_filename)
        if not path.is_absolute() or str(path.resolve()).startswith(_LIBRARY):
            continue
        path = path.resolve()
        if path in _WATCH:
            continue
        if path.is_relative_to(_PACKAGE):
            inner = frame
        elif path in _TEMPLATE:
            stage = frame
        elif stage is not None or inner is not None:
            user = frame
    frame = user or inner or stage
    if frame is None:
        return "?"
    text = f"{short(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}()"
    if user is None and stage is not None and frame is not stage:
        text = f"{short(stage.f_code.co_filename)} {stage.f_code.co_name}() > {text}"
    return text


def short(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(_PACKAGE.parent)) if path.is_relative_to(_PACKAGE.parent) else str(path)


def all_stacks(main_thread: int, heading: str) -> str:
    """Every thread's Python stack, the main thread first, under `heading`."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != main_thread)
    parts = [f"{heading}\n"]
    for ident in order:
        parts.append(f"\nThread {names.get(ident, ident)} ({ident}):\n")
        parts.extend(traceback.format_stack(frames[ident]))
    return "".join(parts)


_SOME_COLLECTIVE = "a collective"  # an aborted peer whose stacks name none (yet)


def aborted_peers(run_dir, rank: int, world_size: int, wait: float = 5.0) -> dict[int, str]:
    """The peers whose process aborted (their stacks files start with faulthandler's "Aborted"), each with the
    torch.distributed call its main thread was in and its first frame of user code; waits up to `wait` seconds for
    a file to be written (the peer that aborts writes it just before it ends), and for a file being written to
    name its collective (read half written, it names none yet: under load the reader can be that quick)."""
    if run_dir is None:
        return {}
    deadline = time.monotonic() + wait
    found: dict[int, str] = {}
    while time.monotonic() < deadline:
        for r in range(world_size):
            path = Path(run_dir) / f"stacks-rank{r}.txt"
            try:
                text = path.read_text() if r != rank else ""
            except OSError:
                continue
            if text.startswith(ABORTED):
                found[r] = _aborted_at(text)
        if found and all(not at.startswith(_SOME_COLLECTIVE) for at in found.values()):
            break
        time.sleep(0.1)
    return found


def _aborted_at(text: str) -> str:
    """From faulthandler's dump: the collective the main thread was in, and the frame that called it."""
    frames = re.findall(r'File "(.+)", line (\d+) in (\S+)', text)  # innermost first, thread by thread
    op, caller = "", ""
    for filename, line, function in frames:
        if filename.endswith("distributed_c10d.py") and not op:
            op = function
        elif (filename, function) in _HOST_READS and not op:
            op = _HOST_READS[filename, function]
        elif op and "/torch/" not in filename and not caller:
            caller = f"{short(filename)}:{line} {function}()"
    return (op or _SOME_COLLECTIVE) + (f" at {caller}" if caller else "")
