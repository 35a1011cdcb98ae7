"""Real multi-process runs for tests, each bounded in time: gloo ranks of a test's own function (`run_ranks`), run.py
on ranks forked from a warm server with torchrun's worker contract (`launch`, `Job`), and run.py under the real
launchers as a user types them (`torchrun`, `legacy_launch`, `python_run`)."""

from __future__ import annotations

import atexit
import datetime
import io
import multiprocessing.connection
import os
import pickle
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_tricks.storage import files

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, pg_timeout, environ, cwd):
    os.environ.clear()  # the test's environment and folder now, not the fork server's when it started
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        # Plain pickle bytes: tensors by value, not as shared-memory handles that die with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks are forked from a fork server that imported torch once (per pytest worker), not started afresh: a fresh
# interpreter spends 3-5 s of CPU importing torch, its compiler stack (torch._dynamo, which the first optimizer
# imports) and matplotlib before a rank does anything. The server only imports (no CUDA, no process group, no tensor
# work), so every rank is still a new process with its own gloo group. `run` is run.py imported as a module: what it
# imports (the whole template) is then imported once; a rank still runs run.py itself, as __main__.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "matplotlib.backends.backend_agg",
           "matplotlib.figure", "sklearn.datasets", "run", "multiproc"]  # fmt: skip


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 120, reporting=None, pg_timeout: float = 60):
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; return the results of the ranks in
    `reporting` (default: all), by rank. Every wait is bounded: a hang fails the test."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    reporting = list(range(world_size)) if reporting is None else list(reporting)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout, dict(os.environ), os.getcwd())
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in reporting:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in reporting]


# ---------------------------------------------------------------- run.py on warm ranks, as torchrun starts them

RUN_PY = REPO / "run.py"
_ADDED_BY_TESTS = {str(REPO / d) for d in ("tests", "bench")}  # on the tests' sys.path, not on a user's
STOP_GRACE = 30  # seconds torchrun's agent waits after its SIGTERM to the workers before SIGKILL
PIDS = "TEST_JOB_PIDS"  # a warm rank's environment: the file of its job's process ids (rank_tasks.Preempting)


def torchrun_environment(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What `torchrun --standalone --nproc_per_node=N` puts in a worker's environment (torch's LocalElasticAgent):
    the agent hosts the store at MASTER_ADDR:MASTER_PORT and every rank is its client (TORCHELASTIC_USE_AGENT_STORE).
    test_end_to_end.py holds what a warm rank sees to what a real torchrun worker sees."""
    return {
        "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip


def _die_with_the_fork_server() -> None:
    """SIGKILL for this rank when its parent, the fork server, goes (the pytest worker died): no orphan trains on."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # TORCHELASTIC_SIGNALS_TO_HANDLE: the agent catches them


def _signals_as_torchrun_s_worker() -> None:
    """The signal dispositions a worker that torchrun's agent exec'd starts with: the signals the agent catches are
    back at their defaults after exec, and a fresh interpreter then sets SIGINT to KeyboardInterrupt. Without this
    a rank would keep what the test process had: under `nohup` or `make test &`, SIGINT and SIGHUP ignored."""
    for name in AGENT_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_script(script, args, environ, cwd, out, err):
    """One process of a job: `python -u SCRIPT ARGS` with this environment, folder and output files, in a session
    of its own (as torchrun starts a worker). As a fresh interpreter runs it (sys.path, argv, __main__, its exit
    code, or 1 with the traceback; threads joined, then atexit), except what a fork of a warm server cannot change:
    the modules the server imported are imported (a missing import of run.py's would go unseen here; the tests
    under the real launchers would see it), their import-time reads of the environment and warnings are the
    server's, and the hash seed is the server's."""
    _die_with_the_fork_server()
    _signals_as_torchrun_s_worker()
    multiprocessing.set_start_method(None, force=True)  # a fresh interpreter's (its DataLoader workers'), not ours
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = [str(Path(script).parent), *(p for p in sys.path if p not in _ADDED_BY_TESTS)]
    sys.argv = [str(script), *args]
    for fd, path in ((1, out), (2, err)):  # shared by the job's ranks, appended to, like a launcher's inherited pipe
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    for fd, name in ((1, "stdout"), (2, "stderr")):  # python -u, with the interpreter's own encoding and errors
        own = getattr(sys, f"__{name}__", None)  # None where the server started without it: the locale's
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                            encoding=own and own.encoding, errors=own and own.errors))  # fmt: skip
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does at its end: non-daemon threads first, then atexit
    atexit._run_exitfuncs()
    sys.exit(code)


class Job:
    """`torchrun --standalone --nproc_per_node=N run.py ARGS` (nproc=None: `python -u run.py ARGS`) for a test
    whose subject is run.py, not its launcher: each rank is a new process forked from the warm server (well under a
    second to start instead of 5-8 s of CPU), given torchrun's worker environment and the agent's store, the
    output of all ranks in one stdout and one stderr. Used as `with Job(...) as job:` (leaving it kills what still
    runs and releases the store). What torchrun's agent does, it does:
    - the first rank to fail has the others sent SIGTERM, SIGKILL 30 s later (`stop_others=False`: they are left
      to end by themselves, as the ranks of another node must: their agent does not know of a failure elsewhere);
    - send_signal() is a signal to the job: sent once to every rank, SIGKILL 30 s later to any still running.
    poll() carries these out, so it is to be called while waiting (wait() and communicate() do). `returncode`: 0,
    or the exit code of the first rank seen to fail (torchrun itself would exit 1 and print the ranks' codes);
    `exitcodes`: by rank. wait(timeout) kills the ranks when it runs out, then raises subprocess.TimeoutExpired."""

    def __init__(
        self,
        args: list[str],
        nproc: int | None = 2,
        cwd: Path | None = None,
        env: dict | None = None,
        stop_others: bool = True,
        script: Path = RUN_PY,
    ):
        self.args = [str(a) for a in args]
        self.script = Path(script)
        self.stop_others = stop_others
        self.returncode = None
        self._first_failure = None
        self._kill_at = None
        self._folder = tempfile.mkdtemp(prefix="job-")
        self._out, self._err = (os.path.join(self._folder, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            open(path, "w").close()
        environ = dict(os.environ if env is None else env)
        pids_file = os.path.join(self._folder, "pids")
        environ[PIDS] = pids_file
        self._store = None
        if nproc is None:
            environs = [environ]
        else:  # the agent's store, which every rank joins as a client (port 0: the system picks a free one)
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            run_id = str(uuid.uuid4())
            environs = [environ | torchrun_environment(r, nproc, self._store.port, run_id) for r in range(nproc)]
        ctx = _context()
        where = str(cwd or REPO)
        self.procs = [ctx.Process(target=_run_script, args=(self.script, self.args, e, where, self._out, self._err))
                      for e in environs]  # fmt: skip
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.close()
            raise
        self.pids = [p.pid for p in self.procs]
        files.write_text(pids_file, " ".join(map(str, self.pids)))  # whole when read: the ranks are still starting

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def poll(self) -> int | None:
        """None while a rank runs. Also does what the agent would now: after the first failure, SIGTERM to the
        others (unless they are to end by themselves); SIGKILL to any rank still running 30 s after a SIGTERM."""
        if self._first_failure is None:
            failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
            if failed:
                self._first_failure = failed[0]
                if self.stop_others and self._kill_at is None:
                    self._signal_ranks(signal.SIGTERM)
                    self._kill_at = time.monotonic() + STOP_GRACE
        if self._kill_at is not None and time.monotonic() > self._kill_at:
            self._signal_ranks(signal.SIGKILL)
            self._kill_at = None
        if any(p.exitcode is None for p in self.procs):
            return None
        self.returncode = self._first_failure or 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The job's code once every rank has ended; subprocess.TimeoutExpired (every rank killed) at `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired([str(self.script), *self.args], timeout, *self._read())
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) of every rank, once the job has ended (see wait)."""
        self.wait(timeout)
        return self._read()

    def send_signal(self, sig: int) -> None:
        """A signal to the job, as to torchrun: forwarded once to every rank; SIGKILL 30 s later to any still
        running."""
        self._signal_ranks(sig)
        if self._kill_at is None:
            self._kill_at = time.monotonic() + STOP_GRACE

    def kill(self) -> None:
        """SIGKILL to every rank still running; returns once they are gone."""
        self._signal_ranks(signal.SIGKILL)
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=10)

    def close(self) -> None:
        """Kill what still runs, and release the store and the output files."""
        if any(p.exitcode is None for p in self.procs if p.pid is not None):
            self.kill()
        self._store = None
        shutil.rmtree(self._folder, ignore_errors=True)

    def _signal_ranks(self, sig: int) -> None:
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _read(self) -> tuple[str, str]:
        return tuple(Path(path).read_text(errors="replace") for path in (self._out, self._err))


def launch(args: list[str], nproc: int | None = 2, timeout: float = 240, cwd: Path | None = None, env=None,
           stop_others: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """run.py ARGS on `nproc` warm ranks as torchrun starts them (nproc=None: one process, as `python -u run.py`),
    to its end (see Job); a CompletedProcess (returncode: 0, or the first failing rank's code) with `exitcodes`,
    each rank's."""
    with Job(args, nproc, cwd, env, stop_others) as job:
        out, err = job.communicate(timeout=timeout)
        result = subprocess.CompletedProcess([str(RUN_PY), *job.args], job.returncode, out, err)
        result.exitcodes = job.exitcodes
    return result


def torchrun_command(args: list[str], nproc: int = 2, extra=(), script: Path = RUN_PY) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra,
        str(script),
        *args,
    ]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, cwd: Path | None = None, extra=()):
    """`torchrun --standalone --nproc_per_node=N run.py ARGS`, as a user types it."""
    cmd = torchrun_command(args, nproc, extra)
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def preempted(args: list[str], checkpoint: Path, timeout: float = 120, nproc: int = 2, ready=None) -> tuple[str, str]:
    """run.py ARGS on `nproc` warm ranks (`Job`), SIGTERM to every rank, as torchrun forwards it, as soon as
    `checkpoint` exists (or `ready()` is true); the job's (stdout, stderr). Both waits are bounded."""
    ready = ready or checkpoint.exists
    deadline = time.monotonic() + timeout
    with Job(args, nproc) as job:
        while not ready() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.02)
        job.send_signal(signal.SIGTERM)
        return job.communicate(timeout=timeout)


def full_state(path: Path) -> dict:
    """A checkpoint's whole state as tools/export.py reads it (a sharded one's slices joined)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export", REPO / "tools" / "export.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    return export.full_state(path)


def python_run(args: list[str], timeout: float = 240, cwd: Path | None = None):
    """`python run.py ARGS` in one process."""
    cmd = [sys.executable, str(REPO / "run.py"), *args]
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def legacy_launch(args: list[str], cwd: Path | None = None, timeout: float = 240):
    """`python -m torch.distributed.launch --nproc_per_node=2 --master_port=PORT run.py ARGS` (passes --local-rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "run.py"), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
