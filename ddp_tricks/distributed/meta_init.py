"""Meta-device initialisation (--strategy fsdp): the task's model built on the meta device (no memory, no time),
sharded there, then materialised shard by shard with exactly the weights the plain build on the CPU would give
for the same seed, so that no rank ever holds the whole model.

How, and why not the modules' `reset_parameters`: the build is recorded (meta_record.py). While `task.model()` runs
on the meta device, every aten op that makes a tensor or writes into one is kept with its arguments (a
`TorchDispatchMode`); `torch.tensor(data)` keeps its data (the meta device would drop it), and the `nn.init`
functions that do nothing on a meta tensor (trunc_normal_, orthogonal_, dirac_, sparse_) are kept as calls.
Materialising replays that record on the CPU from the random state the build started from: the same ops in the same
order on the same generator, so each parameter comes out bit for bit as the plain build makes it, whatever its
modules do (nn.TransformerEncoder deep-copies one layer, nn.MultiheadAttention initialises its out_proj twice:
running each module's reset_parameters would give other weights). A tensor lives on the CPU only from its last whole
overwrite (its first op, where none) to its last op; then this rank's piece of it is copied into its shard and it is
freed; a write that a later one discards runs on a scratch tensor (its random draws are still made), so a
constructor that initialises everything again at its end holds one tensor at a time. Peak host memory: the shards,
plus the few whole tensors in flight.

Where the record cannot stand for the build, the model is built plainly on the CPU and the start line says why,
naming what: an op the meta device cannot run (a value read during the build), tensors made on another device
(weights loaded from a file: the record stops at the first such op, and what it held is freed before the plain
build), random numbers drawn outside the record, lazy modules, a parameter whose initialisation was not seen, a
parameter or buffer that follows from an op whose CPU result is laid out otherwise than its meta one (linalg.svd's
Vh; BatchNorm statistics from a channels-last probe forward: Recipe.replay). The plain build starts from the random
states the meta one started from (torch's, Python's, numpy's).

build() replays the record once: the buffers' values, and the random generator left where the plain build leaves it
(what is drawn after the build is the same; a record that does not replay falls back here). Before the process
group, the start-up checks (preflight.py) run on the model as `checkable` makes it: each parameter a zero expanded
to its shape (one element of memory), each buffer with those values; where they fail on zeros, `checked` runs them
again on a constant (weight_norm divides by the weights' norm) before their error is said. The start line gives the
most bytes the replay holds at once.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ddp_tricks.distributed.meta_record import OFF_META, Constants, OffMeta, Op, Record, Ref, watching
from ddp_tricks.distributed.meta_record import storage as _storage

T = TypeVar("T")


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
        random generator is left where the plain build leaves it. Returns the most bytes held at once.

        Where the CPU lays a result out otherwise than the meta device did (linalg.svd's Vh; a convolution of a
        channels-last input), it is copied into the meta layout, so that the record's views read the same elements,
        and what follows from it is marked: the plain build computed it from the other layout (other rounding,
        random numbers in another memory order). A parameter or buffer that follows from one raises: build() falls
        back. A dummy forward that only sizes a layer (its result's shape) stays exact."""
        last, kill, read = self._lifetimes()
        live: dict[int, torch.Tensor] = {}
        pending: dict[int, Ref] = {}  # made without values (torch.empty), not yet needed
        other: dict[int, str] = {}  # a storage that follows from a result laid out otherwise: the op that made it
        peak = 0
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            for i, op in enumerate(self.ops):
                source = next((other[r.storage] for r in _refs(op) if r.storage in other and r not in op.made), None)
                if source is not None:  # what it writes or makes follows from the other layout too
                    undeclared = op.args[3:5] if "native_batch_norm" in str(op.call) else ()  # running statistics
                    written = [*op.writes, *(r.storage for r in (*op.made, *undeclared) if isinstance(r, Ref))]
                    other.update((storage, source) for storage in written if storage not in other)
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
                        if (t.shape, t.stride(), t.storage_offset()) != (ref.size, ref.stride, ref.offset):
                            layouts = f"strides {t.stride()} on the CPU, {ref.stride} on the meta device"
                            t = ref.empty().copy_(t)  # the record's views of it read the same elements
                            other.setdefault(ref.storage, f"{op.call.__name__} ({layouts})")
                        if i < kill.get(ref.storage, -1) and not read.get(ref.storage, False):
                            pending[ref.storage] = ref  # overwritten before it is read: its values are not kept
                        else:
                            live[ref.storage] = t
                alive = {_storage(t): t for t in [*held.values(), *made, *live.values()]}
                peak = max(peak, sum(t.untyped_storage().nbytes() for t in alive.values()))
                held = scratch = args = kwargs = made = alive = None  # the scratch tensors go now
                for storage in [s for s in live if last.get(s, -1) <= i]:
                    base = live.pop(storage)
                    if storage in other and self.names.get(storage):
                        raise RuntimeError(
                            f"{self.names[storage][0]!r} follows from a result the CPU lays out otherwise: "
                            f"{other[storage]}"
                        )
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
                if ref is not target and ref not in op.made and i <= kill.get(ref.storage, -1):
                    read[ref.storage] = True  # at the overwrite itself too: w.fill_(w[0]) reads w first
        return last, kill, read


def _refs(op: Op) -> list[Ref]:
    return [x for x in tree_flatten((op.args, op.kwargs))[0] if isinstance(x, Ref)] + op.made


def _real(x, live: dict):
    if isinstance(x, Ref):
        return _as_view(live[x.storage], (x.size, x.stride, x.offset, x.dtype))
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def build(make: Callable[[], nn.Module]) -> tuple[nn.Module, Recipe | None, str]:
    """`make()` (the task's model()) on the meta device, recorded: the model, the recipe that materialises it and
    the start line's words. Where the record cannot stand for the plain build: `make()` on the CPU, None, and why."""
    states = _random_states()
    if sys.getprofile() is not None and not callable(sys.getprofile()):
        return plain(make, states, "a profiler holds the profile hook (cProfile's): nn.init unseen")
    recorded = _recorded(make, states[0])  # what the try held (a file's weights) is freed by here
    return recorded if not isinstance(recorded, str) else plain(make, states, recorded)


def _random_states() -> tuple:
    """What a build draws from: torch's CPU random state, Python's and numpy's."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_random_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _recorded(make, rng: torch.Tensor) -> tuple[nn.Module, Recipe, str] | str:
    """build()'s model, recipe and words, or why the record cannot stand for the plain build."""
    record = Record()
    try:
        with torch.device("meta"), watching(record), record, Constants(record):
            with warnings.catch_warnings():  # torch's words on the meta device (a copy into it is a no-op): ours say
                warnings.filterwarnings("ignore", message=".*meta.*")
                model = make()
    except OffMeta:
        return OFF_META.format(record.foreign)
    except Exception as error:  # an op without a meta kernel, a value read while building
        return f"the meta device cannot run the task's model() ({type(error).__name__}: {str(error)[:120]})"
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    owned = {id(t) for _, t in tensors}
    attributes = [  # meta tensors held otherwise: directly, or in a list, tuple or dict
        f"{prefix}.{key}" if prefix else key
        for prefix, module in model.named_modules()
        for key, value in vars(module).items()
        if key not in ("_parameters", "_buffers", "_modules")
        and any(isinstance(t, torch.Tensor) and t.is_meta and id(t) not in owned for t in tree_flatten(value)[0])
    ]
    lazy = [name for name, t in tensors if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    unset = [name for name, t in tensors if not lazy and _storage(t) not in record.written]
    where = next((f"{name} on {t.device}" for name, t in tensors if t.device.type != "meta"), None)
    if lazy:
        return f"lazy modules ({lazy[0]}) take their shapes from the first forward"
    if record.generator is not None:
        return f"the task's model() draws from a torch.Generator of its own ({record.generator}): a replay would not"
    if record.reseeded is not None:
        return f"the task's model() sets the CPU's random state itself ({record.reseeded})"
    if attributes:
        return (
            f"{attributes[0]!r} holds a tensor as a plain attribute, neither parameter nor buffer: no values on the "
            "meta device (register_buffer(name, tensor, persistent=False) makes it a buffer)"
        )
    if where is not None:
        return OFF_META.format(where)
    if not torch.equal(rng, torch.get_rng_state()):
        return "the task's model() sets the CPU's random state itself (torch.manual_seed)"
    if unset:
        return (
            f"{unset[0]!r} gets no values while it is built (left as torch.empty made it: the plain build's values "
            "would be whatever memory held)"
        )
    recipe = Recipe(record.ops, rng)
    for name, t in tensors:
        recipe.names.setdefault(_storage(t), []).append(name)
        recipe.shapes[name] = (t.shape, t.stride(), t.storage_offset(), t.dtype)
    owned = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    try:  # a first replay: the buffers' values, for the checks; the random state left where the plain build leaves it
        peak = recipe.replay(lambda n, t: recipe.buffers.__setitem__(n, _as_view(t, recipe.shapes[n]).clone()), owned)
    except Exception as error:  # an op the record keeps but cannot repeat on the CPU (resize_ of an empty tensor)
        return f"its record does not replay on the CPU ({type(error).__name__}: {str(error)[:200]})"
    words = "built on the meta device and materialised per shard (the plain build's initial weights; the replay"
    return model, recipe, f"{words} holds {peak / 2**20:.1f} MiB at most)"


def plain(make, states: tuple, why: str) -> tuple[nn.Module, None, str]:
    """`make()` on the CPU from the random states the meta build started from (`states`: torch's, Python's,
    numpy's): the plain build, said with `why`."""
    _set_random_states(states)
    return make(), None, f"built whole on the CPU, not on the meta device: {why}"


def checked(model: nn.Module, recipe: Recipe | None, check: Callable[[nn.Module], T]) -> T:
    """`check(model)` (the start-up checks) on the meta-device model's stand-in of zeros; where they fail there,
    once more on a stand-in of a constant 0.01, from the same random states, before their error is said: zeros are
    no model's weights (weight_norm divides by their norm: 0/0; a Normal of scale 0 raises). A mistake in the flags
    is then found twice: the error path alone pays. A plain build (no recipe): `check(model)`."""
    if recipe is None:
        return check(model)
    states = _random_states()
    try:
        with checkable(model, recipe):
            return check(model)
    except Exception:  # a check's one line, or the model's own error on zeros (Normal(0, scale) with scale 0)
        _set_random_states(states)
    with checkable(model, recipe, value=0.01):
        return check(model)


@contextlib.contextmanager
def checkable(model: nn.Module, recipe: Recipe | None, value: float = 0.0):
    """The meta-device model, for the start-up checks: each parameter `value` (a zero) expanded to its shape on the
    CPU, each buffer its values from build()'s first replay; back on the meta device after, as built (a buffer that a
    forward registered goes). No recipe (a plain build): the model as it is."""
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
                constant = torch.full((), value, dtype=p.dtype).expand(p.shape)
                module._parameters[name] = stand_ins.setdefault(id(p), nn.Parameter(constant, p.requires_grad))
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = buffers[f"{prefix}.{name}" if prefix else name]
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield model
    finally:
        for module, parameters, built_buffers in swapped:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(built_buffers)


def _pack(t: torch.Tensor):
    """What autograd keeps for the backward of a check on the stand-in: a tensor of one value (a weight made
    contiguous for a matrix product, activations of constant weights) as its shape and value alone, so that a
    backward through the whole model holds no more than one layer's tensors at a time."""
    if t.numel() <= 4096 or t.is_meta or t.layout != torch.strided or t.is_nested:  # the FLOPs' meta copy; sparse
        return t
    first = t[(0,) * t.dim()]
    same = t.eq(first)
    if first.isnan():  # weight_norm's 0/0 on zeros: NaN everywhere
        same = t.isnan()
    return (t.shape, first.clone()) if same.all() else t


def _unpack(packed):
    return packed[1].expand(packed[0]).contiguous() if isinstance(packed, tuple) else packed


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
    recipe.ops.clear()  # done with: the record, and the buffers' second copy
    recipe.buffers.clear()
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
