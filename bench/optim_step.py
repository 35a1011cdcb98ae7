"""Optimizer.step() time on the real parameter shapes of torchvision's resnet50 and resnet18, random gradients,
as ratios to torch's own optimizers measured in the same run; the last line is one JSON object.

    python bench/optim_step.py [--threads 1] [--repeats 30] [--device cpu|cuda]

CPU: the median wall time of single steps, as ratios to the faster torch SGD (foreach or per-tensor).
CUDA: CUDA-event time of back-to-back steps after a warm-up. LARS, LARSWrapper(SGD) and Lookahead(SGD) as ratios
to SGD(foreach=True), LAMB to AdamW(fused=True); also each step replayed from a CUDA graph, and the GPU's
device-to-device copy bandwidth beside the bandwidth LARS reaches (the bytes it must read and write per step:
weights twice, gradients once, momentum twice, over its step time). The goal: LARS <= 1.4x SGD(foreach=True).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torchvision

from lamb import LAMB
from lars import LARS, LARSWrapper
from lookahead import Lookahead

LR, MOMENTUM, WD = 0.1, 0.9, 1e-4
LARS_GOAL = 1.4  # LARS step time over SGD(foreach=True), on CUDA
BYTES_PER_LARS_ELEMENT = 5  # reads and writes of one element per step: weight 2, gradient 1, momentum 2


def sgd(ps, foreach=None):
    return torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=foreach)


def cpu_optimizers() -> dict:
    makers = {
        "sgd_foreach": lambda ps: sgd(ps, foreach=True),
        "sgd_per_tensor": lambda ps: sgd(ps, foreach=False),
        "lars": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD),
        "lars_foreach": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
        "lars_per_tensor": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=False),
        "larswrapper_sgd": lambda ps: LARSWrapper(sgd(ps)),
        "larswrapper_adam": lambda ps: LARSWrapper(torch.optim.Adam(ps, lr=1e-3, weight_decay=WD)),
        "lookahead_sgd": lambda ps: Lookahead(sgd(ps)),
        "lookahead_lars": lambda ps: Lookahead(LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)),
    }
    return makers | other_libraries(lamb=False)


def cuda_optimizers() -> dict:
    makers = {
        "sgd_foreach": lambda ps: sgd(ps, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, fused=True),
        "lars": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD),
        "larswrapper_sgd": lambda ps: LARSWrapper(sgd(ps, foreach=True)),
        "lamb": lambda ps: LAMB(ps, lr=1e-3, weight_decay=1e-2),
        "lookahead_sgd": lambda ps: Lookahead(sgd(ps, foreach=True)),
    }
    return makers | other_libraries(lamb=True)


# On CUDA, each one's ratio is to this torch optimizer.
CUDA_BASELINE = {"lamb": "adamw_fused", "timm_lamb": "adamw_fused"}
# Timed again, replayed from a CUDA graph: launch overhead gone, what is left is the GPU's work.
CUDA_GRAPHED = {
    "sgd_foreach": lambda ps: sgd(ps, foreach=True),
    "lars": lambda ps: LARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD),
}


def other_libraries(lamb: bool) -> dict:
    makers = {}
    try:
        from timm.optim import Lars as TimmLars

        makers["timm_lars"] = lambda ps: TimmLars(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    except ImportError:
        print("(timm not installed: pip install -r requirements-bench.txt to time its Lars too)")
    if lamb:
        try:
            from timm.optim import Lamb as TimmLamb

            makers["timm_lamb"] = lambda ps: TimmLamb(ps, lr=1e-3, weight_decay=1e-2)
        except ImportError:
            pass
    try:
        from pytorch_optimizer import LARS as PoLARS

        makers["pytorch_optimizer_lars"] = lambda ps: PoLARS(ps, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    except ImportError:
        print("(pytorch-optimizer not installed: pip install -r requirements-bench.txt to time its LARS too)")
    return makers


def make_params(shapes, device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def cuda_seconds(run, repeats: int, rounds: int = 5) -> float:
    """CUDA: the median over rounds of (CUDA-event time of `repeats` back-to-back calls) / repeats."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(times)


def cuda_step_seconds(make, shapes, device, repeats: int, warmup: int = 10, graphed: bool = False) -> float:
    opt = make(make_params(shapes, device))
    side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    run = opt.step
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        run = graph.replay
    torch.cuda.synchronize()
    return cuda_seconds(run, repeats)


def copy_bandwidth_gbps(device, megabytes: int = 1024) -> float:
    """Device-to-device copy_ of a large tensor: GB/s counting the bytes read and written."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = cuda_seconds(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def interleaved_step_seconds(makers: dict, shapes, device, repeats: int, warmup: int = 5) -> dict[str, float]:
    """CPU: every optimizer steps once per round, the order reversed every other round, so the machine's drift
    (a shared CPU) falls on all of them alike; the median of each one's step times."""
    optimizers = {name: make(make_params(shapes, device)) for name, make in makers.items()}
    times = {name: [] for name in optimizers}
    order = list(optimizers)
    for round_ in range(warmup + repeats):
        for name in order if round_ % 2 else order[::-1]:
            start = time.perf_counter()
            optimizers[name].step()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_cpu(args, device) -> dict:
    summary = {}
    for model_name in ("resnet50", "resnet18"):
        shapes = [p.shape for p in getattr(torchvision.models, model_name)().parameters()]
        times = interleaved_step_seconds(cpu_optimizers(), shapes, device, args.repeats)
        sgd_time = min(times["sgd_foreach"], times["sgd_per_tensor"])
        print(f"\n{model_name} ({len(shapes)} tensors): ratio to the faster torch SGD ({sgd_time * 1e3:.2f} ms)")
        for name, seconds in times.items():
            print(f"  {name:24s} {seconds * 1e3:8.2f} ms  {seconds / sgd_time:5.2f}x")
            summary[f"{name}_vs_sgd_{model_name}"] = round(seconds / sgd_time, 3)
    return summary


def bench_cuda(args, device) -> dict:
    copy_gbps = copy_bandwidth_gbps(device)
    summary = {"device_name": torch.cuda.get_device_name(device), "copy_GBps": round(copy_gbps, 1)}
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (bytes read + written)")
    for model_name in ("resnet50", "resnet18"):
        shapes = [p.shape for p in getattr(torchvision.models, model_name)().parameters()]
        numel = sum(s.numel() for s in shapes)
        times = {
            name: cuda_step_seconds(make, shapes, device, args.repeats) for name, make in cuda_optimizers().items()
        }
        graphed = {
            name: cuda_step_seconds(make, shapes, device, args.repeats, graphed=True)
            for name, make in CUDA_GRAPHED.items()
        }
        print(f"\n{model_name} ({len(shapes)} tensors, {numel / 1e6:.1f}M parameters), CUDA events:")
        for name, seconds in times.items():
            base = CUDA_BASELINE.get(name, "sgd_foreach")
            ratio = seconds / times[base]
            print(f"  {name:24s} {seconds * 1e3:8.3f} ms  {ratio:5.2f}x {base}")
            summary[f"{name}_vs_{base}_{model_name}"] = round(ratio, 3)
        for name, seconds in graphed.items():
            ratio = seconds / graphed["sgd_foreach"]
            print(f"  {name + ' (CUDA graph)':24s} {seconds * 1e3:8.3f} ms  {ratio:5.2f}x sgd_foreach (CUDA graph)")
            summary[f"{name}_graph_vs_sgd_foreach_graph_{model_name}"] = round(ratio, 3)
        # fp32 weights, gradients and momentum: the least any SGD-with-momentum step must move.
        moved = BYTES_PER_LARS_ELEMENT * 4 * numel
        for name in ("lars", "sgd_foreach"):
            gbps = moved / times[name] / 1e9
            summary[f"{name}_GBps_{model_name}"] = round(gbps, 1)
            summary[f"{name}_fraction_of_copy_{model_name}"] = round(gbps / copy_gbps, 3)
            print(f"  {name}: {gbps:.0f} GB/s effective, {100 * gbps / copy_gbps:.0f}% of the copy bandwidth")
    ratio = summary["lars_vs_sgd_foreach_resnet50"]
    summary["lars_goal_met_resnet50"] = ratio <= LARS_GOAL
    verdict = "met" if ratio <= LARS_GOAL else "NOT met"
    print(f"\ngoal LARS <= {LARS_GOAL}x SGD(foreach) on resnet50: {ratio:.2f}x, {verdict}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: 2 threads are too noisy to rank)")
    parser.add_argument("--repeats", type=int, default=30, help="steps timed (CUDA: per round, of 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"error: --device {args.device} asked for, but torch sees no CUDA device; use --device cpu\n")
    torch.set_num_threads(args.threads)
    timing = (
        f"median of {args.repeats} interleaved steps" if device.type == "cpu" else f"{args.repeats} steps x 5 rounds"
    )
    print(f"torch {torch.__version__}, device {device}, {args.threads} thread(s), {timing}")
    summary = bench_cuda(args, device) if device.type == "cuda" else bench_cpu(args, device)
    print(json.dumps({"torch": torch.__version__, "device": str(device)} | summary))


if __name__ == "__main__":
    main()
