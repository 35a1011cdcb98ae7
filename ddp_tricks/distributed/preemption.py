"""SIGTERM, agreed on: every rank stops after the same step, whichever process the signal reached."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

_LIVE: list[Preemption] = []


def close_all() -> None:
    """Settle every agreement still in flight: tearing a group down under pending work aborts the process."""
    while _LIVE:
        _LIVE.pop().close()


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send, and torchrun forwards) asks every rank to stop together.

    `agreed()` runs after every step: it reads the previous step's all-reduced flag and starts the next
    all-reduce without waiting (a CPU collective on the gloo control group), so every rank decides on the
    same step while no step waits on the network. `agreed(final=True)` settles it synchronously.
    """

    def __init__(self, dist_info):
        self.requested = False
        self.group = dist_info.control_group
        self.enabled = dist_info.enabled
        self._pending = None
        self._value = None
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)
        _LIVE.append(self)

    def close(self) -> None:
        """Settle any agreement in flight and give SIGTERM its previous handler back (unless another has been set
        over this one since: a process that is ending holds SIGTERM, launch.cleanup)."""
        try:
            self._settle()
        except Exception:  # a broken group: the error that broke it is already on its way up
            pass
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous_handler)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def _start(self) -> None:
        self._value = torch.tensor([1.0 if self.requested else 0.0])
        self._pending = dist.all_reduce(self._value, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _settle(self) -> bool:
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._value.item() > 0)

    def agreed(self, final: bool = False) -> bool:
        if not self.enabled:
            return self.requested
        decided = self._settle()
        if final:
            self._start()
            return self._settle() or decided
        if not decided:
            self._start()
        return decided
