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
import time
import traceback
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
_NOT_ON_A_USERS_PATH = {str(REPO / d) for d in ("tests", "bench", "tools", "examples")}  # what pytest put there
STOP_GRACE = 30  # seconds torchrun's agent waits after its SIGTERM to the workers before SIGKILL


def torchrun_environment(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What `torchrun --standalone --nproc_per_node=N` puts in a worker's environment (torch's LocalElasticAgent):
    the agent hosts the store at MASTER_ADDR:MASTER_PORT and every rank is its client (TORCHELASTIC_USE_AGENT_STORE).
    test_launchers.py compares it with what the real torchrun gives."""
    return {
        "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip


def _run_py(args, environ, cwd, out, err):
    """One process of the job: `python -u run.py ARGS` with this environment, folder and output files, as a fresh
    interpreter runs it (sys.path, argv, __main__), except that its imports are already done. Exits with run.py's
    code, or 1 with the traceback, as python does."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = [str(REPO), *(p for p in sys.path if p not in _NOT_ON_A_USERS_PATH and p != str(REPO))]
    sys.argv = [str(RUN_PY), *args]
    for fd, path in ((1, out), (2, err)):  # shared by the job's ranks, appended to, like a launcher's inherited pipe
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # python -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    code = 0
    try:
        runpy.run_path(str(RUN_PY), run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter runs at its exit
    sys.exit(code)


class Job:
    """`torchrun --standalone --nproc_per_node=N run.py ARGS` (or, with nproc=None, `python run.py ARGS`) for a test
    whose subject is run.py, not the launcher: each rank is a new process forked from the warm server (about 1 s to
    start instead of 5-8 s), given torchrun's worker environment and the agent's store, with the output of all ranks
    in one stdout and one stderr. As torchrun's agent does, the first rank to fail has the others sent SIGTERM
    (SIGKILL 30 s later), and a signal to the job goes to every rank. `stop_others=False` leaves the others to end
    by themselves, as a rank on another node must (its own agent does not know of a failure elsewhere). Popen's
    interface: poll, wait, communicate, send_signal, kill, returncode (0, or the exit code of the first rank seen to
    fail; torchrun would say 1 and print the ranks' codes), and `exitcodes` by rank."""

    def __init__(
        self,
        args: list[str],
        nproc: int | None = 2,
        cwd: Path | None = None,
        env: dict | None = None,
        stop_others: bool = True,
    ):
        import torch.distributed as dist

        self.args = [str(a) for a in args]
        environ = dict(os.environ if env is None else env)
        self._folder = tempfile.mkdtemp(prefix="job-")
        self._out, self._err = (os.path.join(self._folder, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            open(path, "w").close()
        pids_file = os.path.join(self._folder, "pids")  # the ranks' process ids, for a task that plays the scheduler
        environ["JOB_PIDS"] = pids_file
        self._store = None
        if nproc is None:
            environs = [environ]
        else:  # the agent's store, which every rank joins as a client (port 0: the system picks a free one)
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            run_id = str(uuid.uuid4())
            environs = [environ | torchrun_environment(r, nproc, self._store.port, run_id) for r in range(nproc)]
        ctx = _context()
        self.procs = [ctx.Process(target=_run_py, args=(self.args, e, str(cwd or REPO), self._out, self._err))
                      for e in environs]  # fmt: skip
        for p in self.procs:
            p.start()
        self.pids = [p.pid for p in self.procs]
        Path(pids_file + ".tmp").write_text(" ".join(map(str, self.pids)))
        os.replace(pids_file + ".tmp", pids_file)  # whole when read: the ranks are still starting
        self.pid = self.pids[0]
        self.returncode = None
        self.stop_others = stop_others
        self._first_failure = None
        self._stop_by = None

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def poll(self) -> int | None:
        """None while a rank runs; after the first failure, the others are sent SIGTERM (SIGKILL 30 s later), unless
        they are to end by themselves."""
        if self._first_failure is None:
            failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
            if failed:
                self._first_failure = failed[0]
                if self.stop_others:
                    self.send_signal(signal.SIGTERM)
                    self._stop_by = time.monotonic() + STOP_GRACE
        if self._stop_by is not None and time.monotonic() > self._stop_by:
            self.kill()
        if any(p.exitcode is None for p in self.procs):
            return None
        self.returncode = self._first_failure or 0
        self._store = None  # the agent's store goes with the job
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The job's code once every rank has ended; subprocess.TimeoutExpired (every rank killed) at `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                for p in self.procs:
                    p.join(timeout=10)
                raise subprocess.TimeoutExpired([str(RUN_PY), *self.args], timeout, *self._read())
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = self._read()
        shutil.rmtree(self._folder, ignore_errors=True)
        return out, err

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self) -> tuple[str, str]:
        return tuple(Path(path).read_text(errors="replace") for path in (self._out, self._err))


def launch(args: list[str], nproc: int | None = 2, timeout: float = 240, cwd: Path | None = None):
    """run.py ARGS on `nproc` warm ranks as torchrun starts them (nproc=None: one process, as `python run.py`), to
    its end; a CompletedProcess (returncode: 0, or the first failing rank's code)."""
    job = Job(args, nproc, cwd)
    try:
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.returncode is None:
            job.kill()
    return subprocess.CompletedProcess([str(RUN_PY), *job.args], job.returncode, out, err)


def _torchrun_command(args: list[str], nproc: int = 2, extra=()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra,
        str(REPO / "run.py"),
        *args,
    ]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, cwd: Path | None = None, extra=()):
    """`torchrun --standalone --nproc_per_node=N run.py ARGS`, as a user types it."""
    cmd = _torchrun_command(args, nproc, extra)
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def preempted(args: list[str], checkpoint: Path, timeout: float = 120, nproc: int = 2, ready=None) -> tuple[str, str]:
    """run.py ARGS on `nproc` warm ranks (`Job`), SIGTERM to every rank, as torchrun forwards it, as soon as
    `checkpoint` exists (or `ready()` is true); the job's (stdout, stderr). Both waits are bounded."""
    job = Job(args, nproc)
    ready = ready or checkpoint.exists
    deadline = time.time() + timeout
    try:
        while not ready() and time.time() < deadline and job.poll() is None:
            time.sleep(0.02)
        job.send_signal(signal.SIGTERM)
        return job.communicate(timeout=timeout)
    finally:
        if job.returncode is None:
            job.kill()


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
