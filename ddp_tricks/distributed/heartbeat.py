"""Heartbeats and progress: a rank that goes silent, or a job whose ranks all stop making progress, ends the job with
one line per rank saying where it waits, each live rank's stacks in the run folder, and exit code 4 (HUNG).

Stages report their phase (`phase("eval")`) and the training loop its step (`step(n)`): a few module variables set,
no host sync, no collective, nothing polled. The watchdog's daemon thread (watchdog.py) calls `Heart.beat()` once a
second; it publishes this rank's heartbeat to the job's store (a counter, the phase and step, the seconds since its
last progress, its slowest step, the collective its main thread waits in and the first frame of the user's code,
from the main thread's stack), and on ranks 0 and N-1 (the observers) reads every rank's. Two cases are found:

- a rank whose heartbeat stops (a stopped process, a frozen node): after --heartbeat-timeout seconds of silence, as
  seen on the observer's own clock (no clock is compared across nodes);
- no rank makes progress: every rank not finished has made none for max(--hang-factor x the slowest step seen,
  --hang-timeout) in training, or, in a phase of long legitimate work (start-up, a first step, evaluation, a
  checkpoint, figures, precise BN, and a training step before any ordinary step has been timed), for
  --hang-timeout while waiting in a torch.distributed call, or in one of the template's reads of a collective's
  result (`waits_for`: where nccl's host waits). A rank working in such a phase (its main thread anywhere else:
  torch.save, a slow evaluation), or compiling (torch.compile's frames on its stack, at any step), is never counted
  as stuck.

Then the observer that claims the verdict asks every live rank for its stacks (stacks-rankR.txt) and its line, says
the cause and the lines, ends a silent rank on its own host (SIGKILL: a stopped process takes no SIGTERM, and
torchrun restarts the job only once every worker has ended), and the job ends with HUNG.

A process that aborts (gloo's "Received data size doesn't match expected size" is a C++ abort, not an exception)
writes its Python stacks to the same file (faulthandler); a peer that then loses it reads them (`aborted_peers`), so
the job says "collective mismatch" with the operation and the ranks, not "another process is gone".

Costs per step: a monotonic clock read and three assignments. Once a second, per rank: one store write and one
check; on the two observers, one read of every rank's heartbeat.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import time
from pathlib import Path

from ddp_tricks.distributed.stacks import all_stacks, collective, compiling, main_frames, where

HUNG = 4  # exit code when the watchdog ends a job that hangs (failures.HUNG)
HEARTBEAT_TIMEOUT = 30.0  # --heartbeat-timeout
HANG_FACTOR = 10.0  # --hang-factor
HANG_TIMEOUT = 120.0  # --hang-timeout
ANSWER = 3.0  # seconds the observer waits for the live ranks' lines and stacks

_phase, _step, _moved, _slowest = "start-up", 0, time.monotonic(), 0.0
_settings = {"run_dir": None, "heartbeat_timeout": HEARTBEAT_TIMEOUT, "factor": HANG_FACTOR, "floor": HANG_TIMEOUT}
_abort_file = None  # this rank's stacks file, held open for faulthandler (armed with several ranks)
_armed = False


def configure(
    run_dir, world_size: int, heartbeat_timeout=HEARTBEAT_TIMEOUT, hang_factor=HANG_FACTOR, hang_timeout=HANG_TIMEOUT
) -> None:
    """Where stacks go (the run folder), whether there are peers to tell (`world_size`), and the thresholds
    (--heartbeat-timeout, --hang-factor, --hang-timeout)."""
    global _phase, _moved, _slowest, _armed
    _settings.update(run_dir=Path(run_dir), heartbeat_timeout=heartbeat_timeout, factor=hang_factor)
    _settings["floor"] = hang_timeout
    _phase, _moved, _slowest, _armed = "start-up", time.monotonic(), 0.0, world_size > 1


def phase(name: str) -> None:
    """This rank now does `name` (start-up, first step, train, eval, checkpoint, figures, precise-bn, done)."""
    global _phase, _moved
    _phase, _moved = name, time.monotonic()
    _stacks_on_abort()


def step(global_step: int, first: bool = False) -> None:
    """Training step `global_step` (from 1) begins (`first`: the first of this process or epoch, which may compile
    or start workers). The time since the previous step, both in training, counts toward the slowest step seen."""
    global _phase, _step, _moved, _slowest
    now = time.monotonic()
    if _phase == "train":
        _slowest = max(_slowest, now - _moved)
    _phase, _step, _moved = "first step" if first else "train", global_step, now
    if first:
        _stacks_on_abort()


def _stacks_on_abort() -> None:
    """Once the run folder exists (the first step, any phase after start-up), with peers: a SIGABRT (gloo's
    collective mismatch is one) writes this rank's stacks there, for a peer to read (`aborted_peers`)."""
    global _abort_file
    run_dir = _settings["run_dir"]
    if _abort_file is not None or not _armed or run_dir is None or not run_dir.is_dir():
        return
    rank = os.environ.get("RANK", "0")
    _abort_file = (run_dir / f"stacks-rank{rank}.txt").open("w")  # held open: faulthandler writes from its handler
    faulthandler.enable(_abort_file, all_threads=True)


def disarm() -> None:
    """No more stacks on abort; this rank's stacks file goes if nothing was written to it."""
    global _abort_file
    if _abort_file is None:
        return
    faulthandler.disable()
    path = Path(_abort_file.name)
    _abort_file.close()
    _abort_file = None
    if path.exists() and path.stat().st_size == 0:
        path.unlink()


class Heart:
    """One rank's heartbeat and, on an observer, the watch over every rank's (`beat`, from the watchdog's thread)."""

    def __init__(self, store, rank: int, world_size: int, main_thread: int):
        self.store, self.rank, self.world = store, rank, world_size
        self.main = main_thread
        self.host = socket.gethostname()
        self.count = 0
        self.observer = rank in (0, world_size - 1) and world_size > 1
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its last counter, when it changed on our clock)
        self.asked = False
        self.silent: list[int] = []
        # the first beat now, before this rank trains: a rank that stops in its first second is still heard of once
        self.store.set(f"beat/{rank}", json.dumps(self._record(time.monotonic()) | {"count": 0}))

    def beat(self, now: float) -> str | None:
        """Publish this rank's heartbeat; answer a verdict's question; on an observer, look for a silent rank or a
        hang. The cause line and the lines per rank (to be said, then the job ends with HUNG), else None."""
        self.count += 1
        record = self._record(now)
        self.store.set(f"beat/{self.rank}", json.dumps(record))
        if not self.asked and self.store.check(["verdict"]):
            self.asked = True
            self._answer(record)
        if not self.observer or self.asked:
            return None
        keys = [f"beat/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return None
        beats = [json.loads(value) for value in self.store.multi_get(keys)]
        for r, b in enumerate(beats):
            if self.seen.get(r, (None,))[0] != b["count"]:
                self.seen[r] = (b["count"], now)
        self.silent = [
            r
            for r, b in enumerate(beats)
            if r != self.rank and b["phase"] != "done" and now - self.seen[r][1] >= _settings["heartbeat_timeout"]
        ]
        cause = self._cause(beats)
        if cause is None or self.store.add("verdict_claimed", 1) != 1:
            return None
        self.store.set("verdict", cause)
        self.asked = True
        self._answer(record)
        return self._report(cause, beats, now)

    def done(self) -> None:
        """A normal end: this rank's silence from now on is not a fault; its empty stacks file goes."""
        phase("done")
        try:
            self.store.set(f"beat/{self.rank}", json.dumps(self._record(time.monotonic())))
        except Exception:  # the store is gone: the job is ending anyway
            pass
        disarm()

    def _record(self, now: float) -> dict:
        frames = main_frames(self.main)
        return {
            "count": self.count,
            "phase": _phase,
            "step": _step,
            "idle": now - _moved,
            "slowest": _slowest,
            "waits": collective(frames),
            "compiles": compiling(frames),
            "where": where(frames),
            "pid": os.getpid(),
            "host": self.host,
        }

    def _cause(self, beats: list[dict]) -> str | None:
        limit, silent = _settings["heartbeat_timeout"], self.silent
        if silent:
            names = ", ".join(map(str, silent))
            return (
                f"rank {names} {'is' if len(silent) == 1 else 'are'} silent: no heartbeat for {limit:g} s "
                f"(--heartbeat-timeout), its process stopped or frozen, or its node unreachable"
            )
        live = [b for b in beats if b["phase"] != "done"]
        slowest = max(b["slowest"] for b in beats)
        deadline = max(_settings["factor"] * slowest, _settings["floor"])
        for b in live:
            # a training step is held to the deadline once an ordinary step has been timed (the first of a process
            # or epoch is not one: it may compile); before that, like every other phase, as long legitimate work
            timed = b["phase"] == "train" and slowest > 0
            if b["idle"] < (deadline if timed else _settings["floor"]):
                return None
            if not timed and not b["waits"] or b.get("compiles"):
                return None  # long legitimate work (every phase but timed training, or a compile), not a wait
        if not live:
            return None
        what = stuck_collective({r: b["waits"] for r, b in enumerate(beats) if b["phase"] != "done"})
        if len(live) < len(beats):
            finished = [str(r) for r, b in enumerate(beats) if b["phase"] == "done"]
            what += f"; rank {', '.join(finished)} finished without it"
        idle = min(b["idle"] for b in live)
        return (
            f"no progress on any rank for {idle:.0f} s "
            f"(max(--hang-factor {_settings['factor']:g} x the slowest step {slowest:.3g} s, "
            f"--hang-timeout {_settings['floor']:g} s)): {what}"
        )

    def _answer(self, record: dict) -> None:
        """The verdict is out: this rank's stacks into the run folder, its line into the store."""
        self.store.set(f"where/{self.rank}", json.dumps(record | {"stacks": self._dump()}))

    def _dump(self) -> str:
        run_dir = _settings["run_dir"]
        if run_dir is None:
            return ""
        path = run_dir / f"stacks-rank{self.rank}.txt"
        text = all_stacks(self.main, f"rank phase {_phase}, step {_step}")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError:
            return ""
        return str(path)

    def _report(self, cause: str, beats: list[dict], now: float) -> str:
        deadline = time.monotonic() + ANSWER
        answers: dict[int, dict] = {}
        expected = self.world - len(self.silent) - sum(b["phase"] == "done" for b in beats)
        while time.monotonic() < deadline and len(answers) < expected:
            for r in range(self.world):
                if r not in answers and self.store.check([f"where/{r}"]):
                    answers[r] = json.loads(self.store.get(f"where/{r}"))
            time.sleep(0.05)
        lines = [cause]
        for r, b in enumerate(beats):
            if r in answers:
                lines.append(f"rank {r}: {describe(answers[r])}")
            elif b["phase"] == "done" or r not in self.silent:
                lines.append(
                    f"rank {r}: {'finished' if b['phase'] == 'done' else 'no answer'}; last heard: {describe(b)}"
                )
            else:
                state = process_state(b) or "no answer"
                lines.append(f"rank {r}: silent for {now - self.seen[r][1]:.0f} s ({state}); last heard: {describe(b)}")
                end_silent(b, self.host, stacks_path(r))
        return "\n".join(lines)


def stuck_collective(waits: dict[int, str]) -> str:
    """What the collectives the live ranks wait in (rank -> the call, '' for none) say about the hang."""
    ops = sorted({op for op in waits.values() if op})
    waiting = [r for r, op in waits.items() if op]
    others = [r for r, op in waits.items() if not op]
    if len(ops) > 1:
        each = ", ".join(f"rank {r} in {op}" for r, op in waits.items() if op)
        return f"a collective mismatch: the ranks wait in different collectives ({each})"
    if ops and not others:
        return (
            f"a stuck collective: every rank waits in {ops[0]} (called with different sizes, or one rank skipped "
            "an earlier collective)"
        )
    if ops:
        return (
            f"a collective that not every rank joined: rank {_ranks(waiting)} wait(s) in {ops[0]}, rank "
            f"{_ranks(others)} not"
        )
    return "no rank waits in a torch.distributed call (a collective inside DDP's backward or NCCL, or a deadlock)"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def describe(b: dict) -> str:
    """Where a rank waits or works, from its heartbeat: phase, step, the collective, the first frame of its code."""
    doing = f"waits in {b['waits']}" if b["waits"] else "compiles" if b.get("compiles") else "is"
    phase_at = {"train": f"train step {b['step']}", "first step": f"in its first step, step {b['step']}"}.get(
        b["phase"], b["phase"]
    )
    stacks = f"; stacks in {b['stacks']}" if b.get("stacks") else ""
    return f"{phase_at}, {doing} at {b['where']} (idle {b['idle']:.0f} s){stacks}"


def process_state(b: dict) -> str:
    """What a silent rank's process is, when it runs on this host: stopped, gone, or running."""
    if b["host"] != socket.gethostname():
        return f"on {b['host']}"
    try:
        with open(f"/proc/{b['pid']}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "its process is gone"
    return {"T": "its process is stopped", "t": "its process is stopped", "Z": "its process is gone"}.get(
        state, "its process runs but does not answer"
    )


def end_silent(b: dict, host: str, stacks: Path | None = None) -> None:
    """A silent rank on this host is ended (SIGKILL reaches a stopped process), so that its launcher sees every
    worker end and, under --max-restarts, restarts the job. Its `stacks` file, opened for an abort that never came
    (a stopped or killed process writes nothing), goes if it is empty."""
    if b["host"] != host:
        return
    try:
        os.kill(b["pid"], 9)
    except OSError:
        pass
    if stacks is not None and stacks.is_file() and stacks.stat().st_size == 0:
        stacks.unlink(missing_ok=True)


def stacks_path(rank: int) -> Path | None:
    """Where rank `rank` writes its stacks (the run folder; None before there is one)."""
    run_dir = _settings["run_dir"]
    return None if run_dir is None else Path(run_dir) / f"stacks-rank{rank}.txt"


def settings() -> dict:
    return dict(_settings)
