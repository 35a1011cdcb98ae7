"""Overlay several runs (their headline validation metric, loss and LR per epoch) in one figure.

python tools/plot_runs.py runs/a runs/b ... [-o runs/compare.png] [--metric NAME] [--x epoch|step]

The metric is the runs' monitored one (the task's first reported metric where they monitor the loss; see
config.json), or --metric NAME.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_tricks import plots
from ddp_tricks.storage import run_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="run folders, each with a metrics.csv")
    parser.add_argument("-o", "--output", default="runs/compare.png", help="the figure to write")
    parser.add_argument("--metric", default=None, help="the validation metric to draw (default: the monitored one)")
    parser.add_argument("--x", choices=("epoch", "step"), default="epoch",
                        help="the x axis: epochs (samples), or optimizer steps on a log scale")  # fmt: skip
    args = parser.parse_args(argv)
    missing = [d for d in args.run_dirs if not (Path(d) / "metrics.csv").is_file()]
    if missing:
        print(f"error: no metrics.csv in {', '.join(missing)}: give run folders written by run.py", file=sys.stderr)
        return 2
    try:
        metric = run_folder.headline(run_folder.read_config(args.run_dirs[0]), args.metric)
    except (OSError, ValueError) as error:
        print(f"error: {error}: give run folders written by run.py (with config.json)", file=sys.stderr)
        return 2
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    print(plots.overlay(args.run_dirs, args.output, metric, by=args.x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
