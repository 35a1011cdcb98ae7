"""Draw a run in phases: phase 1, then phase-2 runs placed after it (one started from it with --init-from, one from
scratch beside it): validation loss against tokens, per-step training loss and LR against the global step.

python tools/plot_phases.py runs/phase1 runs/phase2 runs/phase2-scratch ... [-o runs/phases.png] [--start DIR]

--start DIR: an `--eval-only --init-from runs/phase1` run with phase 2's flags (its eval.csv): phase 1's weights on
phase 2's validation set, the point phase 2 starts from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_tricks import plots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", help="the first phase's run folder")
    parser.add_argument("after", nargs="+", help="run folders drawn after it (phase 2, from it and from scratch)")
    parser.add_argument("-o", "--output", default="runs/phases.png", help="the figure to write")
    parser.add_argument("--start", default=None, help="an --eval-only --init-from run folder: where phase 2 starts")
    args = parser.parse_args(argv)
    runs = [args.first, *args.after]
    missing = [d for d in runs if not all((Path(d) / f).is_file() for f in ("metrics.csv", "steps.csv", "config.json"))]
    if missing:
        print(
            f"error: no metrics.csv, steps.csv and config.json in {', '.join(missing)}: give run folders written by "
            "run.py with steps.csv rows (--log-interval above 0)",
            file=sys.stderr,
        )
        return 2
    if args.start is not None and not (Path(args.start) / "eval.csv").is_file():
        print(f"error: --start {args.start}: no eval.csv: give the folder of a run.py --eval-only run", file=sys.stderr)
        return 2
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    print(plots.phases(args.first, args.after, args.output, args.start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
