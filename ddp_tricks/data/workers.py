"""DataLoader workers never act on SIGTERM or SIGINT: the main process of each rank owns them (preemption agrees on
a stop, Ctrl-C interrupts it), and a worker that dies is named as such.

SLURM (preemption, the time limit), `timeout`, Ctrl-C in a terminal and torchrun's own agent (`os.killpg` of each
worker's session) signal a whole process group, so a rank's DataLoader workers get the signal too. torch's worker
handler ends a worker on a SIGTERM that its parent did not send, and the rank then failed with "DataLoader worker
(pid ...) is killed by signal: Terminated" before it could agree on a stop (found with `--workers 2`). Here:

- `Loader` starts its workers with SIGTERM and SIGINT blocked in the starting thread, so every worker begins life
  with them blocked: a signal that comes between the fork and the worker's first line stays pending instead of
  acting (the parent's Python handlers, which a forked worker inherits, or torch's handler, set before any
  worker_init_fn runs). A spawned or forkserver worker inherits the mask across exec as well. Setting SIG_IGN
  in `worker_init_fn` alone would leave that window open.
- `worker_init` keeps them blocked in the worker and starts one thread that takes them with `sigwaitinfo`, which
  says who sent each: a SIGTERM from the process that started the worker (the rank; or its parent process, a
  forkserver's worker's) is the DataLoader shutting a worker down (torch's `terminate()`, and multiprocessing's at
  the interpreter's end), and ends the worker quietly as torch's own handler does; any other SIGTERM, and every
  SIGINT, is dropped. Plain SIG_IGN would drop the rank's too: a worker still busy when its rank exits would then
  never end, and the rank's exit would wait for it forever.
- A worker hands each batch's tensors to its rank by file descriptor, through multiprocessing's resource sharer (a
  thread of the worker that the rank connects to). A rank that learns of a dead worker mid-fetch (torch's SIGCHLD
  handler raises in the rank's main thread, wherever it is) drops a live worker's connection mid-handshake, and that
  thread printed a ConnectionResetError traceback under the rank's one-line error (seen once in 1133 CI tests).
  `worker_init` leaves such a lost fetch unsaid; any other error of any thread keeps its traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
import weakref

from torch.utils.data import DataLoader

from customized_function import seed_worker

SIGNALS = {signal.SIGTERM, signal.SIGINT}
_ITERATORS: weakref.WeakSet = weakref.WeakSet()  # the Loaders' iterators that started workers
_CAN_BLOCK = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo")  # POSIX; not Windows

# torch's words for a worker that died: killed by a signal (the OOM killer's SIGKILL, a segfault in a C transform),
# or gone without one
_DIED = re.compile(
    r"DataLoader worker \(pid\(?s?\)? ?([\d, ]+)\) "
    r"(is killed by signal: ([^.\n]*)|exited unexpectedly( with exit code -?\d+)?)"
)


class Loader(DataLoader):
    """A DataLoader whose workers never act on SIGTERM or SIGINT (this module's docstring); otherwise torch's."""

    def __iter__(self):
        if self.num_workers == 0 or not _CAN_BLOCK:
            return super().__iter__()
        # Workers start in here (once for persistent workers, at every iteration otherwise) and inherit this
        # thread's mask. Blocking in the main thread delays nothing: the process's other threads take a signal, and
        # the interpreter runs its Python handler in the main thread as before.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            batches = super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _ITERATORS.add(batches)  # its worker processes: how one that "exited unexpectedly" ended (died)
        return batches


def worker_init(worker_id: int) -> None:
    """The loaders' worker_init_fn: SIGTERM and SIGINT left to the rank's main process (first, before any work),
    then the worker seeded (`customized_function.seed_worker`)."""
    if _CAN_BLOCK:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # already, when a Loader started it
        owner = multiprocessing.parent_process()  # the rank, whichever start method (fork, spawn, forkserver)
        owners = {os.getppid()} | ({owner.pid} if owner is not None else set())
        threading.Thread(target=_take_signals, args=(owners,), name="ddp_tricks-worker-signals", daemon=True).start()
    sys.excepthook = _fetches_lost_unsaid(sys.excepthook)
    seed_worker(worker_id)


def _fetches_lost_unsaid(hook):
    """sys.excepthook, less the resource sharer's report of a rank that left mid-fetch (this module's docstring): the
    sharer's thread calls sys.excepthook itself, so threading.excepthook never sees it."""

    def excepthook(kind, error, trace):
        sharer = trace is not None and trace.tb_frame.f_globals.get("__name__") == "multiprocessing.resource_sharer"
        if not (sharer and issubclass(kind, (ConnectionError, EOFError))):
            hook(kind, error, trace)

    return excepthook


def _take_signals(owners: set[int]) -> None:
    while True:
        info = signal.sigwaitinfo(SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid in owners:
            os._exit(0)  # the DataLoader ends its worker: what torch's own handler does for the parent's SIGTERM


def _ended() -> list[tuple[int, int]]:
    """(pid, exit code) of this rank's loaders' worker processes that have ended (a signal's: a negative code)."""
    processes = [process for batches in list(_ITERATORS) for process in getattr(batches, "_workers", ())]
    return [(process.pid, process.exitcode) for process in processes if process.exitcode is not None]  # polls


def _killed_by(pids: set[int]) -> str | None:
    """The signal that ended one of these worker processes, as torch names it ("Killed"), if a signal did."""
    return next((signal.strsignal(-code) for pid, code in _ended() if pid in pids and code < 0), None)


def died(error: BaseException, wait: float = 2.0) -> str | None:
    """What a DataLoader error says of a worker that died (its process id, and the signal that killed it), in a
    sentence; None for any other error (an exception raised in a worker, a transform's bug, keeps its traceback).
    A connection lost while fetching a batch from a worker (the worker died mid-handshake: ConnectionResetError,
    EOFError) is such an error where a worker of this rank is found ended within `wait` seconds."""
    found = _DIED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return _lost_in_a_fetch(error, wait) if isinstance(error, (ConnectionError, EOFError)) else None
    pids, signal_name = found[1].strip().rstrip(","), found[3]
    if not signal_name:  # torch found it gone before its SIGCHLD handler said how: the process knows
        signal_name = _killed_by({int(pid) for pid in pids.split(",")})
    return _sentence(pids, signal_name, found[4] or "")


def _sentence(pids: str, signal_name: str | None, exit_code: str) -> str:
    how = f"was killed by signal {signal_name.strip()}" if signal_name else f"exited unexpectedly{exit_code}"
    why = " (SIGKILL: the out-of-memory killer, most often)" if signal_name and "Killed" in signal_name else ""
    return f"a DataLoader worker of this rank (pid {pids}) {how}{why}"


def _lost_in_a_fetch(error: BaseException, wait: float) -> str | None:
    """The sentence for a worker that ended, where `error` came from receiving a batch (torch's rebuild of a
    tensor shared by file descriptor, in multiprocessing's connection to the worker); None otherwise."""
    files = [frame.f_code.co_filename.replace(os.sep, "/") for frame, _ in traceback.walk_tb(error.__traceback__)]
    if not any("torch/multiprocessing/reductions.py" in f or "torch/utils/data/" in f for f in files):
        return None
    deadline = time.monotonic() + wait
    while True:
        for pid, code in _ended():
            if code != 0:
                name = signal.strsignal(-code) if code < 0 else None
                return _sentence(str(pid), name, f" with exit code {code}" if code > 0 else "")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def stop_watching_children() -> None:
    """torch's SIGCHLD handler raises a worker's death in the main thread wherever it is, and a failure being
    reported (a lost fetch's connection error, say) is then cut by a second error's traceback (seen: the CI's
    SIGKILL test once in a few runs): the rank is ending, its reporting is not interrupted."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
