"""Meta-device initialisation (--strategy fsdp): the task's model built on the meta device (no memory, no time),
sharded there, then materialised shard by shard with exactly the weights the plain build on the CPU would give
for the same seed, so that no rank ever holds the whole model.

How, and why not the modules' `reset_parameters`: the build is recorded. While `task.model()` runs on the meta
device, every aten op that makes a tensor or writes into one is kept with its arguments (a `TorchDispatchMode`);
`torch.tensor(data)` keeps its data (the meta device would drop it), and the `nn.init` functions that do nothing on
a meta tensor (trunc_normal_, orthogonal_, dirac_, sparse_) are kept as calls. Materialising replays that record on
the CPU from the random state the build started from: the same ops in the same order on the same generator, so each
parameter comes out bit for bit as the plain build makes it, whatever its modules do (nn.TransformerEncoder deep-
copies one layer, nn.MultiheadAttention initialises its out_proj twice: running each module's reset_parameters
would give other weights). A tensor lives on the CPU only from its last whole overwrite (its first op, where none)
to its last op; then this rank's piece of it is copied into its shard and it is freed; a write that a later one
discards runs on a scratch tensor (its random draws are still made), so a constructor that initialises everything
again at its end holds one tensor at a time. Peak host memory: the shards, plus the few whole tensors in flight.

Where the record cannot stand for the build, the model is built plainly on the CPU and the start line says why,
naming what: an op the meta device cannot run (a value read during the build), tensors made on another device,
random numbers drawn outside the record, lazy modules, a parameter whose initialisation was not seen.

build() replays the record once: the buffers' values, and the random generator left where the plain build leaves it
(what is drawn after the build is the same; a record that does not replay falls back here). Before the process
group, the start-up checks (preflight.py) run on the model as `checkable` makes it: each parameter a zero expanded
to its shape (one element of memory), each buffer with those values.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Ref:
    """A tensor of the record: its storage, the view of it that an op took, and whether that view is all of it."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype", "whole")

    def __init__(self, t: torch.Tensor):
        self.storage, self.offset, self.size, self.stride = _storage(t), t.storage_offset(), t.shape, t.stride()
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


@dataclass
class Recipe:
    """The recorded build: replaying `ops` from the random state `rng` gives the plain build's tensors."""

    ops: list[Op]
    rng: torch.Tensor
    names: dict[int, list[str]] = field(default_factory=dict)  # a storage -> the parameters and buffers it holds
    shapes: dict[str, tuple] = field(default_factory=dict)  # a name -> its size, strides, offset and dtype as built
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the buffers' values, from the first replay

    def replay(self, finish: Callable[[str, torch.Tensor], None], keep=None) -> int:
        """Run the ops on the CPU in order; each parameter or buffer is handed to `finish(name, tensor)` after its
        last op (only those named in `keep`, where given). A tensor is made at its last whole overwrite (or its
        first use, where none) and freed after its last use; an op whose result a later overwrite discards, and that
        nothing reads, runs on a scratch tensor freed at once (its random draws still made): a constructor that
        initialises every module again at its end (`self.apply(init)`) holds one or two tensors at a time. The
        random generator is left where the plain build leaves it. Returns the most bytes held at once."""
        last, kill, read = self._lifetimes()
        live: dict[int, torch.Tensor] = {}
        pending: dict[int, Ref] = {}  # made without values (torch.empty), not yet needed
        peak = 0
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            for i, op in enumerate(self.ops):
                if op.made and not op.values:
                    pending.update((ref.storage, ref) for ref in op.made)
                    continue
                target = op.written
                scratch = {}
                if target is not None and target.storage in pending and i < kill.get(target.storage, -1):
                    if not read.get(target.storage, False):  # overwritten later, unread before: its values are moot
                        scratch[target.storage] = pending[target.storage].empty()
                for ref in _refs(op):
                    if ref.storage in pending and ref.storage not in scratch and ref not in op.made:
                        live[ref.storage] = pending.pop(ref.storage).empty()
                held = {**live, **scratch}
                args, kwargs = tree_map(functools.partial(_real, live=held), (op.args, op.kwargs))
                made = [t for t in tree_flatten(op.call(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
                if op.made:
                    given = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                    fresh = [t for t in made if _storage(t) not in given]
                    for ref, t in zip(op.made, fresh):
                        if i < kill.get(ref.storage, -1) and not read.get(ref.storage, False):
                            pending[ref.storage] = ref  # overwritten before it is read: its values are not kept
                        else:
                            live[ref.storage] = t
                alive = {_storage(t): t for t in [*held.values(), *made, *live.values()]}
                peak = max(peak, sum(t.untyped_storage().nbytes() for t in alive.values()))
                held = scratch = args = kwargs = made = alive = None  # the scratch tensors go now
                for storage in [s for s in live if last.get(s, -1) <= i]:
                    base = live.pop(storage)
                    for name in self.names.get(storage, ()):
                        if keep is None or name in keep:
                            finish(name, base)
                for storage in [s for s in pending if last.get(s, -1) <= i]:
                    del pending[storage]
        return peak

    def _lifetimes(self) -> tuple[dict[int, int], dict[int, int], dict[int, bool]]:
        """Per storage: the index of its last op; of its last whole overwrite; whether another op reads it before
        that overwrite (a clone of it, a sum over it: then its earlier values matter)."""
        last: dict[int, int] = {}
        kill: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            for ref in _refs(op):
                last[ref.storage] = i
            if op.overwrites:
                kill[op.args[0].storage] = i
        read: dict[int, bool] = {}
        for i, op in enumerate(self.ops):
            target = op.written
            for ref in _refs(op):
                if ref is not target and ref not in op.made and i < kill.get(ref.storage, -1):
                    read[ref.storage] = True
        return last, kill, read


def _refs(op: Op) -> list[Ref]:
    return [x for x in tree_flatten((op.args, op.kwargs))[0] if isinstance(x, Ref)] + op.made


def _real(x, live: dict):
    if isinstance(x, Ref):
        return _as_view(live[x.storage], (x.size, x.stride, x.offset, x.dtype))
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


class _Record(TorchDispatchMode):
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
            if other is not None:
                self.foreign = f"{func.__name__.split('.')[0]} on {other.device}"
            elif any(isinstance(x, torch.Generator) for x in flat) and self.generator is None:
                self.generator = func.__name__.split(".")[0]
        self.kept.extend(made)
        storages = {_storage(t) for t in given}
        fresh = [t for t in made if _storage(t) not in storages]
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
        if len(writes) == 1 and first is not None and not op.made and _storage(writes[0]) == first.storage:
            op.written = first
            op.overwrites = (name in OVERWRITES or op.call in self.inits) and first.whole
        self.ops.append(op)
        self.written |= {_storage(t) for t in writes} | ({r.storage for r in op.made} if op.values else set())

    def call(self, function: Callable, args: tuple, kwargs: dict, made: torch.Tensor | None = None):
        """A call kept whole (an nn.init function that skips meta tensors, or torch.tensor's data)."""
        spec = tree_map(lambda x: Ref(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        if made is not None:
            self.kept.append(made)
        writes = [] if made is not None else [args[0]]  # an init writes its tensor
        self._add(Op(function, spec[0], spec[1], [Ref(made)] if made is not None else []), writes)


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


class _Constants(TorchFunctionMode):
    """torch.tensor(data) on the meta device keeps no data: the record keeps it, made on the CPU."""

    def __init__(self, record: _Record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        data = tree_flatten((args, kwargs))[0]
        if func in CONSTANTS and out.device.type == "meta" and not any(isinstance(x, torch.Tensor) for x in data):
            self.record.paused = True
            try:
                value = func(*args, **{**kwargs, "device": "cpu"})
            finally:
                self.record.paused = False
            self.record.call(value.clone, (), {}, made=out)
        return out


@contextlib.contextmanager
def _watching(record: _Record):
    """While the build runs, the Python calls that the aten ops do not show: nn.init's functions that skip meta
    tensors, under any name they were imported by (recorded as calls), and what sets the CPU's random state
    (torch.manual_seed, set_rng_state: fork_rng's too), which a replay could not repeat (a profile hook; one that
    was there is called too)."""
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
        if callable(previous):
            previous(frame, event, arg)

    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)


def build(make: Callable[[], nn.Module]) -> tuple[nn.Module, Recipe | None, str]:
    """`make()` (the task's model()) on the meta device, recorded: the model, the recipe that materialises it and
    the start line's words. Where the record cannot stand for the plain build: `make()` on the CPU, None, and why."""
    rng = torch.get_rng_state()
    record = _Record()
    try:
        with torch.device("meta"), _watching(record), record, _Constants(record):
            with warnings.catch_warnings():  # torch's words on the meta device (a copy into it is a no-op): ours say
                warnings.filterwarnings("ignore", message=".*meta.*")
                model = make()
    except Exception as error:  # an op without a meta kernel, a value read while building
        why = f"the meta device cannot run the task's model() ({type(error).__name__}: {str(error)[:120]})"
        return _plain(make, rng, why)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    attributes = [
        f"{prefix}.{key}" if prefix else key
        for prefix, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_meta
    ]
    lazy = [name for name, t in tensors if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    where = next((f"{name} on {t.device}" for name, t in tensors if t.device.type != "meta"), record.foreign)
    unset = [name for name, t in tensors if not lazy and _storage(t) not in record.written]
    if lazy:
        return _plain(make, rng, f"lazy modules ({lazy[0]}) take their shapes from the first forward")
    if record.generator is not None:
        why = f"the task's model() draws from a torch.Generator of its own ({record.generator}): a replay would not"
        return _plain(make, rng, why)
    if record.reseeded is not None:
        return _plain(make, rng, f"the task's model() sets the CPU's random state itself ({record.reseeded})")
    if attributes:
        return _plain(
            make,
            rng,
            f"{attributes[0]!r} is a tensor the model holds as a plain attribute, neither parameter nor buffer: no "
            "values on the meta device (register_buffer(name, tensor, persistent=False) makes it a buffer)",
        )
    if where is not None:
        why = f"the task's model() uses tensors off the meta device ({where}: weights loaded, numpy, a device=)"
        return _plain(make, rng, why)
    if not torch.equal(rng, torch.get_rng_state()):
        return _plain(make, rng, "the task's model() sets the CPU's random state itself (torch.manual_seed)")
    if unset:
        return _plain(
            make,
            rng,
            f"{unset[0]!r} gets no values while it is built (left as torch.empty made it: the plain build's values "
            "would be whatever memory held)",
        )
    recipe = Recipe(record.ops, rng)
    for name, t in tensors:
        recipe.names.setdefault(_storage(t), []).append(name)
        recipe.shapes[name] = (t.shape, t.stride(), t.storage_offset(), t.dtype)
    owned = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    try:  # a first replay: the buffers' values, for the checks; the random state left where the plain build leaves it
        recipe.replay(lambda name, t: recipe.buffers.__setitem__(name, _as_view(t, recipe.shapes[name]).clone()), owned)
    except Exception as error:  # an op the record keeps but cannot repeat on the CPU (resize_ of an empty tensor)
        return _plain(make, rng, f"its record does not replay on the CPU ({type(error).__name__}: {str(error)[:120]})")
    return model, recipe, "built on the meta device and materialised per shard (the plain build's initial weights)"


def _plain(make, rng: torch.Tensor, why: str) -> tuple[nn.Module, None, str]:
    torch.set_rng_state(rng)
    return make(), None, f"built whole on the CPU, not on the meta device: {why}"


@contextlib.contextmanager
def checkable(model: nn.Module, recipe: Recipe | None):
    """The meta-device model, for the start-up checks: each parameter a zero expanded to its shape on the CPU, each
    buffer its values from build()'s first replay; back on the meta device after. No recipe (a plain build): the
    model as it is."""
    if recipe is None:
        yield model
        return
    buffers = recipe.buffers
    stand_ins: dict[int, nn.Parameter] = {}
    swapped = []  # (module, its own parameters and buffers as built)
    for prefix, module in model.named_modules(remove_duplicate=False):
        swapped.append((module, dict(module._parameters), dict(module._buffers)))
        for name, p in module._parameters.items():
            if p is not None:
                zero = torch.zeros((), dtype=p.dtype).expand(p.shape)
                module._parameters[name] = stand_ins.setdefault(id(p), nn.Parameter(zero, p.requires_grad))
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = buffers[f"{prefix}.{name}" if prefix else name]
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield model
    finally:
        for module, parameters, built_buffers in swapped:
            module._parameters.update(parameters)
            module._buffers.update(built_buffers)


def _pack(t: torch.Tensor):
    """What autograd keeps for the backward of a check on the stand-in: a zero tensor (a weight made contiguous for
    a matrix product, the activations of zero weights) as its shape alone, so that a backward through the whole
    model holds no more than one layer's tensors at a time."""
    zero = t.numel() > 4096 and not t.is_meta and not t.any()  # the FLOPs' count runs a meta copy in here too
    return (t.shape, t.dtype, t.device) if zero else t


def _unpack(packed):
    return torch.zeros(packed[0], dtype=packed[1], device=packed[2]) if isinstance(packed, tuple) else packed


def _as_view(base: torch.Tensor, layout: tuple) -> torch.Tensor:
    """A view of `base`'s storage (`layout`: size, strides, offset and dtype; a parameter may be a slice of a larger
    tensor, a buffer a view in another dtype: view_as_real of a complex table, .view(torch.int32))."""
    size, stride, offset, dtype = layout
    if dtype == base.dtype:
        return torch.as_strided(base, size, stride, offset)
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset, size, stride)


def materialise(model: nn.Module, recipe: Recipe, device: torch.device) -> None:
    """The sharded meta-device model on `device` (`to_empty`), each parameter's and buffer's piece on this rank
    filled from the replay."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # the same parameter objects, on `device`:
    try:  # a tied one stays one, and what holds them already (FSDP, its 0-d parameters' reduction) keeps them
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    targets = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    filled = set()

    def finish(name: str, base: torch.Tensor):
        whole = _as_view(base, recipe.shapes[name])
        target = targets[name]
        piece, local = (_piece(whole, target), target.to_local()) if hasattr(target, "to_local") else (whole, target)
        if piece.shape != local.shape:
            raise RuntimeError(f"meta init: {name}'s piece {tuple(piece.shape)} for a shard {tuple(local.shape)}")
        local.detach().copy_(piece)
        filled.add(name)

    with torch.random.fork_rng(devices=[]):
        recipe.replay(finish)
    missing = sorted(set(targets) - filled)
    if missing:
        raise RuntimeError(f"meta init: {missing[:3]} not filled by the replay")


def _piece(whole: torch.Tensor, target) -> torch.Tensor:
    """This rank's piece of `whole` as the DTensor `target` places it: for each mesh dimension that shards it,
    torch.chunk's piece at this rank's coordinate (DTensor's and FSDP2's split), empty past the last chunk."""
    piece = whole
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_shard():
            chunks = torch.chunk(piece, target.device_mesh.size(mesh_dim), dim=placement.dim)
            rank = target.device_mesh.get_local_rank(mesh_dim)
            piece = chunks[rank] if rank < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece
