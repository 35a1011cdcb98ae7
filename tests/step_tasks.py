"""Task files for the tests of what happens after an optimizer step (the per-step hook, model EMA, parameter groups):
the built-in digits task with one change each, as a user writes them.

    torchrun --standalone --nproc_per_node=2 run.py --task tests/step_tasks.py:Recording -b 8
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from task import Task


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class Recording(Task):
    """Every call of the per-step hook, on every rank, appended to $HOOK_LOG.<rank> as a JSON line (step, progress,
    the model's mode, whether gradients were on). With $HOOK_WEIGHTS (a folder), rank 0 also saves the model's whole
    state there after every step (`step-<k>.pt`) and before the first (`step-0.pt`, the initial weights). With
    $POISON (a training sample's index), that sample's target is -1 and its batch's loss NaN (its gradient too)."""

    def datasets(self):
        train, val = super().datasets()
        if os.environ.get("POISON"):
            train.targets = train.targets.clone()
            train.targets[int(os.environ["POISON"])] = -1
        return train, val

    def model(self):
        model = super().model()
        folder = os.environ.get("HOOK_WEIGHTS")
        if folder and os.environ.get("RANK", "0") == "0":
            Path(folder).mkdir(parents=True, exist_ok=True)
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(folder) / "step-0.pt")
        return model

    def loss(self, outputs, targets):
        bad = targets < 0
        loss = super().loss(outputs, targets.clamp(min=0))
        return loss + torch.where(bad.any(), torch.nan, 0.0)  # NaN only there: a mask's NaN would reach every gradient

    def shard_units(self, model):
        """--strategy fsdp: the head is left to the root, which then holds parameters of its own (FSDP keeps those
        gathered after a forward without backward, such as an evaluation's)."""
        return [model.features]

    def after_step(self, model, step, progress):
        if os.environ.get("HOOK_LOG"):
            line = {"step": step, "progress": progress, "training": model.training, "grad": torch.is_grad_enabled()}
            with open(f"{os.environ['HOOK_LOG']}.{_rank()}", "a") as f:
                f.write(json.dumps(line) + "\n")
        folder = os.environ.get("HOOK_WEIGHTS")
        if folder and _rank() == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(folder) / f"step-{step}.pt")


def hook_calls(log: str | Path, rank: int) -> list[dict]:
    """The hook's calls on `rank`, in order."""
    path = Path(f"{log}.{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Finetune(Task):
    """Fine-tuning's parameter groups: the convolutional body at a tenth of the LR, the head at the LR without
    weight decay."""

    def param_groups(self, model):
        return [
            {"params": model.features.parameters(), "lr_mult": 0.1, "name": "backbone"},
            {"params": model.head.parameters(), "weight_decay": 0.0, "name": "head"},
        ]


class NamedTwice(Task):
    """A mistake: the head's weight in both groups."""

    def param_groups(self, model):
        return [{"params": [model.head.weight, *model.features.parameters()]}, {"params": model.head.parameters()}]
