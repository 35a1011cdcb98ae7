"""Variable batch size from a trace: the global batch of every optimizer step comes from a CSV file (or a list),
the step's samples are cut into micro-batches dealt round-robin to the ranks, and the update uses the exact
mean gradient over the step's samples (distributed/trace_reduction.py), with linear / root / AdaScale learning-rate
rules.

How an epoch is cut: step i takes the next B_i samples of the epoch's permutation (seeded by seed + epoch).
A step that would run past the end of the epoch is not taken: the remaining samples (fewer than B_i) are left
out of that epoch, and the next epoch starts with trace step i.

`--batch-trace auto` writes the trace as it goes: at each epoch's start the global batch grows towards the
gradient noise scale measured so far (`next_batch`), and the rows it used are written to the run folder's
batch_trace.csv, which `--batch-trace FILE` replays.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

from ddp_tricks.errors import UserError
from ddp_tricks.storage import files


def lr_factor(rule: str, batch: float, ref_batch: float) -> float:
    """The one LR-scaling rule, for --lr-scaling and --batch-lr-rule alike: x1 (keep, none), x batch / ref
    (linear), x sqrt(batch / ref) (sqrt, root)."""
    if rule in ("keep", "none", "adascale"):
        return 1.0
    if rule == "linear":
        return batch / ref_batch
    if rule in ("sqrt", "root"):
        return math.sqrt(batch / ref_batch)
    raise ValueError(f"unknown LR scaling rule {rule!r}")


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


def write_trace(path: Path, sizes: list[int]) -> None:
    """The batch of every step so far as a CSV `step,batchsize` (steps from 1), which load_trace reads back;
    written atomically (a reader, or a run resumed after a crash, never sees half a file)."""
    rows = "".join(f"{step},{batch}\n" for step, batch in enumerate(sizes, start=1))
    files.write_text(path, "step,batchsize\n" + rows)


def next_batch(noise_scale: float, batch: int, unit: int, ceiling: int) -> int:
    """--batch-trace auto's rule, at an epoch's start: the global batch grows to the measured gradient noise scale
    (McCandlish et al.'s critical batch, where a step costs about twice the fewest samples and takes about twice
    the fewest steps), rounded down to a multiple of `unit` (the micro-batch x the processes), when that is larger
    than `batch`: at most twice `batch` at a time, at most `ceiling`, never smaller (a noisy estimate does not
    shrink it back)."""
    if not math.isfinite(noise_scale) or noise_scale <= batch:
        return batch
    target = min(noise_scale, 2 * batch, ceiling)
    return max(batch, int(target // unit) * unit)


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
