"""The uneven-shares reduction's memory (distributed/trace_reduction.py, with the noise scale measured: every step on
uneven shares) against DDP's, one step of the same model and micro-batches in one process (a process group of one:
every all-reduce runs).

The peak of the bytes allocated during a step (forward, backward, reduction), from the profiler's memory events on
the CPU, or torch.cuda.max_memory_allocated on a GPU; weights and inputs, made before, are left out of both. DDP
(gradient_as_bucket_view, as distributed/wrap.py builds it) holds its buckets, and under no_sync() the accumulated
gradients beside them; the manual reduction holds the gradients, one layer's gradient as autograd hands it over, and
one bucket of --bucket-cap-mb. Prints each peak in MiB, the difference in buckets, and the ratio of the peaks; the
last line is one JSON object.

    python bench/reduction_memory.py [--width 1024] [--layers 8] [--micro-batches 3] [--bucket-cap-mb 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_tricks.distributed.trace_reduction import TraceReduction  # noqa: E402
from ddp_tricks.training.noise import NoiseScale  # noqa: E402

MIB = 2**20


def peak_of(prof) -> int:
    """The peak of the bytes allocated while `prof` ran, over what was allocated when it started (its memory events
    carry the CPU allocator's running total)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]  # the allocator's total as the profile started
    return max(m["Total Allocated"] for m in memory) - before


def model_of(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def step(kind: str, width: int, layers: int, micro_batches: int, cap_mb: float, device: torch.device) -> int:
    """One step of `micro_batches` micro-batches under `kind` (ddp, or manual: TraceReduction with the noise scale);
    the peak bytes held meanwhile."""
    model = model_of(width, layers, device)
    inputs = [torch.randn(8, width, device=device) for _ in range(micro_batches)]
    params = list(model.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    watch = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if device.type == "cpu" else None
    with watch if watch is not None else contextlib.nullcontext():
        if kind == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)
            for k, x in enumerate(inputs):
                with wrapped.no_sync() if k < micro_batches - 1 else contextlib.nullcontext():
                    wrapped(x).square().mean().backward()
        else:
            noise = NoiseScale(device)
            reduction = TraceReduction(params, 8, noise=noise, slots=micro_batches, bucket_mb=cap_mb)
            for x in inputs:
                (model(x).square().mean() / micro_batches).backward()
                reduction.after_backward(1.0 / micro_batches)
            reduction.finish(8 * micro_batches)
    if watch is None:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    return peak_of(watch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = sum(p.numel() * p.element_size() for p in model_of(args.width, args.layers, device).parameters())
        shape = (args.width, args.layers, args.micro_batches, args.bucket_cap_mb, device)
        ddp, manual = (step(kind, *shape) for kind in ("ddp", "manual"))
    finally:
        dist.destroy_process_group()
    bucket = args.bucket_cap_mb * MIB
    print(f"gradients {grads / MIB:.1f} MiB, bucket {args.bucket_cap_mb:g} MiB, on {device}")
    print(f"peak held in a step: DDP {ddp / MIB:.1f} MiB, the uneven-shares reduction {manual / MIB:.1f} MiB")
    print(f"the reduction's peak - DDP's: {(manual - ddp) / bucket:.2f} buckets; ratio of the peaks {manual / ddp:.3f}")
    result = {"device": str(device), "gradients_mib": grads / MIB, "bucket_mib": args.bucket_cap_mb}
    result |= {"ddp_peak_mib": ddp / MIB, "manual_peak_mib": manual / MIB, "excess_buckets": (manual - ddp) / bucket}
    print(json.dumps(result | {"ratio": manual / ddp}))


if __name__ == "__main__":
    main()
