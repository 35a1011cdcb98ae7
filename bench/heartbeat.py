"""What the progress watchdog costs per step: a training step of the built-in toy CNN on 8x8 digits-sized batches,
with the watchdog's thread running as on an observing rank of a 2-rank job (its heartbeat published to a TCPStore
once a second, every rank's read back, the main thread's stack read for the "where" line; the step reported to it
as the loop does) and without it, in paired rounds of about a second each, the order alternating. The ratio of the
mean step with it to the mean step without, from the mean paired difference. The last line is one JSON object.

    python bench/heartbeat.py [--pairs 12] [--round-seconds 1.5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ddp_tricks import models
from ddp_tricks.distributed import heartbeat, watchdog


def steps_for(seconds: float, model, optimizer, batch, report: bool) -> float:
    """Training steps for about `seconds`: the mean seconds per step (`report`: each step told to the watchdog)."""
    inputs, targets = batch
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if report:
            heartbeat.step(done + 1)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done += 1
    return (time.perf_counter() - start) / done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--round-seconds", type=float, default=1.5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = models.build("toy", 1, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = (torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("watchdog/beat/1", json.dumps({"count": 0, "phase": "train", "idle": 0, "slowest": 0, "waits": ""}))
    heartbeat.configure("/nonexistent", 2, heartbeat_timeout=1e9, hang_timeout=1e9)  # never a verdict here
    steps_for(2.0, model, optimizer, batch, report=False)  # warm-up
    on, off = [], []
    for pair in range(args.pairs):
        for watched in (pair % 2 == 0, pair % 2 == 1):
            if watched:
                watchdog.start(dist.PrefixStore("watchdog/", store), 0, world_size=2)
            seconds = steps_for(args.round_seconds, model, optimizer, batch, report=watched)
            if watched:
                watchdog.stop()
            (on if watched else off).append(seconds)
    differences = [a - b for a, b in zip(on, off)]
    mean_off = statistics.mean(off)
    ratio = 1 + statistics.mean(differences) / mean_off
    spread = statistics.stdev(differences) / len(differences) ** 0.5 / mean_off
    print(f"step without the watchdog: {mean_off * 1e3:.3f} ms, with it: {statistics.mean(on) * 1e3:.3f} ms")
    print(f"ratio with / without: {ratio:.4f} (+- {spread:.4f}, one standard error of the mean paired difference)")
    print(json.dumps({"step_ms_off": mean_off * 1e3, "step_ms_on": statistics.mean(on) * 1e3, "ratio": ratio,
                      "ratio_stderr": spread, "pairs": args.pairs}))  # fmt: skip


if __name__ == "__main__":
    main()
