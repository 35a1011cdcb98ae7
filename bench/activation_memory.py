"""What `--activation-checkpointing` saves and costs: the language-model example's causal transformer at depth 8,
one forward and backward of a batch, with no checkpointing, `full`, `ops` (op-level selective) and `2` (every other
block): the bytes autograd holds for the backward (counted with `torch.autograd.graph.saved_tensors_hooks`, every
tensor saved, the parameters' too), the peak CUDA memory above the model's where there is a GPU, and the step's time
(median of interleaved repeats after a warm-up), each as a ratio to the run without. The last line is one JSON
object.

    python bench/activation_memory.py [--width 256] [--batch 8] [--length 256] [--repeats 5]
    python bench/activation_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples folder
from ddp_tricks import activations  # noqa: E402
from examples.language_model import CausalTransformer  # noqa: E402

MODES = (None, "full", "ops", "2")


def build(mode, width: int, depth: int, length: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = CausalTransformer(width, depth, max(1, width // 64), length)
    if mode:
        activations.apply(model, list(model.blocks.layers), mode)
    return model.to(device)


def step(model, batch, targets, count: bool) -> int:
    """One forward and backward; the bytes held for the backward when `count` (else 0)."""
    held = [0]

    def pack(tensor):
        held[0] += tensor.numel() * tensor.element_size()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else _Nothing()
    with hooks:
        logits, _ = model(batch)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held[0]


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (a.batch, a.length), generator=g).to(device)
    batch = {"tokens": tokens, "mask": torch.ones_like(tokens, dtype=torch.bool)}
    targets = torch.randint(0, 256, (a.batch, a.length), generator=g).to(device)
    models = {mode: build(mode, a.width, a.depth, a.length, device) for mode in MODES}
    held, peak, times = {}, {}, {mode: [] for mode in MODES}
    for mode, model in models.items():
        held[mode] = step(model, batch, targets, count=True)  # also the warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(model, batch, targets, count=False)
            torch.cuda.synchronize()
            peak[mode] = torch.cuda.max_memory_allocated() - base
    for _ in range(a.repeats):  # interleaved: drift in the machine's load falls on every mode alike
        for mode, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, batch, targets, count=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - start)
    result = {"width": a.width, "depth": a.depth, "batch": a.batch, "length": a.length, "device": str(device)}
    for mode in MODES:
        name = mode or "none"
        row = {
            "held_bytes": held[mode],
            "held_ratio": held[mode] / held[None],
            "step_s": statistics.median(times[mode]),
            "time_ratio": statistics.median(times[mode]) / statistics.median(times[None]),
        }
        if peak:
            row |= {"peak_cuda_bytes": peak[mode], "peak_ratio": peak[mode] / peak[None]}
        result[name] = row
        print(
            f"{name:>5}: held for backward {held[mode] / 2**20:8.1f} MiB (x{row['held_ratio']:.3f}), step "
            f"{row['step_s'] * 1e3:7.1f} ms (x{row['time_ratio']:.3f})"
            + (f", peak CUDA {peak[mode] / 2**20:.1f} MiB (x{row['peak_ratio']:.3f})" if peak else "")
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
