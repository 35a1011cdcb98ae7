"""Variable batch size from a trace: the global batch of every optimizer step comes from a CSV file (or a list),
the step's samples are cut into micro-batches dealt round-robin to the ranks, and the update uses the exact
mean gradient over the step's samples, with linear / root / AdaScale learning-rate rules.

How an epoch is cut: step i takes the next B_i samples of the epoch's permutation (seeded by seed + epoch).
A step that would run past the end of the epoch is not taken: the remaining samples (fewer than B_i) are left
out of that epoch, and the next epoch starts with trace step i.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from config import UserError


class Trace(list):
    """Batch sizes by step (a list of ints) that remembers where each one is in its file, for messages:
    `where[i]` is e.g. "'trace.csv' line 5 (step 3)" (line 1 is the header; the step is the file's own)."""

    def __init__(self, sizes: list[int], where: list[str]):
        super().__init__(sizes)
        self.where = where


def load_trace(source: str | Path | list[int] | int) -> list[int]:
    """Batch sizes by step from a CSV (`step,batchsize` or a single `batchsize` column), a list, or one int.
    From a file, the list is a `Trace` that names each row's line (and step) for check_trace's messages."""
    if isinstance(source, int):
        return [source]
    if isinstance(source, (list, tuple)):
        return [int(b) for b in source]
    path = Path(source)
    name = repr(str(path))
    if not path.is_file():
        raise UserError(f"--batch-trace {name} does not exist: give a CSV with a header `step,batchsize`")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if "batchsize" not in header:
            raise UserError(f"{name} line 1: expected a header with a `batchsize` column (e.g. `step,batchsize`)")
        column = header.index("batchsize")
        step_column = header.index("step") if "step" in header else None
        sizes, where = [], []
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            here = f"{name} line {reader.line_num}"
            if step_column is not None and step_column < len(row) and row[step_column].strip():
                here += f" (step {row[step_column].strip()})"
            try:
                sizes.append(int(row[column]))
            except (ValueError, IndexError):
                raise UserError(f"{here}: {','.join(row)!r} has no integer batch size") from None
            where.append(here)
    if not sizes:
        raise UserError(f"{name} has no rows: give one batch size per optimizer step")
    return Trace(sizes, where)


def check_trace(trace: list[int], micro_batch: int, where: list[str] | None = None) -> None:
    """Every batch size a positive multiple of the micro-batch. `where[i]` names row i in the message
    (default: a Trace's own, else "trace step i")."""
    where = where if where is not None else getattr(trace, "where", None)
    for step, batch in enumerate(trace):
        if batch < 1 or batch % micro_batch:
            label = where[step] if where is not None else f"trace step {step}"
            raise UserError(
                f"{label}: batch size {batch} is not a positive multiple of the micro-batch "
                f"(--batch-size {micro_batch})"
            )


def batch_at(trace: list[int], step: int, repeat_last: bool) -> int | None:
    if step < len(trace):
        return trace[step]
    return trace[-1] if repeat_last else None


def epoch_steps(
    num_samples: int, trace: list[int], first_step: int, seed: int, epoch: int, repeat_last: bool
) -> list[tuple[int, torch.Tensor]]:
    """The epoch's steps: (trace step, the sample indices of its global batch)."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    steps, position, step = [], 0, first_step
    while True:
        batch = batch_at(trace, step, repeat_last)
        if batch is None or position + batch > num_samples:
            return steps
        steps.append((step, order[position : position + batch]))
        position += batch
        step += 1


def steps_needed(num_samples: int, trace: list[int], epochs: int, seed: int) -> int:
    """How many trace rows a run of `epochs` uses (each epoch as far as the trace, repeated last, reaches)."""
    step = 0
    for epoch in range(1, epochs + 1):
        step += len(epoch_steps(num_samples, trace, step, seed, epoch, repeat_last=True))
    return step


def deal(indices: torch.Tensor, micro_batch: int, world_size: int, rank: int) -> list[torch.Tensor]:
    """Cut a global batch into micro-batches and deal them round-robin: micro-batch j goes to rank j % world."""
    chunks = indices.split(micro_batch)
    return [chunk for j, chunk in enumerate(chunks) if j % world_size == rank]


def lr_factor(rule: str, batch: int, ref_batch: int, gain: float = 1.0) -> float:
    """LR_i = ref LR x B_i / ref (linear), x sqrt(B_i / ref) (root), x r (adascale), x 1 (none)."""
    if rule == "linear":
        return batch / ref_batch
    if rule == "root":
        return math.sqrt(batch / ref_batch)
    if rule == "adascale":
        return gain
    return 1.0


@dataclass
class AdaScale:
    """AdaScale's gain (Johnson et al., 2020) from the micro-batch gradients of a step, smoothed across steps.

    With S micro-batch gradients g_j (each the mean over b samples) and their mean g:
        sigma^2 = (sum_j ||g_j||^2 - S ||g||^2) / (S - 1)     (the micro-batch gradient variance, S >= 2)
        mu^2    = ||g||^2 - sigma^2 / S                       (the squared norm of the true gradient)
    both averaged with weight `theta` over steps; gain r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2).
    A step with S = 1 cannot estimate the variance: it keeps the smoothed estimates (r from them, or 1).
    """

    theta: float = 0.9
    sigma2: float | None = None
    mu2: float | None = None
    history: list = field(default_factory=list)

    def update(self, sum_sq_norms: float, mean_sq_norm: float, count: int) -> float:
        if count >= 2:
            sigma2 = max((sum_sq_norms - count * mean_sq_norm) / (count - 1), 0.0)
            mu2 = max(mean_sq_norm - sigma2 / count, 0.0)
            if self.sigma2 is None:
                self.sigma2, self.mu2 = sigma2, mu2
            else:
                self.sigma2 = self.theta * self.sigma2 + (1 - self.theta) * sigma2
                self.mu2 = self.theta * self.mu2 + (1 - self.theta) * mu2
        return self.gain(count)

    def gain(self, count: int) -> float:
        if self.sigma2 is None or self.sigma2 + self.mu2 <= 0:
            return 1.0
        return (self.sigma2 + self.mu2) / (self.sigma2 / count + self.mu2)

    def state_dict(self) -> dict:
        return {"theta": self.theta, "sigma2": self.sigma2, "mu2": self.mu2}

    def load_state_dict(self, state: dict) -> None:
        self.theta, self.sigma2, self.mu2 = state["theta"], state["sigma2"], state["mu2"]


def fetch(dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch: one indexing operation for in-memory data, else the samples collated."""
    if hasattr(dataset, "inputs"):
        return dataset.__getitems__(indices.tolist())
    return torch.utils.data.default_collate([dataset[i] for i in indices.tolist()])


def _all_reduce_(tensors: list[torch.Tensor]) -> None:
    if dist.is_available() and dist.is_initialized() and tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


def reduce_and_update(optimizer, params, accumulated, sq_norms, adascale: AdaScale | None, rule: str, batch: int,
                      micro_batches: int, ref_batch: int) -> tuple[float, float]:  # fmt: skip
    """The end of a trace step, on every rank: one all-reduce of this rank's share of the mean gradient (and of
    the micro-batch gradients' squared norms for AdaScale), then one update at LR x the rule's factor, after
    which the groups get their reference LR back. Returns (AdaScale gain or 1, LR factor)."""
    sq = torch.as_tensor(sq_norms, dtype=torch.float64, device=params[0].device).reshape(1)
    extras = [sq] if adascale is not None else []
    _all_reduce_(accumulated + extras)
    for p, g in zip(params, accumulated):
        p.grad = g
    gain = 1.0
    if adascale is not None:
        mean_sq = sum(torch.sum(g.double() ** 2) for g in accumulated)
        sum_sq, mean_sq = torch.stack([extras[0][0], mean_sq]).tolist()  # the one host sync of the step
        gain = adascale.update(sum_sq, mean_sq, micro_batches)
    factor = lr_factor(rule, batch, ref_batch, gain)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, base_lrs):
        group["lr"] = lr  # the user's schedule keeps seeing (and stepping) the reference LR
    optimizer.zero_grad(set_to_none=True)
    return gain, factor


def trace_step(t, dataset, micro_batches: list[torch.Tensor], batch: int, micro_batch: int, rule: str,
               ref_batch: int, adascale: AdaScale | None) -> dict:  # fmt: skip
    """One optimizer step on a global batch of `batch` samples of which this rank holds `micro_batches`.

    Each rank sums the gradients of its micro-batches' summed losses, divided by the global batch; one
    all-reduce (every rank takes part, also one with no micro-batch, which adds exactly zero) gives the mean
    gradient over all `batch` samples. The model must not be DDP-wrapped: this step does the reduction.
    """
    model, params = t.raw_model, [p for p in t.raw_model.parameters() if p.requires_grad]
    model.train()
    loss_total = torch.zeros((), dtype=torch.float64, device=t.device)
    correct = torch.zeros((), dtype=torch.float64, device=t.device)
    count = 0
    accumulated = [torch.zeros_like(p) for p in params]
    sq_norms = torch.zeros((), dtype=torch.float64, device=t.device)
    for indices in micro_batches:
        inputs, targets = t.to_device(*fetch(dataset, indices))
        with t.autocast():
            outputs = model(inputs)
            loss_sum = t.criterion(outputs.float(), targets)
        (loss_sum / batch).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if adascale is not None:  # ||g_j||^2 of this micro-batch's mean gradient: (grad * batch / b)^2
            scale = batch / len(indices)
            sq_norms += sum(torch.sum((g.double() * scale) ** 2) for g in grads)
        torch._foreach_add_(accumulated, grads)
        for p in params:
            p.grad = None
        loss_total += loss_sum.detach()
        correct += (outputs.argmax(1) == targets).sum()
        count += len(targets)
    gain, factor = reduce_and_update(t.optimizer, params, accumulated, sq_norms, adascale, rule, batch,
                                     batch // micro_batch, ref_batch)  # fmt: skip
    if rule == "adascale":  # scale-invariant progress: the schedule advances by r
        t.schedule.per_step.last_epoch += gain - 1
    t.schedule.step()
    t.global_step += 1
    return {"loss_sum": loss_total, "correct": correct, "count": count, "gain": gain, "lr_factor": factor}


def train_trace_epoch(t, dataset, trace: list[int], epoch: int, cfg, rank: int, world_size: int,
                      adascale: AdaScale | None) -> dict:  # fmt: skip
    """One epoch of trace steps (from trace step t.global_step on); the epoch's metrics reduced across ranks."""
    import time

    from distributed import all_reduce_sum
    from engine import epoch_metrics

    start = time.perf_counter()
    sums = torch.zeros(3, dtype=torch.float64, device=t.device)
    repeat_last = cfg.trace_end == "repeat-last"
    for _, indices in epoch_steps(len(dataset), trace, t.global_step, cfg.seed, epoch, repeat_last):
        mine = deal(indices, cfg.batch_size, world_size, rank)
        out = trace_step(t, dataset, mine, len(indices), cfg.batch_size, cfg.batch_lr_rule, cfg.ref_batch_size,
                         adascale)  # fmt: skip
        sums[0] += out["loss_sum"]
        sums[1] += out["correct"]
        sums[2] += out["count"]
    return epoch_metrics(all_reduce_sum(sums), time.perf_counter() - start, skipped_steps=0)


def check_run(cfg, num_samples: int) -> tuple[list[int], int]:
    """The trace for this run and how many steps the run takes; errors name the fix (before any group)."""
    trace = load_trace(cfg.batch_trace)
    check_trace(trace, cfg.batch_size)
    needed = steps_needed(num_samples, trace, cfg.epochs, cfg.seed)
    if needed == 0:
        raise UserError(f"the trace's first batch ({trace[0]}) is larger than the {num_samples} training samples")
    if cfg.trace_end == "error" and len(trace) < needed:
        raise UserError(
            f"the trace has {len(trace)} steps but {cfg.epochs} epochs need {needed}: "
            "extend it, train fewer epochs, or pass --trace-end repeat-last"
        )
    return trace, needed


# The original project's API, on torch.distributed: a sampler that yields this rank's micro-batches and optimizer
# wrappers whose step() runs after every backward and updates once per trace step.


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
        self.gain, _ = reduce_and_update(
            self.optimizer, params, self._accumulated, self._sq_norms, self.adascale, self.rule, entry.batch,
            entry.batch // self.sampler.minibatch_size, self.ref_batchsize,
        )  # fmt: skip
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
