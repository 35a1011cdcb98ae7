"""FLOPs measured, not assumed: one forward and backward of a training batch under torch's FlopCounterMode, on a
meta-device copy of the model (no memory, no time; real tensors where the meta device cannot run it), and the peak
TFLOP/s of the device the run trains on, by its name and the training dtype, for the model FLOPs utilisation (MFU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from ddp_tricks.data.loaders import batch_of
from ddp_tricks.training.batches import float_outputs
from ddp_tricks.training.seam import gradient_kinds

# dense peak TFLOP/s by device name and dtype (the vendors' data sheets; no sparsity); the longest name a device's
# name contains is taken, so "H100 PCIe" before "H100" (SXM)
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}


@dataclass
class Flops:
    """A training step's FLOPs per sample (forward + backward), per unit where the task counts units, and how they
    were counted ("meta": on a meta-device copy; "real": on real tensors, where the meta device could not run;
    "none": neither could, 0 FLOPs)."""

    per_sample: float
    per_unit: float
    counted_on: str
    note: str = ""

    def describe(self) -> str:
        """The start line's part: `FLOPs per sample 3.2 MFLOP (forward + backward, counted on the meta device)`."""
        if self.counted_on == "none":
            return f"FLOPs not counted ({self.note}): no TFLOP/s or MFU in the rows"
        counted = self.per_unit != self.per_sample
        unit = f", {self.per_unit / 1e6:.4g} MFLOP per unit of the task's units()" if counted else ""
        where = "the meta device" if self.counted_on == "meta" else f"real tensors ({self.note})"
        return f"FLOPs per sample {self.per_sample / 1e6:.4g} MFLOP{unit} (forward + backward, counted on {where})"


def count(model: nn.Module, loss, inputs, targets) -> int:
    """The FLOPs of `loss(model(inputs), targets)` and its backward, as FlopCounterMode counts them; each gradient
    dropped as it comes (none is read)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a frozen one gets no gradient
    with FlopCounterMode(display=False) as counter:
        outputs = model(inputs)
        gradient_kinds(loss(float_outputs(outputs), targets), trained)  # the backward, each gradient dropped
    return counter.get_total_flops()


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device, made without copying a tensor's data (a model on the meta device's
    stand-in, meta_init.checkable, has parameters of one element expanded: a copy would make them whole)."""
    memo: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters share the model's memory (a count never writes them; its buffers, which a
    forward may update, are copied): no second copy of the weights, nor of a stand-in's whole."""
    memo = {id(p): nn.Parameter(p.detach(), p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def measure(task, model: nn.Module, inputs, targets, samples: int) -> Flops:
    """FLOPs per sample (and per unit) of one training step of `task` on `model` with the batch (`inputs`, `targets`,
    `samples` samples), counted on a meta-device copy of the model; on a real copy on the CPU where the meta device
    cannot run the model or the loss (said in `note`). The model itself is left as it was."""
    units_of = getattr(task, "units", None)
    units = float(units_of(inputs, targets)) if units_of is not None else float(samples)
    kept = dict(vars(task))  # a loss may set the task's attributes (a statistic moved to the outputs' device)
    try:
        try:
            on_meta = meta_copy(model).train()
            flops = count(on_meta, task.loss, *(to(part, "meta") for part in (inputs, targets)))
            return Flops(flops / samples, flops / max(units, 1.0), "meta")
        except Exception as error:  # an op without a meta kernel, a loss that reads values
            note = f"the meta device could not run it: {type(error).__name__}"
        vars(task).clear()
        vars(task).update(kept)
        try:
            flops = count(sharing_copy(model).train(), task.loss, inputs, targets)
        except Exception as error:  # counted nowhere: the rows give no FLOPs, the run goes on
            return Flops(0.0, 0.0, "none", f"{note}, nor real tensors: {type(error).__name__}")
        return Flops(flops / samples, flops / max(units, 1.0), "real", note)
    finally:
        vars(task).clear()
        vars(task).update(kept)


def of_task(task, model: nn.Module, dataset, collate, samples: int) -> Flops:
    """`measure` on the first `samples` training samples, batched as the loader batches them."""
    inputs, targets = batch_of(dataset, list(range(min(samples, len(dataset)))), collate)
    state = torch.get_rng_state()
    try:
        return measure(task, model, inputs, targets, min(samples, len(dataset)))
    finally:
        torch.set_rng_state(state)  # the measurement draws nothing the run would have drawn


def to(batch, device: str):
    """A batch of any structure with its tensors moved to `device`."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def training_dtype(amp: str) -> str:
    """The dtype a run's matmuls run in: bf16 or fp16 under autocast; else tf32 where torch allows it, else fp32."""
    if amp in ("bf16", "fp16"):
        return amp
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_tflops(device: torch.device, amp: str, given: float = 0.0) -> tuple[float, str]:
    """The device's peak TFLOP/s for the run's dtype and a note for the start line: `given` (--peak-tflops) when
    set; else the table's entry for a CUDA device whose name it knows; else 0 (no MFU), the note saying why."""
    if given > 0:
        return given, f"peak {given:g} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return 0.0, f"no MFU on {device.type}: give --peak-tflops to measure against a peak"
    name, dtype = torch.cuda.get_device_name(device), training_dtype(amp)
    known = [key for key in PEAK_TFLOPS if key in name]
    if not known:
        return 0.0, f"no MFU: {name!r} is not in the table of peaks; give --peak-tflops"
    peak = PEAK_TFLOPS[max(known, key=len)][dtype]
    return peak, f"MFU against {name}'s {dtype} peak, {peak:g} TFLOP/s"
