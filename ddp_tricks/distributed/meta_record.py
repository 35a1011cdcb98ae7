"""The record of a model's build on the meta device (meta_init.py replays it on the CPU): every aten op that makes
a tensor or writes into one, kept with its arguments (a `TorchDispatchMode`); `torch.tensor(data)`'s data (the meta
device would drop it); the `nn.init` functions that do nothing on a meta tensor (trunc_normal_, orthogonal_, dirac_,
sparse_), kept as calls; and what the record cannot stand for: a tensor off the meta device (the record stops
there), a torch.Generator of the task's own, the CPU's random state set while building.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# nn.init functions that return a meta tensor untouched: recorded as calls, replayed by calling them
SKIP_META = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}  # make a tensor, no values
# in-place ops that write every element of their first argument and read none of it
OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "cauchy_",
              "log_normal_", "geometric_"}  # fmt: skip
CONSTANTS = (torch.tensor, torch.as_tensor, torch.asarray)
OFF_META = "the task's model() uses tensors off the meta device ({}: weights loaded from a file, a device=)"


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Ref:
    """A tensor of the record: its storage, the view of it that an op took, and whether that view is all of it."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype", "whole")

    def __init__(self, t: torch.Tensor):
        self.storage, self.offset, self.size, self.stride = storage(t), t.storage_offset(), t.shape, t.stride()
        self.dtype = t.dtype
        self.whole = self.offset == 0 and t.is_contiguous() and t.nbytes == t.untyped_storage().nbytes()

    def empty(self) -> torch.Tensor:
        """A CPU tensor of this view's layout, for the storage it is all of."""
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype)


@dataclass
class Op:
    call: Callable
    args: tuple
    kwargs: dict
    made: list[Ref]  # the tensors this op makes (new storages): none for an op that writes into its arguments
    values: bool = True  # whether what it makes has values (not torch.empty)
    written: Ref | None = None  # the one tensor it writes in place, its first argument (None: none, or others)
    overwrites: bool = False  # it writes all of that tensor's storage, reading none of it (uniform_, fill_)
    writes: tuple = ()  # the storages it writes in place


class Record(TorchDispatchMode):
    """Every aten op that makes a tensor or writes into one, while the build runs on the meta device."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.kept: list[torch.Tensor] = []  # every tensor made, alive to the end: a storage is never reused
        self.written: set[int] = set()  # storages that got values
        self.foreign: str | None = None
        self.paused = False
        self.inits: set = set()  # the nn.init functions recorded as calls: each overwrites its tensor
        self.reseeded: str | None = None  # a call that set the CPU's random state while building
        self.generator: str | None = None  # an op that drew from a torch.Generator of the task's own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        flat = tree_flatten((args, kwargs))[0]
        given = [t for t in flat if isinstance(t, torch.Tensor)]
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.foreign is None:
            other = next((t for t in given + made if t.device.type != "meta"), None)
            if other is not None:  # weights loaded from a file: stopped here, before a second copy is made
                self.foreign = f"{func.__name__.split('.')[0]} on {other.device}"
                raise OffMeta(self.foreign)
            if any(isinstance(x, torch.Generator) for x in flat) and self.generator is None:
                self.generator = func.__name__.split(".")[0]
        self.kept.extend(made)
        storages = {storage(t) for t in given}
        fresh = [t for t in made if storage(t) not in storages]
        writes = _written(func, args, kwargs)
        if writes or fresh:
            name = func._schema.name.split("::")[-1]
            spec = tree_map(lambda x: Ref(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            self._add(Op(func, spec[0], spec[1], [Ref(t) for t in fresh], name not in EMPTY), writes, name)
        return out

    def _add(self, op: Op, writes: list[torch.Tensor], name: str = "") -> None:
        """`op`, which writes `writes` in place: its target where it writes one tensor, its first argument (in-place
        style, not `out=`), and whether it overwrites all of it."""
        first = op.args[0] if op.args and isinstance(op.args[0], Ref) else None
        if len(writes) == 1 and first is not None and not op.made and storage(writes[0]) == first.storage:
            op.written = first
            op.overwrites = (name in OVERWRITES or op.call in self.inits) and first.whole
        op.writes = tuple(storage(t) for t in writes)
        self.ops.append(op)
        self.written |= {storage(t) for t in writes} | ({r.storage for r in op.made} if op.values else set())

    def call(self, function: Callable, args: tuple, kwargs: dict, made: torch.Tensor | None = None):
        """A call kept whole (an nn.init function that skips meta tensors, or torch.tensor's data)."""
        spec = tree_map(lambda x: Ref(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        if made is not None:
            self.kept.append(made)
        writes = [] if made is not None else [args[0]]  # an init writes its tensor
        self._add(Op(function, spec[0], spec[1], [Ref(made)] if made is not None else []), writes)


class OffMeta(BaseException):
    """The build used a tensor off the meta device: the record ends (a BaseException: no task's `except
    Exception` keeps the build going)."""


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op writes in place: its schema's mutable arguments, given by position or by name
    (`out=`), lists of tensors flattened (the _foreach_ ops)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


class Constants(TorchFunctionMode):
    """torch.tensor(data) (and x.new_tensor(data)) on the meta device keeps no data: the record keeps it, made on
    the CPU."""

    def __init__(self, record: Record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        method = func is torch.Tensor.new_tensor and isinstance(out, torch.Tensor)  # args[0]: a tensor, not data
        data = tree_flatten((args[1:] if method else args, kwargs))[0]
        if (
            (func in CONSTANTS or method)
            and out.device.type == "meta"
            and not any(isinstance(x, torch.Tensor) for x in data)
        ):
            self.record.paused = True
            try:
                if method:  # the dtype args[0] gives, the values on the CPU
                    args = (torch.empty(0, dtype=args[0].dtype), *args[1:])
                value = func(*args, **{**kwargs, "device": "cpu"})
            finally:
                self.record.paused = False
            self.record.call(value.clone, (), {}, made=out)
        return out


@contextlib.contextmanager
def watching(record: Record):
    """While the build runs, the Python calls that the aten ops do not show: nn.init's functions that skip meta
    tensors, under any name they were imported by (recorded as calls), and what sets the CPU's random state
    (torch.manual_seed, set_rng_state: fork_rng's too; torch.default_generator's methods), which a replay could not
    repeat (a profile hook; a Python one that was there is called too: build() refuses a profiler of C's)."""
    inits = {getattr(nn.init, name).__code__: getattr(nn.init, name) for name in SKIP_META}
    record.inits = set(inits.values())
    seeds = {f.__code__: f.__name__ for f in (torch.random.manual_seed, torch.random.seed, torch.random.set_rng_state)}
    previous = sys.getprofile()

    def watch(frame, event, arg):
        if event == "call" and not record.paused:
            if frame.f_code in inits:
                function, local = inits[frame.f_code], frame.f_locals
                if isinstance(local.get("tensor"), torch.Tensor) and local["tensor"].is_meta:
                    if local.get("generator") is not None and record.generator is None:
                        record.generator = function.__name__
                    record.call(function, tuple(local[name] for name in inspect.signature(function).parameters), {})
            elif frame.f_code in seeds and record.reseeded is None:
                record.reseeded = f"torch.{seeds[frame.f_code]}"
        elif event == "c_call" and getattr(arg, "__self__", None) is torch.default_generator and not record.paused:
            if arg.__name__ in ("set_state", "manual_seed", "seed") and record.reseeded is None:
                record.reseeded = f"torch.default_generator.{arg.__name__}"  # a C method: no "call" event
        if callable(previous):
            previous(frame, event, arg)

    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
