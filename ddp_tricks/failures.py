"""How a run that fails ends: on every rank together, with its exit code, and one line that names the cause (a user
mistake, a non-finite loss, a lost peer); a bug keeps its traceback. run.py's main() hands each failure here.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from ddp_tricks import cli
from ddp_tricks.data import workers
from ddp_tricks.distributed import heartbeat, stacks, watchdog
from ddp_tricks.errors import UserError, report
from ddp_tricks.storage import checkpoint

PREEMPTED = 143  # exit code after SIGTERM: the last checkpoint holds the state, `--resume auto` continues exactly
NONFINITE = 3  # exit code after a NaN/inf loss
HUNG = heartbeat.HUNG  # 4: a rank went silent, or no rank made progress (a stuck collective); the watchdog ended it
USER_ERROR = 2
BUG = 1


def nonfinite(error, flags, rank: int) -> int:
    """A NaN/inf loss, raised on every rank together: rank 0 says which checkpoint keeps the last good weights."""
    watchdog.fail(NONFINITE)
    if rank == 0:
        run_dir = Path(flags.run_dir)
        kept = "no checkpoint was written before it"
        last = checkpoint.LAST[flags.strategy]
        if (run_dir / last).exists():
            kept = f"{last} keeps the last good weights"
        fix = "Lower --base-lr, add --clip-grad-norm, or pass --on-nonfinite skip"
        report(f"{error}; {kept}. {fix}", run_dir / "train.log")
    return watchdog.leave(NONFINITE)


def user_error(error: UserError, rank: int) -> int:
    """A user mistake: said once, as one line, and exit code 2 on every rank."""
    first = watchdog.fail(USER_ERROR)  # the other ranks learn it at once: none waits in a collective for this one
    error = cli.blame(error)  # a value from --config FILE: the message names the file and the key
    # with a process group, the job's first failure says it (on whichever rank); before one, every rank fails
    # the same check: rank 0 says it, unless only this rank is concerned
    said = first if watchdog.active() else rank == 0 or error.rank_specific
    if said:
        report(str(error) if rank == 0 else f"on rank {rank}: {error}")
    return watchdog.leave(USER_ERROR, said)  # before the group, one that leaves it to rank 0 lingers first


def bug(error: BaseException, flags, rank: int) -> int:
    """Anything else, with a process group: the first rank that fails shows its traceback, or says that another
    process of the job is gone (its own error is then only the echo of that), and the others end quietly. Without
    a group it is raised as it is. A DataLoader worker that died is no bug of the run's: one line (worker_died)."""
    workers.stop_watching_children()  # first: torch's SIGCHLD handler would raise in the middle of this
    lost_worker = workers.died(error)
    if lost_worker is not None:
        return worker_died(lost_worker, flags, rank)
    if not watchdog.active():
        raise error
    if watchdog.fail(BUG):
        gone = watchdog.lost_peer(error)  # not a bug here: another process died first, without a word
        nccl = watchdog.nccl_abort(error)  # nor here: NCCL's watchdog aborted (a timeout, an NCCL or a CUDA error)
        aborted = stacks.aborted_peers(getattr(flags, "run_dir", None), rank, _world_size()) if gone or nccl else {}
        if (aborted or nccl) and (nccl or _backend() == "nccl"):  # on nccl, a process aborts by NCCL's watchdog
            report(f"on rank {rank}: {nccl_aborted(aborted, error, nccl)}")
        elif aborted:  # it aborted in a collective: gloo's "Received data size doesn't match expected size"
            report(f"on rank {rank}: {mismatch(aborted, error)}")
        elif gone:
            report(
                f"on rank {rank}: another process of the job is gone (killed, or its node lost: {gone}); {_then(flags)}"
            )
        else:
            traceback.print_exception(error)
    return watchdog.leave(BUG)


def worker_died(what: str, flags, rank: int) -> int:
    """A DataLoader worker that died (the out-of-memory killer's SIGKILL, a crash in a transform's C code): a failure,
    neither a bug of the run's nor a preemption, said as one line naming the worker, the rank and how to go on."""
    if watchdog.fail(BUG):
        log = Path(flags.run_dir) / "train.log" if getattr(flags, "run_dir", None) else None
        report(f"on rank {rank}: {what}; {_then(flags)}", log)
    return watchdog.leave(BUG)


def _then(flags) -> str:
    """How a run that lost a process goes on: torchrun restarts it (--max-restarts, with --resume auto), or a resume."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    if restarts and getattr(flags, "resume", None) == "auto":
        return "torchrun restarts the job from the last checkpoint"
    return "resume it with -n NAME --resume auto"


def mismatch(aborted: dict[int, str], error: BaseException) -> str:
    """A collective mismatch, said as one: which ranks aborted in which collective (from their stacks files), and
    where this rank was (from its error's traceback)."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    here = stacks.collective(frames) or "a collective"
    there = "; ".join(f"rank {r} aborted in {at}" for r, at in sorted(aborted.items()))
    return (
        f"a collective mismatch: {there}, while this rank was in {here} at {stacks.where(frames)} (gloo's "
        '"Received data size doesn\'t match expected size" above): the ranks called different collectives, or the '
        "same with different sizes. Every rank must call the same collectives in the same order with the same "
        "shapes; a resume fails the same way until the code is fixed (TORCH_DISTRIBUTED_DEBUG=DETAIL names both)"
    )


def nccl_aborted(aborted: dict[int, str], error: BaseException, nccl: str | None) -> str:
    """NCCL's own abort, said as one (never a collective mismatch): what this rank's error says (`nccl`), the ranks
    whose process aborted (their stacks files: `aborted`), and where this rank was."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    here = f"this rank was in {stacks.collective(frames) or 'a collective'} at {stacks.where(frames)}"
    there = "".join(f"; rank {r} aborted in {at}" for r, at in sorted(aborted.items()))
    what = nccl or f"NCCL's watchdog took a process down ({watchdog.lost_peer(error) or str(error)[:120]})"
    return (
        f"{what}{there}; {here}. NCCL's watchdog ends a process after a collective ran past --dist-timeout, or after "
        "an NCCL or a CUDA error; each rank's own lines above say which (a rank stopped or a collective that not "
        "every rank called times out; CUDA_LAUNCH_BLOCKING=1 names a failing kernel)"
    )


def _backend() -> str:
    """The process group's backend ('' without one)."""
    import torch.distributed as dist

    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
