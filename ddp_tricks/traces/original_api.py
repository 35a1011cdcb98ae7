"""The original variable-batch project's API, on torch.distributed: `CustomSampler` yields this rank's
micro-batches of each trace step (a DataLoader `batch_sampler`), and `LinearRuleOptimizer` / `RootRuleOptimizer`
/ `AdaScaleOptimizer` wrap an optimizer whose `step()` runs after every backward and updates once per step.

run.py does not use this file: its loop reads the same trace through ddp_tricks/plan.py. Both reduce with
`trace_reduction.reduce_gradients`, so a step here equals a step there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_tricks.distributed.trace_reduction import AdaScale, reduce_gradients
from ddp_tricks.traces.batch_trace import check_trace, epoch_steps, load_trace, lr_factor


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass
class MicroBatch:
    step: int  # trace step
    batch: int  # the step's global batch size
    size: int  # samples in this micro-batch
    real: bool  # False: a placeholder, so that every rank yields as many micro-batches per step; weighted zero
    last: bool  # the last micro-batch of the step on this rank (all ranks have the same count)


class CustomSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of indices) for `DataLoader(dataset, batch_sampler=sampler)`.

    Every rank yields the same number of micro-batches per step (the most any rank holds); a rank with fewer
    yields placeholders (a real micro-batch of the step, weighted zero by the optimizer wrappers), so a plain
    loop never deadlocks. Epochs count from 0 (`set_epoch`); trace steps run on across epochs.
    """

    def __init__(self, dataset, trace, num_replicas: int | None = None, rank: int | None = None,
                 minibatch_size: int = 32, seed: int = 0, repeat_last: bool = True):  # fmt: skip
        world, me = _world()
        self.dataset_size = len(dataset)
        self.trace = load_trace(trace)
        check_trace(self.trace, minibatch_size)
        self.num_replicas = world if num_replicas is None else num_replicas
        self.rank = me if rank is None else rank
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.repeat_last = repeat_last
        self.epoch = 0
        self.skip = 0  # micro-batches of this epoch already consumed (set by load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a restored position inside this epoch survives set_epoch(the same epoch)
            self.skip = 0
        self.epoch = epoch

    def first_step(self, epoch: int) -> int:
        step = 0
        for e in range(epoch):
            step += len(epoch_steps(self.dataset_size, self.trace, step, self.seed, e, self.repeat_last))
        return step

    def plan(self) -> tuple[list[list[int]], list[MicroBatch]]:
        batches, entries = [], []
        first = self.first_step(self.epoch)
        for step, indices in epoch_steps(self.dataset_size, self.trace, first, self.seed, self.epoch,
                                         self.repeat_last):  # fmt: skip
            chunks = indices.split(self.minibatch_size)
            mine = chunks[self.rank :: self.num_replicas]
            per_rank = math.ceil(len(chunks) / self.num_replicas)
            for k in range(per_rank):
                real = k < len(mine)
                chunk = mine[k] if real else chunks[0]
                batches.append(chunk.tolist())
                entries.append(MicroBatch(step, len(indices), len(chunk), real, k == per_rank - 1))
        return batches, entries

    def __iter__(self):
        return iter(self.plan()[0][self.skip :])

    def __len__(self) -> int:
        return len(self.plan()[0]) - self.skip

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "skip": self.skip}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.skip = state["epoch"], state["skip"]


class _TraceRuleOptimizer:
    """Call step() after every backward: it accumulates the micro-batch's gradient (a placeholder's weighted
    zero) and, on the step's last micro-batch, all-reduces once, scales the LR by the rule and updates.
    The model is a plain module (not DDP): this wrapper does the one reduction per step."""

    rule = "none"

    def __init__(self, optimizer: torch.optim.Optimizer, sampler: CustomSampler, ref_batchsize: int):
        self.optimizer = optimizer
        self.sampler = sampler
        self.ref_batchsize = ref_batchsize
        self.adascale = AdaScale() if self.rule == "adascale" else None
        self._entries = sampler.plan()[1]
        self._cursor = 0
        self._accumulated: list[torch.Tensor] | None = None
        self._sq_norms: torch.Tensor | float = 0.0
        self.gain = 1.0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self._entries = self.sampler.plan()[1]
        self._cursor = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self) -> bool:
        """Returns True when this call updated the weights."""
        entry = self._entries[self.sampler.skip + self._cursor]
        self._cursor += 1
        params = self._params()
        if self._accumulated is None:
            self._accumulated = [torch.zeros_like(p) for p in params]
        if entry.real:  # the loss was the micro-batch mean: weight it by its share of the global batch
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch._foreach_add_(self._accumulated, grads, alpha=entry.size / entry.batch)
            if self.adascale is not None:
                self._sq_norms = self._sq_norms + sum(torch.sum(g.double() ** 2) for g in grads)
        for p in params:
            p.grad = None
        if not entry.last:
            return False
        micro_batches = entry.batch // self.sampler.minibatch_size
        self.gain = reduce_gradients(params, self._accumulated, self._sq_norms, self.adascale, micro_batches)
        factor = self.gain if self.rule == "adascale" else lr_factor(self.rule, entry.batch, self.ref_batchsize)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr  # the user's schedule keeps seeing (and stepping) the reference LR
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated = None
        self._sq_norms = 0.0
        return True

    def state_dict(self) -> dict:
        """Resumable at a step boundary: the base optimizer, where the sampler is, and AdaScale's estimates."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "sampler": {"epoch": self.sampler.epoch, "skip": self.sampler.skip + self._cursor},
            "adascale": self.adascale.state_dict() if self.adascale is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self._entries = self.sampler.plan()[1]
        self._cursor = 0
        if self.adascale is not None and state["adascale"] is not None:
            self.adascale.load_state_dict(state["adascale"])


class LinearRuleOptimizer(_TraceRuleOptimizer):
    """LR of step i = LR x B_i / ref_batchsize."""

    rule = "linear"


class RootRuleOptimizer(_TraceRuleOptimizer):
    """LR of step i = LR x sqrt(B_i / ref_batchsize)."""

    rule = "root"


class AdaScaleOptimizer(_TraceRuleOptimizer):
    """LR of step i = LR x AdaScale's gain r (see AdaScale)."""

    rule = "adascale"
