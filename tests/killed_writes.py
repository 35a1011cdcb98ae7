"""Writes killed from inside, at a known byte: the process SIGKILLs itself once the first N bytes of a file are
written (flushed first, so a test finds exactly N bytes on disk). A kill from outside lands wherever the process
happens to be (importing torch, between two saves); this one lands in the middle of the write, every time.

Also a task file: `--task tests/killed_writes.py:ShardWriteKilled` is the built-in task, whose rank R, with
$KILL_SHARD_WRITE=R:NTH:BYTES, SIGKILLs itself BYTES bytes into the NTH sharded checkpoint file it writes.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from task import Task


class KilledAfter:
    """A writable stream that passes writes on to `stream` until `limit` bytes in all; the write that reaches the
    limit writes up to it, flushes, and SIGKILLs this process. Anything else is the stream's own."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.written = stream, limit, 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if self.written + len(data) >= self.limit:
            self.stream.write(data[: self.limit - self.written])
            self.stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def kill_torch_save_after(limit: int) -> None:
    """torch.save, from now on in this process, dies `limit` bytes into what it writes (to a file object, or to a
    path it is given)."""
    import torch

    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as opened:
                return real(obj, KilledAfter(opened, limit), *args, **kwargs)
        return real(obj, KilledAfter(f, limit), *args, **kwargs)

    torch.save = save


def kill_shard_write_after(limit: int, nth: int) -> None:
    """torch.distributed.checkpoint, from now on in this process, dies `limit` bytes into the `nth` shard file
    (*.distcp) it writes."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream
    if getattr(real, "killing", False):  # once per process, however often the task is built
        return
    opened = 0

    @contextmanager
    def create_stream(self, path, mode):
        nonlocal opened
        with real(self, path, mode) as stream:
            if "w" in mode and str(path).endswith(".distcp"):
                opened += 1
                if opened == nth:
                    stream = KilledAfter(stream, limit)
            yield stream

    create_stream.killing = True
    filesystem.FileSystem.create_stream = create_stream


class ShardWriteKilled(Task):
    """The built-in task; with $KILL_SHARD_WRITE=RANK:NTH:BYTES, that rank dies BYTES bytes into its NTH shard file."""

    def __init__(self, args):
        super().__init__(args)
        spec = os.environ.get("KILL_SHARD_WRITE")
        if spec:
            rank, nth, limit = map(int, spec.split(":"))
            if int(os.environ.get("RANK", "0")) == rank:
                kill_shard_write_after(limit, nth)
