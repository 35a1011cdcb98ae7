"""Checkpoints: when they are written (`Checkpoints`: after every epoch, every K steps, on an agreed SIGTERM), as a
file (last.pt, best.pt; atomic, files.py) or sharded (last.dcp, sharded.py), safe loads (`weights_only=True`),
and which checkpoint `--resume` means. What one holds is the training state's `state_dict()` (training/state.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ddp_tricks.distributed import heartbeat
from ddp_tricks.errors import UserError
from ddp_tricks.storage import sharded
from ddp_tricks.storage.files import save

LAST = {"ddp": "last.pt", "fsdp": sharded.LINK}  # a run's latest checkpoint, by --strategy


def preempted(where: str, strategy: str, t=None) -> str:
    """The lines a run stopped by SIGTERM ends with (`where`: "at epoch E, step S", or "after epoch E"), and the
    steps the training state `t` took in this process."""
    line = f"preempted {where}: {LAST[strategy]} written; continue with --resume auto"
    return line if t is None else f"{line}\n{t.describe_steps()}"


def load(path: str | Path, strategy: str = "ddp", resumable: bool = True, evaluation: bool = False) -> dict[str, Any]:
    """Read a checkpoint without running any code from it: a last.pt/best.pt file (--strategy ddp), or a sharded
    checkpoint's folder (fsdp; its sharded tensors still placeholders, see sharded.fill). A bad file, or one of
    the other strategy, is a UserError naming it. `resumable=False`: the weights are all that is wanted.
    `evaluation` (--eval-only): a sharded run's best.pt (its whole weights, EMA and task state) too, any strategy."""
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").exists() and not (path / sharded.STATE).exists():  # any folder is not one
            raise UserError(_not_a_checkpoint(path))
        if strategy != "fsdp":
            raise UserError(
                f"checkpoint {str(path)!r} is sharded (written by --strategy fsdp): resume it with --strategy fsdp"
            )
        return sharded.read(path)
    if not path.is_file():
        raise UserError(
            f"checkpoint {str(path)!r} does not exist: give the path of a last.pt/best.pt, or --resume auto"
        )
    not_ours = f"checkpoint {str(path)!r} is not a checkpoint written by this project"
    fix = "pick another file or start without --resume"
    try:
        with warnings.catch_warnings():  # torch warns about what it then refuses: the one line below says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # empty, truncated, random bytes, pickled code or classes: torch's text is no help here
        raise UserError(f"{not_ours} (or is corrupt); {fix}") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UserError(f"{not_ours} (it has no model/epoch entries); {fix}")
    if state.get("strategy") == "fsdp" and "optimizer" not in state and evaluation:  # a sharded run's best.pt
        return state
    if resumable and state.get("strategy") == "fsdp" and "optimizer" not in state:
        raise UserError(
            f"checkpoint {str(path)!r} holds the model's weights only (a sharded run's best.pt): load them into "
            f"the model with torch.load(..., weights_only=True)['model'], or resume from the run's {sharded.LINK}"
        )
    if resumable and strategy == "fsdp":
        raise UserError(
            f"checkpoint {str(path)!r} holds a whole state written by --strategy ddp; --strategy fsdp resumes a "
            f"sharded checkpoint (runs/<name>/{sharded.LINK}): resume this one with --strategy ddp"
        )
    return state


def _not_a_checkpoint(folder: Path) -> str:
    """What a folder given to --resume lacks, and the path it was probably meant to be (a run folder's checkpoint)."""
    what = f"checkpoint {str(folder)!r} is a folder without .metadata or {sharded.STATE}, not a checkpoint"
    if (folder / LAST["ddp"]).is_file():
        return f"{what}: it looks like a run folder; resume from {str(folder / LAST['ddp'])!r}"
    if (folder / LAST["fsdp"]).exists():
        sharded_last = str(folder / LAST["fsdp"])
        return f"{what}: it looks like a sharded run's folder; resume from {sharded_last!r} with --strategy fsdp"
    return (
        f"{what}: give the path of a last.pt/best.pt, a run's {LAST['fsdp']} with --strategy fsdp, or --resume auto "
        "with --name RUN"
    )


def resume_path(resume: str | None, run_dir: str | Path, strategy: str = "ddp") -> Path | None:
    """`--resume auto` means the run's last checkpoint when it exists (last.pt; sharded: last.dcp); a PATH is
    taken as given."""
    if resume is None:
        return None
    if resume == "auto":
        ours, theirs = LAST[strategy], LAST["fsdp" if strategy == "ddp" else "ddp"]
        last, other = Path(run_dir) / ours, Path(run_dir) / theirs
        if last.is_symlink() and not last.exists():
            raise UserError(
                f"{str(last)!r} points to {str(last.readlink())!r}, which is gone: the run's checkpoint was moved "
                "or deleted; restore it, or start over with --overwrite"
            )
        if not last.exists() and other.exists():
            raise UserError(
                f"{str(other)!r} was written by --strategy {'fsdp' if strategy == 'ddp' else 'ddp'}: resume that "
                f"run with the strategy it was trained with"
            )
        return last.resolve() if last.exists() else None
    return Path(resume)


def check_left(state: dict, resume: str, run_dir: str | Path, epochs: int, max_steps: int = 0) -> None:
    """A resume that would train nothing and yet close an epoch or fill a new folder, as a UserError naming the two
    ways on: a checkpoint past --max-steps, or one from another run's folder (`--resume PATH -n NEW`) whose epochs
    are all done. (Resumed into its own folder, a finished run just ends.)"""
    step, new = state["global_step"], f"start a new run from its weights with --init-from {resume}"
    if max_steps and step > max_steps:
        raise UserError(
            f"--resume {resume}: its run is at global step {step}, past --max-steps {max_steps}: nothing is left to "
            f"train; give --max-steps above {step} to continue it, or {new}"
        )
    if resume in (None, "auto") or state.get("step_in_epoch") or state["epoch"] < epochs:
        return
    if Path(run_dir).resolve() in Path(resume).resolve().parents:
        return
    length = f"--max-steps {max_steps} ends" if max_steps else f"this run is {epochs} epoch(s) long"
    more = f"--max-steps above {step}" if max_steps else f"--epochs above {state['epoch']}"
    raise UserError(
        f"--resume {resume}: its run has done {state['epoch']} epoch(s), and {length}: nothing is left to train into "
        f"{str(run_dir)!r}; give {more} to continue it, or {new}"
    )


def restore_model(model: torch.nn.Module, state: dict, source: str) -> None:
    """The checkpoint's weights into the model (before it is wrapped), or for a sharded checkpoint, its shapes
    held against the model's: weights of another model are a UserError before any process group."""
    try:
        if any(isinstance(v, dict) for v in state["model"].values()):  # sharded: placeholders say the shapes
            mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            if mine != sharded.model_shapes(state):
                raise RuntimeError("shapes")
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as error:
        saved = state.get("config", {}).get("model")
        details = [line.strip().rstrip(".") for line in str(error).splitlines()[1:] if line.strip()]
        first = f" ({details[0][:150]}{' ...' if len(details[0]) > 150 else ''})" if details else ""
        raise UserError(
            f"checkpoint {source!r} holds weights{f' of {saved!r}' if saved else ''} that do not fit this task's "
            f"model{first}; resume with the flags it was trained with"
        ) from None


def holds(t) -> dict[str, str]:
    """What a checkpoint's weights are, in words (its "weights" entry): the model's, and with --model-ema the EMA's,
    and which validation metric picks best.pt (the EMA's `val_ema_*`, or the trained weights')."""
    words = {"model": "the trained weights"}
    if t.ema is not None:
        words["ema"] = t.ema.describe()  # under ["ema"]["weights"]
    whose = "the EMA's weights" if t.best.metric.startswith("val_ema_") else "the trained weights"
    words["best"] = f"best.pt is the epoch with the best {t.best.metric}, that of {whose}"
    return words


class Checkpoints:
    """Where and when a run writes its checkpoint (last.pt; sharded: last.dcp) and best.pt: after every epoch,
    every `every_steps` optimizer steps mid-epoch, and when every rank has agreed to stop after SIGTERM. Every
    rank calls; rank 0 writes a file, every rank its slices of a sharded checkpoint."""

    def __init__(
        self,
        folder: Path,
        is_main: bool,
        every_steps: int,
        preemption,
        config: dict,
        strategy: str = "ddp",
        plan: dict | None = None,
    ):
        self.folder = Path(folder)
        self.plan = plan or {}  # the run's global batch and layout: a resume at another world size keeps the batch
        self.is_main = is_main
        self.every_steps = every_steps
        self.preemption = preemption
        self.strategy = strategy
        self.config = {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool, type(None)))}

    def save(self, t, also_best: bool = False) -> None:
        """The training state `t` into the run's checkpoint (atomically), and best.pt too; never non-finite
        weights over the last good ones. A sharded run's best.pt holds the whole model's weights (and EMA), the task's
        state and the counters: what --eval-only reads, not a resumable state."""
        heartbeat.phase("checkpoint")  # long legitimate work: the watchdog does not take it for a hang
        t.raise_if_nonfinite(check_weights=True)
        meta = {"config": self.config, "torch_version": str(torch.__version__), "strategy": self.strategy}
        meta["plan"] = self.plan
        meta["weights"] = holds(t)
        if self.strategy == "fsdp":
            sharded.save(t.state_dict() | meta, self.folder, self._name(t), self.is_main)
            if also_best:
                weights = sharded.full_weights(t.raw_model)  # a collective: gathered on rank 0
                ema = None if t.ema is None else t.ema.state_dict() | {"weights": t.ema.full_weights()}  # also
                if self.is_main:  # --eval-only reads the header, the EMA and the task's state
                    best = t.state_dict(("best", "task")) | {"model": weights, "ema": ema}
                    save(best | meta, self.folder / "best.pt")
            return
        state = t.state_dict() | meta
        if self.is_main:
            save(state, self.folder / LAST["ddp"])
            if also_best:
                save(state, self.folder / "best.pt")

    def _name(self, t) -> str:
        """A new folder name for a sharded checkpoint, the same on every rank (rank 0's, broadcast)."""
        import torch.distributed as dist

        base, n = f"step-{t.progress.global_step:09d}", 1
        while (self.folder / sharded.FOLDER / f"{base}-{n}").exists():
            n += 1
        chosen = [f"{base}-{n}"]
        dist.broadcast_object_list(chosen, src=0)
        return chosen[0]

    def after_step(self, t) -> bool:
        """After every optimizer step: the mid-epoch checkpoint when due, and the stop every rank agrees on after
        SIGTERM (True: stop now, the checkpoint written)."""
        stop = self.preemption.agreed()
        if stop or (self.every_steps and t.progress.global_step % self.every_steps == 0):
            self.save(t)
        return stop
