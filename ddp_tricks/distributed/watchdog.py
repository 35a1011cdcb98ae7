"""A failing rank ends the job within seconds, and a SIGTERM ends a rank stuck in a collective.

Without this, a rank that fails while its peers wait in a collective for it (an all-reduce it will never join)
leaves them waiting for the whole --dist-timeout, and a SIGTERM cannot reach them: Python runs a signal handler
only between bytecodes, and a main thread inside a gloo or NCCL wait runs none. So:

- A rank that fails says so in the job's store (the TCPStore every rank shares, under this launch attempt's
  prefix: torchrun keeps one store across restarts), before it prints its error, and then leaves at once without
  tearing the process group down (a teardown waits for the collectives still in flight). `fail()` answers whether
  it was the job's first failure: only that one's error is shown.
- A daemon thread on every rank (`start`) reads that store once a second. When a peer has failed and this
  process is not already ending by itself within a short grace, it ends the process (`os._exit`) with the
  failing rank's exit code, quietly. Gloo and NCCL waits release the GIL, so the thread runs while the main
  thread is stuck.
- The same thread is woken by SIGTERM (or SIGINT) through `signal.set_wakeup_fd`, which the interpreter writes
  from its C-level handler even while the main thread is stuck. If the main thread then makes no progress for
  `grace` seconds (--sigterm-grace, 25 by default: launchers SIGKILL 30 s after their SIGTERM) (the same frame at
  the same instruction: one C call that does not return, a collective; also a long C call that is busy, such as a
  big torch.save, which is why the grace is long),
  the process ends with 143 (130 for SIGINT). A SIGTERM between steps finds the main thread moving: preemption
  then agrees on a step and writes the checkpoint exactly as before.

- Before the process group, and from a failure on, SIGTERM is held (`hold_sigterm`): it ends the process a few
  seconds later, not at once, so a rank that is to say why the job fails is not killed first by the SIGTERM that a
  launcher sends every worker once another has ended.

- The same thread beats this rank's heartbeat (heartbeat.py) once a second: a rank that goes silent, or a job whose
  ranks all stop making progress, ends the job with HUNG (4) and one line per rank saying where it waits.

Costs nothing per step: no host sync, no collective; the thread wakes twice a second (a store lookup and a heartbeat
every other time) and reads the main thread's frame only after a signal.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from ddp_tricks.distributed import heartbeat
from ddp_tricks.errors import report

POLL = 0.5  # seconds between the thread's looks at the signal socket
STORE_EVERY = 2  # looks per store lookup: the store is asked once a second
PEER_GRACE = 2.0  # seconds a rank that sees a peer's failure leaves its main thread to end by itself
SIGNAL_GRACE = 25.0  # seconds without progress after SIGTERM before a stuck process is ended (--sigterm-grace)
COUNT, CODE = "failures", "first_failure_code"  # keys in the job's store, under the attempt's prefix
HOLD = 5.0  # seconds a held SIGTERM leaves a rank to finish saying why it fails (hold_sigterm)

_ending = False  # this process is leaving on its own (its main thread is in its failure path)
_watch: _Watch | None = None
_NOTHING_SAVED = object()
_saved_sigterm = _NOTHING_SAVED  # SIGTERM's handler before hold_sigterm(), for restore_signals()
_held = False  # a SIGTERM came while held: the process ends HOLD seconds later at the latest


class _Watch:
    def __init__(self, store, rank: int, grace: float = SIGNAL_GRACE, world_size: int = 1):
        self.store = store
        self.grace = grace
        self.rank = rank
        self.stopped = threading.Event()
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self.previous_fd = None
        try:
            self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signal watch, the store watch still runs
            pass
        self.main = threading.main_thread().ident
        self.heart = None if store is None else heartbeat.Heart(store, rank, world_size, self.main)
        self.thread = threading.Thread(target=self._run, name="ddp_tricks-watchdog", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * POLL + 1)
        if self.heart is not None and not _ending:
            self.heart.done()
        if self.previous_fd is not None:
            signal.set_wakeup_fd(self.previous_fd)
        self.reader.close()
        self.writer.close()

    def _run(self) -> None:
        looks, signalled, position, seen_failure = 0, None, None, None
        while not self.stopped.is_set():
            signals = self._signals()
            if self.stopped.is_set():
                return
            now = time.monotonic()
            if {signal.SIGTERM, signal.SIGINT} & signals and not _ending:
                signalled, position = (now, signals), _position(self.main)
            elif signalled is not None:
                if _position(self.main) != position:
                    signalled = None  # the main thread moves: its own handler and the loop take it from here
                elif now - signalled[0] >= self.grace and not _ending:
                    _exit(130 if signal.SIGINT in signalled[1] else 143)
            looks += 1
            if self.store is not None and looks % STORE_EVERY == 0:
                try:
                    failed = self.store.check([CODE])
                except Exception:  # the store is gone (the job is ending): nothing more to learn from it
                    self.store = None
                    continue
                if failed and seen_failure is None:
                    seen_failure = now
                if self.heart is not None and seen_failure is None and not _ending:
                    self._beat(now)
                if seen_failure is not None and now - seen_failure >= PEER_GRACE and not _ending:
                    try:
                        code = int(self.store.get(CODE))
                    except Exception:
                        code = 1
                    _exit(code)

    def _beat(self, now: float) -> None:
        """The heartbeat; when the job hangs (this rank's verdict), say why, rank by rank, and end the job."""
        try:
            verdict = self.heart.beat(now)
        except Exception:  # the store is gone (the job is ending)
            self.heart = None
            return
        if verdict is None or _ending:
            return
        run_dir = heartbeat.settings()["run_dir"]
        log = None if run_dir is None else run_dir / "train.log"
        cause, *lines = verdict.splitlines()
        report(f"the job hangs: {cause}", log)
        for line in lines:
            report(line, log)
        fail(heartbeat.HUNG)
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            time.sleep(STORE_EVERY * POLL + PEER_GRACE)  # this rank hosts the store: the others must read it first
        _flush()
        _exit(heartbeat.HUNG)

    def _signals(self) -> set[int]:
        """The signals that arrived since the last look (waits up to POLL seconds for one)."""
        ready, _, _ = select.select([self.reader], [], [], POLL)
        if not ready:
            return set()
        try:
            return set(self.reader.recv(512))
        except (BlockingIOError, OSError):
            return set()


def hold_sigterm() -> None:
    """From now until `joining()` or `restore_signals()`: a SIGTERM ends this process HOLD seconds later (143), not
    at once. A launcher sends SIGTERM to every worker as soon as one has ended. Before the process group every rank
    makes the same checks, and a mistake fails them all alike, rank 0 saying it; with a group, the first to fail says
    it while the others leave. Either way a peer can end first, and the SIGTERM it brings must not kill the rank that
    is still to say why (under load, still checking). Call from the main thread (elsewhere it does nothing)."""
    global _saved_sigterm
    try:
        previous = signal.signal(signal.SIGTERM, _hold)
    except ValueError:  # not the main thread: it cannot set a handler
        return
    if _saved_sigterm is _NOTHING_SAVED:
        _saved_sigterm = previous


def ignore_sigterm() -> None:
    """SIGTERM ignored: for a process whose teardown is done and whose interpreter ends next (Python's end sets the
    handlers it installed back to the default action; an ignored signal stays ignored)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


def _hold(signum, frame) -> None:
    global _held
    if not _held:
        _held = True
        timer = threading.Timer(HOLD, _exit, (143,))
        timer.daemon = True
        timer.start()


def linger(seconds: float = HOLD) -> None:
    """A rank other than 0 that fails a check every rank makes, before the process group: rank 0 is the one to say
    it, and may find it later (a loaded machine). Wait up to `seconds` before ending, or until a SIGTERM comes (held:
    the launcher stops this rank because another has ended, rank 0 having said it), so that this rank's own end does
    not bring the launcher's SIGTERM to rank 0 before it has."""
    deadline = time.monotonic() + seconds
    while not _held and time.monotonic() < deadline:
        time.sleep(0.02)


def joining() -> None:
    """Before joining the process group: a SIGTERM held until now ends this process here (143: its job is being
    stopped, and the others are leaving); else SIGTERM gets its own handler back."""
    if _held:
        _flush()
        _exit(143)
    restore_signals()


def restore_signals() -> None:
    """SIGTERM's handler as it was before `hold_sigterm()` (at the end of main(), which a test may call in its own
    process); safe to call when nothing is held."""
    global _saved_sigterm, _held
    if _saved_sigterm is not _NOTHING_SAVED:
        try:
            signal.signal(signal.SIGTERM, _saved_sigterm)
        except ValueError:
            return
    _saved_sigterm, _held = _NOTHING_SAVED, False


def _position(thread_id: int | None):
    """Where a thread is: its innermost frame and instruction (unchanged while it is inside one C call)."""
    frame = sys._current_frames().get(thread_id)
    return None if frame is None else (id(frame), frame.f_lasti)


def _exit(code: int) -> None:
    heartbeat.disarm()  # this rank's stacks file goes if empty (one written on a hang, or on abort, stays)
    os._exit(code)  # no teardown, no atexit: a teardown would wait for the collectives in flight


def start(store, rank: int, grace: float = SIGNAL_GRACE, world_size: int = 1) -> None:
    """Watch this rank: the job's store (`store`, this attempt's prefix) for a peer's failure, and SIGTERM for a
    stuck main thread; beat its heartbeat there. Call from the main thread once the process group exists."""
    global _watch, _ending
    stop()
    _ending = False
    _watch = _Watch(store, rank, grace, world_size)


def stop() -> None:
    """Stop watching (a normal end); safe to call with no watch."""
    global _watch
    if _watch is not None:
        _watch.close()
        _watch = None


def active() -> bool:
    """A watch runs: a failure of this process must leave with `leave()`, not by tearing the group down."""
    return _watch is not None


def fail(code: int) -> bool:
    """This process fails with exit code `code`: tell every rank (they then end within seconds). True when it is
    the job's first failure (or runs unwatched): then its error is the one to show. SIGTERM is held from here
    (`hold_sigterm`): a peer that leaves first has the launcher send this process SIGTERM while it says why."""
    global _ending
    _ending = True
    hold_sigterm()
    watch = _watch
    if watch is None or watch.store is None:
        return True
    try:
        first = watch.store.add(COUNT, 1) == 1
        if first:
            watch.store.set(CODE, str(code))
        return first
    except Exception:  # no store to tell: say it here
        return True


# what a collective says when a peer process is gone (killed, its node lost): gloo's socket errors, NCCL's abort
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def lost_peer(error: BaseException) -> str | None:
    """The first line of a collective's error that says another process of the job is gone, else None."""
    if isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE):
        return str(error).strip().splitlines()[0][:120]
    return None


# what NCCL's own abort says (ProcessGroupNCCL's watchdog, on a collective past --dist-timeout, an NCCL error or a CUDA
# error it found; on the ranks it did not end, the communicator it aborted), and the cause each names, first match
NCCL_ABORTS = (
    ("Watchdog caught collective operation timeout", "NCCL's watchdog: a collective ran past --dist-timeout"),
    ("Process group watchdog thread terminated with exception: CUDA error", "NCCL's watchdog found a CUDA error"),
    ("NCCL communicator was aborted", "NCCL's watchdog aborted the communicator after a failure on a rank"),
    ("Some NCCL operations have failed or timed out", "NCCL's watchdog: a collective failed or timed out"),
    ("Process group watchdog thread terminated", "NCCL's watchdog ended"),
    ("NCCL error", "an NCCL error"),
)


def nccl_abort(error: BaseException) -> str | None:
    """The cause and first line of an error that NCCL's own abort raised (its watchdog: a collective past
    --dist-timeout, an NCCL or a CUDA error it found, a communicator it aborted), else None."""
    text = str(error).strip()
    if not isinstance(error, RuntimeError):  # DistBackendError is one
        return None
    for words, cause in NCCL_ABORTS:
        if words in text:
            return f"{cause} ({text.splitlines()[0][:160]})"
    return None


def leave(code: int, said: bool = True) -> int:
    """After `fail()`: end this process now with the job's exit code (the first failure's), without a teardown.
    Unwatched (one process, no group), the code is returned for the caller to exit with; before the group, a
    rank that leaves the saying to rank 0 (`said` False) lingers first (`linger`)."""
    watch = _watch
    if watch is None:
        if not said:
            linger()
        return code
    if watch.store is not None:
        try:
            watch.store.wait([CODE], timedelta(seconds=5))
            code = int(watch.store.get(CODE))
        except Exception:
            pass
    if watch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        time.sleep(STORE_EVERY * POLL + PEER_GRACE)  # rank 0 then hosts the store: the others must read it first
    _flush()
    _exit(code)
    return code


def _flush() -> None:
    """What this process printed goes out before an `_exit` (which skips the interpreter's own flush)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said there
            pass
