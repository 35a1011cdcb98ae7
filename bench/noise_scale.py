"""What measuring the gradient noise scale costs per step (training/noise.py): the built-in task trained end to end
by run.py with the measurement (the default) and with `--no-noise-scale`, alternating in one run, in the two ways
it is measured: 2 processes (DDP: a communication hook reads each rank's gradient) and one process with
`--accum-steps 2` (each micro-batch's gradient kept apart). The step time is metrics.csv's epoch_seconds over the
epoch's steps, the first epoch (warm-up) left out; the ratio is measured / not measured, the median over rounds of
each round's ratio. The last line is one JSON object.

    python bench/noise_scale.py [--rounds 5] [--epochs 4] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way, (processes, accum_steps) in WAYS.items():
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
    print(json.dumps(result))


if __name__ == "__main__":
    main()
