"""The epoch's meter: this rank's running sums by name (the loss x units, the task's metric sums, units, samples), fed
one micro-batch at a time on the device and reduced once; and `Packed`, named tensors in one vector for one
collective, read back by name (no caller splits a reduced vector by position).
"""

from __future__ import annotations

import math

import torch

from ddp_tricks.distributed.collectives import gather_to_host
from ddp_tricks.errors import UserError
from ddp_tricks.training.metric_states import Layout


class Packed:
    """Named tensors and host numbers flattened into one float64 vector on `device`, in the order given (the numbers
    copied to the device as one tensor: one copy from the host); `named(values)` cuts a vector of that layout (a
    reduced one, a gathered row) back into {name: list of floats}. The layout depends on the sizes alone, so every
    rank's is the same whether a value is a tensor on one rank and a number on another."""

    def __init__(self, device: torch.device, **parts):
        numbers, pieces, self.slices, at = [], [], {}, 0
        for name, value in parts.items():
            if isinstance(value, torch.Tensor):
                pieces.append(value.to(torch.float64).reshape(-1))
                size = pieces[-1].numel()
            else:
                values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
                size = len(values)
                if pieces and isinstance(pieces[-1], list):  # numbers in a row: one slice of the numbers' tensor
                    pieces[-1][1] += size
                else:
                    pieces.append([len(numbers), size])  # a slice of the numbers' one tensor, cut below
                numbers.extend(values)
            self.slices[name] = (at, size)
            at += size
        if numbers:
            host = torch.tensor(numbers, dtype=torch.float64, device=device)
            pieces = [p if isinstance(p, torch.Tensor) else host[p[0] : p[0] + p[1]] for p in pieces]
        self.vector = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64, device=device)

    def named(self, values) -> dict[str, list[float]]:
        values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        return {name: values[at : at + size] for name, (at, size) in self.slices.items()}


class EpochMeter:
    """This rank's running sums of the epoch: `sums` = [loss x units, *the task's metric sums, flat] (float64, on the
    device), `units` (the task's units(): a device tensor, or a number when units are samples), `samples`; and the
    steps whose units were 0 on every rank (`empty_steps`, said at the next check). A checkpoint part: mid-epoch it
    holds every rank's sums, which continue at any world size (their total on rank 0, zero on the others)."""

    def __init__(self, layout: Layout, device: torch.device, rank: int = 0, world_size: int = 1):
        self.layout = layout  # the task's metric sums, after the loss
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.sums: torch.Tensor | None = None  # None: no epoch started
        self.units: float | torch.Tensor = 0.0
        self.samples = 0
        self.samples_at_start = 0  # a resumed epoch's samples before this process
        self.empty_steps: int | torch.Tensor = 0
        self.step_units: torch.Tensor | None = None  # the step's units over every rank (units())
        self.open = False  # an epoch is under way: a checkpoint keeps its sums
        self.last_units_per_sample = 1.0  # a checkpoint's, between epochs: what units_per_sample says before a step
        self._resumed: torch.Tensor | None = None  # a checkpoint's row for this rank, until the epoch starts

    @property
    def width(self) -> int:
        """The elements of `sums`: the loss, then the task's metric sums."""
        return self.layout.width + 1

    def start(self, resumed: bool = False) -> None:
        """An epoch starts: from zero, or (`resumed`) from the checkpoint's sums that load_state_dict() kept."""
        row = self._resumed if resumed and self._resumed is not None else None
        self._resumed = None
        if row is None:
            row = torch.zeros(self.width + 2, dtype=torch.float64)
        row = row.cpu()
        self.sums = row[: self.width].to(self.device, copy=True)
        self._loss, self._metrics = self.sums[0], self._views(self.sums)
        self.units = float(row[self.width])
        self.samples = self.samples_at_start = int(row[self.width + 1])
        self.open = True

    def _views(self, sums: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Each metric sum's place in `sums`, as a view of its shape: a micro-batch's adds there in place."""
        views, at = [], 1
        for name, shape in self.layout.sums:
            size = math.prod(shape)
            views.append((name, sums[at : at + size].view(shape)))
            at += size
        return views

    def add(self, loss: torch.Tensor, metric_sums: dict, units, samples: int) -> None:
        """A micro-batch's mean loss (over its `units`: a number, or a device tensor), the task's metric sums (device
        tensors, by name) and its samples: added in place into the float64 sums, one operation each (no row built,
        no host sync)."""
        loss = loss.reshape(()) if loss.dim() else loss  # a loss of shape (1,)
        if isinstance(units, torch.Tensor):
            self._loss.add_(loss * units)
        else:
            self._loss.add_(loss, alpha=units)
        for name, view in self._metrics:
            value = metric_sums[name]
            # a sum of another shape is reshaped to the layout's (a view: no copy), never broadcast into it: a
            # wrong number of elements raises
            view.add_(value if value.shape == view.shape else value.reshape(view.shape))
        self.units += units
        self.samples += samples

    def count_empty(self, step_units: torch.Tensor) -> None:
        """The step's units over every rank (all-reduced): a step with none is said at the next check."""
        self.step_units = step_units
        self.empty_steps += step_units == 0

    def close(self) -> None:
        """The epoch is done: its sums are no longer a checkpoint's."""
        self.open = False

    def packed(self, **more) -> Packed:
        """The sums, units and samples by name (then `more`), in one vector for one collective."""
        return Packed(self.device, sums=self.sums, units=self.units, samples=float(self.samples), **more)

    @property
    def loss_finite(self) -> torch.Tensor:
        """Whether this rank's epoch loss is finite (a device bool: no sync)."""
        return torch.isfinite(self.sums[0])

    @property
    def units_per_sample(self) -> float:
        """This rank's units per sample in the epoch so far, or the last one's (a checkpoint's, after a resume between
        epochs); 1 for a task that counts samples. A host read of a device count: never in a step."""
        return float(self.units) / self.samples if self.samples else self.last_units_per_sample

    def check_units(self, epoch: int, empty: float | None = None) -> None:
        """A step whose micro-batches held no unit on any rank (units() gave 0 everywhere) trains on nothing: a user
        error, on every rank together (the count was all-reduced). A host read, unless `empty` is the count read
        already (a step row's)."""
        if empty is None:
            empty = self.empty_steps.item() if isinstance(self.empty_steps, torch.Tensor) else self.empty_steps
        if empty > 0:
            raise UserError(
                f"{int(empty)} optimizer step(s) so far in epoch {epoch} held no units: the "
                "task's units() gave 0 for every micro-batch of the step on every rank; every step needs at least one "
                "unit (a real token, pixel or sample): check units() and the data"
            )

    def state_dict(self) -> torch.Tensor | dict | None:
        """Mid-epoch, every rank's [sums, units, samples] (a collective: every rank calls); between epochs, this rank's
        units per sample of the epoch done (--batch-trace auto sizes the next epoch's batch by rank 0's); None
        before any."""
        if self.sums is None:
            return None
        if not self.open:
            return {"units_per_sample": self.units_per_sample}
        return gather_to_host(self.packed().vector)

    def load_state_dict(self, state: torch.Tensor | dict | None) -> None:
        """Keep this rank's share of a checkpoint's rows for the resumed epoch's start: its own row at the same world
        size, else their total on rank 0 and zero on the others (sums add up over the ranks of any world size); or,
        between epochs, the units per sample of the epoch done."""
        if isinstance(state, dict):
            self.last_units_per_sample, state = float(state["units_per_sample"]), None
        self._resumed = None if state is None else resume_rows(state, self.rank, self.world_size)


def resume_rows(saved: torch.Tensor, rank: int, world_size: int, mean: bool = False) -> torch.Tensor:
    """This rank's share of a checkpoint's per-rank rows (one per rank that wrote it): its own row at the same world
    size; else running sums (`mean` False) continue from their total on rank 0 and from zero on the others, and
    averages (`mean`) from their mean on every rank."""
    if len(saved) == world_size:
        return saved[rank]
    if mean:
        return saved.mean(0)
    return saved.sum(0) if rank == 0 else torch.zeros_like(saved[0])


def nan_row(device: torch.device) -> torch.Tensor:
    """One NaN: a value a row lacks (no gradient norm measured)."""
    return torch.full((1,), math.nan, dtype=torch.float64, device=device)
