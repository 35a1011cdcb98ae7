"""What measuring the gradient noise scale costs per step (training/noise.py): the built-in task trained end to end
by run.py with the measurement (the default) and with `--no-noise-scale`, alternating in one run, in the two ways
it is measured: 2 processes (DDP: hooks on the parameters read each rank's gradient in a measured step's last
backward) and one process with
`--accum-steps 2` (each micro-batch's gradient kept apart). The step time is metrics.csv's epoch_seconds over the
epoch's steps, the first epoch (warm-up) left out; the ratio is measured / not measured, the median over rounds of
each round's ratio (run.py's default: measured on one step in --noise-scale-every). Then, with less noise, the
one-process way in this process: the training loop's epochs (loop.train_one_epoch, the digits 4 times over, one
thread) with the estimator on every step, on every K-th, and without it, alternating. The last line is one JSON
object.

    python bench/noise_scale.py [--rounds 5] [--epochs 4] [--batch-size 32] [--in-process-only] [--every 4]
    python bench/noise_scale.py --parts   # a measured step's extra time, in pairs with plain steps (steadiest)
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddp_tricks import cli, models, plan
from ddp_tricks.cli.flags import NOISE_SCALE_EVERY
from ddp_tricks.data import images, loaders
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training import noise
from ddp_tricks.training.loop import train_one_epoch
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

REPO = Path(__file__).resolve().parent.parent
WAYS = {"2 processes (DDP)": (2, 1), "1 process, --accum-steps 2": (1, 2)}


def epoch_step_seconds(args, processes: int, accum_steps: int, measured: bool, runs: Path, name: str) -> float:
    """The median seconds per optimizer step of a run's epochs after the first."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    flags = ["-e", str(args.epochs), "-b", str(args.batch_size), "--accum-steps", str(accum_steps), "--no-progress",
             "-n", name, "--runs-dir", str(runs)]  # fmt: skip
    if not measured:
        flags.append("--no-noise-scale")
    done = subprocess.run([*launch, str(REPO / "run.py"), *flags], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the run {name} failed:\n{done.stderr[-2000:]}")
    with open(runs / name / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(b["step"]) - int(a["step"]) for a, b in zip(rows, rows[1:])]
    return statistics.median(float(r["epoch_seconds"]) / s for r, s in zip(rows[1:], steps))


def in_process(rounds: int, batch_size: int, every: int) -> dict:
    """The training loop's step time with the estimator (one process, 2 micro-batches a step) over without it: measured
    on every step, and on every `every`-th (--noise-scale-every)."""
    torch.set_num_threads(1)
    digits, _ = images.digits()
    train_set = loaders.InMemoryDataset(digits.inputs.repeat(4, 1, 1, 1), digits.targets.repeat(4))
    the_plan = plan.make(num_train=len(train_set), world_size=1, micro_batch=batch_size, accum_steps=2, epochs=1,
                         seed=0, base_lr=0.01, lr_scaling="keep", base_batch=2 * batch_size,
                         warmup_epochs=0)  # fmt: skip
    flags, task_class = cli.parse([])
    cpu = torch.device("cpu")

    def training(measured: int) -> Training:  # measured: on every K-th step (0: not measured)
        torch.manual_seed(0)
        model = models.build("toy", 1, 10, "default")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        estimator = noise.NoiseScale(cpu, every=measured) if measured else None
        parts = noise.MicroBatches(estimator, list(model.parameters())) if measured else None
        return Training(model, optimizer, Schedule(WarmupDecay(optimizer, 0, 0)), task_class(flags), ["acc"],
                        Precision("off", cpu), cpu, noise=estimator, noise_parts=parts)  # fmt: skip

    loader = loaders.train_loader(train_set, 0, cpu, seed=0)
    steps = the_plan.epoch(1, 0)
    runs = {k: training(k) for k in (0, 1, every)}
    seconds = {k: [] for k in runs}
    cpu = {k: [] for k in runs}  # this thread's CPU time: the loop runs on one thread, so what another process
    # takes from the machine changes it less than the wall time
    for r in range(rounds + 1):  # the first round warms up
        for measured in list(runs) if r % 2 else list(runs)[::-1]:
            loader.batch_sampler.start(steps)
            start, own = time.perf_counter(), time.thread_time()
            train_one_epoch(runs[measured], steps, loader)
            seconds[measured].append(time.perf_counter() - start)
            cpu[measured].append(time.thread_time() - own)
    result = {"step_ms_not_measured": 1e3 * statistics.median(seconds[0][1:]) / len(steps)}
    for k, name in ((1, "every_step"), (every, f"every_{every}")):
        ratios = [a / b for a, b in zip(seconds[k][1:], seconds[0][1:])]
        cpu_ratios = [a / b for a, b in zip(cpu[k][1:], cpu[0][1:])]
        result[name] = {
            "ratio_median": statistics.median(ratios),
            "ratios": sorted(round(x, 4) for x in ratios),
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "cpu_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(cpu_ratios, n=4)[::2]],
            "step_ms_measured": 1e3 * statistics.median(seconds[k][1:]) / len(steps),
        }
    return result


def parts(every: int, batch_size: int) -> dict:
    """A measured training step the DDP way (the parameters' hooks reading the rank's gradient in its backward, the
    rank's small batch closed, the step's squared norm and the estimate into the averages) against a step without
    them, of the toy model (forward, backward, SGD), one thread, in pairs (plain, then measured) 3000 times: the
    median of the pairs' differences, which a busy machine moves least, over the median plain step. The share of a
    step, measured on every step and on every `every`-th (the other steps run exactly as without it)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.build("toy", 1, 10, "default")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    inputs, targets = torch.randn(batch_size, 1, 8, 8), torch.randint(0, 10, (batch_size,))
    criterion = torch.nn.CrossEntropyLoss()
    params = list(model.parameters())
    estimator = noise.NoiseScale(torch.device("cpu"))
    reader = noise.RankGradient(estimator, params)

    def step(measured: bool) -> float:
        start = time.perf_counter()
        loss = criterion(model(inputs), targets)
        if measured:
            reader.before_backward(last=True)
        loss.backward()
        if measured:
            reader.after_backward(1.0, batch_size, 1.0)
            noise.measure(estimator, params, 2 * batch_size, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    plain, extra = [], []
    for _ in range(3300):
        plain.append(step(False))
        extra.append(step(True) - plain[-1])
    plain_s, noise_s = statistics.median(plain[300:]), statistics.median(extra[300:])  # after 300 pairs' warm-up
    return {"step_ms": 1e3 * plain_s, "noise_us": 1e6 * noise_s, "every_step": noise_s / plain_s,
            f"every_{every}": noise_s / plain_s / every}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--in-process-only", action="store_true", help="only the in-process measurement (quick)")
    parser.add_argument("--every", type=int, default=NOISE_SCALE_EVERY,
                        help="in process: also measured on every K-th step (default: run.py's)")  # fmt: skip
    parser.add_argument("--parts", action="store_true", help="only a measured step's extra time, in pairs of steps")
    args = parser.parse_args()
    if args.parts:
        found = parts(args.every, args.batch_size)
        print(f"a step {found['step_ms']:.3f} ms, a measured step's noise-scale work {found['noise_us']:.1f} us: "
              f"{found['every_step']:.2%} of a step measured every step, {found[f'every_{args.every}']:.2%} on one "
              f"step in {args.every}")  # fmt: skip
        print(json.dumps(found))
        return
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way, (processes, accum_steps) in {} if args.in_process_only else WAYS.items():
            ratios, on, off = [], [], []
            for r in range(args.rounds):  # alternating, so a change in the machine's load falls on both
                on.append(epoch_step_seconds(args, processes, accum_steps, True, Path(tmp), f"on{processes}{r}"))
                off.append(epoch_step_seconds(args, processes, accum_steps, False, Path(tmp), f"off{processes}{r}"))
                ratios.append(on[-1] / off[-1])
            result[way] = {
                "ratio_median": statistics.median(ratios),
                "ratios": [round(x, 4) for x in ratios],
                "step_ms_measured": 1e3 * statistics.median(on),
                "step_ms_not_measured": 1e3 * statistics.median(off),
            }
            print(f"{way}: noise scale measured / not measured, per step: {result[way]['ratio_median']:.3f} "
                  f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}; {result[way]['step_ms_measured']:.2f} ms vs "
                  f"{result[way]['step_ms_not_measured']:.2f} ms)")  # fmt: skip
    way = "1 process, --accum-steps 2, in this process"
    result[way] = in_process(3 * args.rounds, args.batch_size // 2, args.every)
    for name, row in result[way].items():
        if name.startswith("every"):
            print(f"{way}, measured {name.replace('_', ' ')}: measured / not measured, per step: "
                  f"{row['ratio_median']:.3f} (rounds {row['ratios'][0]:.3f} to {row['ratios'][-1]:.3f}; "
                  f"{row['step_ms_measured']:.2f} ms vs {result[way]['step_ms_not_measured']:.2f} ms); CPU time of "
                  f"the loop's thread {row['cpu_ratio_median']:.3f} (quartiles {row['cpu_ratio_quartiles'][0]:.3f}-"
                  f"{row['cpu_ratio_quartiles'][1]:.3f})")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
