"""Sharded checkpoints (`--strategy fsdp`) with torch.distributed.checkpoint: every rank writes the slices of the
parameters and optimizer state it holds, rank 0 writes the rest (counters, schedule, RNG, buffers) as `state.pt`,
and `last.dcp` is a link that moves to a checkpoint only once it is whole: a kill mid-write leaves the previous one.
A checkpoint written by N processes loads on M: DCP cuts the saved slices to the new shards.

    runs/<name>/last.dcp -> sharded/step-000120-3/   (.metadata, __0_0.distcp, ..., state.pt)
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_tricks.distributed import fsdp
from ddp_tricks.errors import UserError
from ddp_tricks.shards import is_dtensor
from ddp_tricks.storage.files import save as save_file

LINK = "last.dcp"
FOLDER = "sharded"
STATE = "state.pt"  # what rank 0 writes: the state with each sharded tensor replaced by a placeholder


def _split(value, key: str, sharded: dict):
    """`value` with each DTensor replaced by {"__sharded__": key, shape, dtype}, the DTensors put in `sharded`."""
    if is_dtensor(value):
        sharded[key] = value
        return {"__sharded__": key, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _split(v, f"{key}/{k}", sharded) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, f"{key}/{i}", sharded) for i, v in enumerate(value))
    return value


def _join(value, loaded: dict):
    if isinstance(value, dict):
        if "__sharded__" in value:
            return loaded[value["__sharded__"]]
        return {k: _join(v, loaded) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_join(v, loaded) for v in value)
    return value


def _placeholders(value) -> list[dict]:
    if isinstance(value, dict):
        return [value] if "__sharded__" in value else [p for v in value.values() for p in _placeholders(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _placeholders(v)]
    return []


def save(state: dict, run_dir: Path, name: str, is_main: bool) -> Path:
    """Write `state` as the checkpoint sharded/<name>/ (a collective: every rank calls it), then point last.dcp
    at it and remove the one before. Returns the checkpoint's folder."""
    import torch.distributed.checkpoint as dcp

    run_dir = Path(run_dir)
    target = run_dir / FOLDER / name
    if is_main:
        target.mkdir(parents=True)
    dist.barrier()
    sharded: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "state", sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sharded, checkpoint_id=str(target))
    if is_main:
        save_file(skeleton, target / STATE)
        # Every rank's shard files and .metadata are fsynced by dcp.save (its FileSystemWriter's sync_files), and
        # state.pt by save_file; the folders' entries too, before the link names the checkpoint.
        _fsync_folder(target)
        _fsync_folder(target.parent)
        link = run_dir / LINK
        temporary = run_dir / f".{LINK}.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(Path(FOLDER) / name)
        os.replace(temporary, link)  # atomic: last.dcp names the old checkpoint or the new one, whole
        _fsync_folder(run_dir)
        for old in (run_dir / FOLDER).iterdir():  # the one before, and any a kill left half-written
            if old.resolve() != target.resolve():
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return target


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | Path) -> dict:
    """A sharded checkpoint's state.pt (every rank reads it), its sharded tensors still placeholders. A folder
    that is not a whole checkpoint is a UserError naming it."""
    path = Path(path)
    if not (path / STATE).is_file() or not (path / ".metadata").is_file():
        raise UserError(
            f"checkpoint {str(path)!r} is not a whole sharded checkpoint (no state.pt or .metadata): it was not "
            "written to the end; resume from another one or start without --resume"
        )
    try:
        from torch.distributed.checkpoint import FileSystemReader

        files = {info.relative_path for info in FileSystemReader(str(path)).read_metadata().storage_data.values()}
    except Exception:
        raise UserError(f"checkpoint {str(path)!r} has a damaged .metadata; resume from another checkpoint") from None
    missing = sorted(name for name in files if not (path / name).is_file())
    if missing:
        raise UserError(
            f"checkpoint {str(path)!r} misses {len(missing)} of its shard files ({', '.join(missing)}): it is not "
            "whole; resume from another checkpoint or start without --resume"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception:
        raise UserError(f"checkpoint {str(path)!r} has a damaged state.pt; resume from another checkpoint") from None


def model_shapes(state: dict) -> dict[str, tuple]:
    """Every model entry's shape, from a read() state: placeholders say theirs."""
    shapes = {}
    for key, value in state["model"].items():
        shapes[key] = tuple(value["shape"]) if isinstance(value, dict) else tuple(value.shape)
    return shapes


def fill(state: dict, path: str | Path, model: torch.nn.Module) -> dict:
    """The sharded tensors of a read() state, loaded into slices of this run's shards (a collective). The model's
    entries load into the model's own parameters; the optimizer's get new tensors laid like the parameters, on the
    mesh `fsdp.shard` sharded the model on. A missing or damaged file is a UserError naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.tensor import empty

    live = model.state_dict()
    targets = {}
    mesh = fsdp.mesh_of(model)
    for holder in _placeholders(state):
        key = holder["__sharded__"]
        name = key.removeprefix("state/model/")
        if key.startswith("state/model/") and name in live:
            targets[key] = live[name]
        else:
            dtype = getattr(torch, holder["dtype"])
            targets[key] = empty(holder["shape"], dtype=dtype, device_mesh=mesh.device_mesh, placements=mesh.placements)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(targets, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
        raise UserError(
            f"checkpoint {str(path)!r} cannot be read whole ({reason}): a file of it is missing or damaged; resume "
            "from another checkpoint or start without --resume"
        ) from None
    return _join(state, targets)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights, gathered on rank 0 (a collective; the other ranks get an empty dict): a plain
    state dict that `torch.load(weights_only=True)` reads into the unwrapped model outside the template."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
