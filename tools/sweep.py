"""Batch-size sweep: run.py as real torchrun jobs over global batch sizes x optimizers (or recipe files) x seeds,
one after another, resumable (finished cells are skipped), with results.md (mean +- spread over the seeds, the
original LARS project's table shape), accuracy_vs_batch.png and every cell's curves on one figure.

    python tools/sweep.py --batch-sizes 32 256 --optimizers sgd lars --epochs 1 --out DIR [-- run.py flags]
    python tools/sweep.py --config recipes/mnist-lars.toml --batch-sizes 64 512 --optimizers lars --out DIR
    python tools/sweep.py --recipes recipes/mnist-large-batch-*.toml --batch-sizes 64 8000 --seeds 1 2 3 --out DIR

Each optimizer has its LR at --ref-batch-size (--base-lr sgd=0.05 lars=2.0) and its scaling rule with the
global batch (--lr-scaling sgd=linear lars=sqrt). `--config FILE.toml` gives every cell run.py's flags from a
file; the sweep's own flags for each cell (optimizer, batch, LR, scaling, epochs, warmup) and those after `--`
override it. `--recipes A.toml B.toml` instead gives each file a table of its own (and a line of the figure), as
--optimizers does each optimizer: the file says everything (optimizer, LR and its scaling rule, schedule, epochs);
the sweep sets only the global batch (split evenly over --nproc processes), the seed, and --epochs /
--warmup-epochs when given. Cells: DIR/cells/<optimizer or recipe name>-b<batch>[-s<seed>]/ (run folders). Every
cell's flags are checked before the first cell starts.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ddp_tricks import cli, plots
from ddp_tricks.storage import run_folder

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3, "lars": 2.0, "lamb": 1e-2, "muon": 3e-3}
DEFAULT_SCALING = {"sgd": "linear", "adam": "sqrt", "adamw": "sqrt", "lars": "sqrt", "lamb": "sqrt", "muon": "sqrt"}
OPTIMIZER_FLAGS = {"lars": ["--bn-bias-separately"], "lamb": ["--bn-bias-separately"]}


def pairs(values: list[str], default: dict) -> dict:
    """['sgd=0.1', 'lars=3'] -> {'sgd': '0.1', 'lars': '3'} over the defaults."""
    result = {k: str(v) for k, v in default.items()}
    for item in values:
        name, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"error: expected OPTIMIZER=VALUE, got {item!r}")
        result[name] = value
    return result


def default_warmup(epochs: int) -> float:
    """2 warmup epochs, or half the run when that is shorter (run.py refuses a warmup longer than the run)."""
    return min(2.0, epochs / 2)


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(error(?: on rank \d+)?: .*)$")


def split_error(stderr: str) -> tuple[str | None, str]:
    """run.py's own `error: ...` line out of a cell's stderr (torchrun adds its report around it), and the rest."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        match = ERROR_LINE.match(line)
        if match:
            return match.group(1), "\n".join(lines[:i] + lines[i + 1 :])
    return None, stderr


def cell_finished(run_dir: Path, epochs: int) -> bool:
    metrics = run_dir / "metrics.csv"
    if not metrics.exists():
        return False
    with open(metrics, newline="") as f:
        return len(list(csv.DictReader(f))) >= epochs or (run_dir / "curves.png").exists()


def variants(args) -> list[tuple[str, list[str]]]:
    """(label, run.py flags that do not depend on the batch or seed): one per optimizer, or one per recipe file."""
    timing = [*(["--epochs", str(args.epochs)] if args.epochs else []),
              *(["--warmup-epochs", str(args.warmup_epochs)] if args.warmup_epochs is not None else [])]  # fmt: skip
    if args.recipes:
        return [(Path(f).stem, ["--config", str(Path(f).resolve()), *timing]) for f in args.recipes]
    lrs, scalings = pairs(args.base_lr, DEFAULT_LR), pairs(args.lr_scaling, DEFAULT_SCALING)
    from_file = ["--config", str(Path(args.config).resolve())] if args.config else []
    result = []
    for optimizer in args.optimizers:
        scaling = scalings[optimizer]  # run.py refuses --base-batch-size where `keep` would ignore it
        reference = [] if scaling == "keep" else ["--base-batch-size", str(args.ref_batch_size)]
        result.append((optimizer, [*from_file, "--optimizer", optimizer, "--base-lr", lrs[optimizer],
                                   "--lr-scaling", scaling, *reference, *timing,
                                   *OPTIMIZER_FLAGS.get(optimizer, [])]))  # fmt: skip
    return result


def cell_name(label: str, batch: int, seed: int | None, lr: float | None = None) -> str:
    """The cell's folder: its line, batch, LR (a point of --lr-grid: the base LR it was given) and seed."""
    return f"{label}-b{batch}" + (f"-lr{lr:g}" if lr else "") + (f"-s{seed}" if seed is not None else "")


def best_of_grid(grid: dict[float | None, dict], better: str) -> tuple[float | None, dict]:
    """The grid point (LR multiplier) whose runs' mean final value is best, and its over_seeds() dict, which also
    lists every point's (LR, mean final value) under "grid" (one point without a grid: nothing listed)."""
    if len(grid) == 1:
        (only,) = grid
        return only, grid[only] | {"grid": []}
    pick = max if better == "max" else min
    best = pick(grid, key=lambda m: grid[m]["value"])
    listed = [(grid[m]["lr"], grid[m]["value"], m == best) for m in sorted(grid, key=lambda m: grid[m]["lr"])]
    return best, grid[best] | {"grid": listed}


def cell_flags(
    args, label: str, flags: list[str], batch: int, seed: int | None, extra: list[str], lr: float | None = None
) -> list[str]:
    """run.py's flags for one cell (`lr`: its point of the LR grid, the base LR it is given)."""
    return [
        *flags, "--batch-size", str(batch // args.nproc), *(["--seed", str(seed)] if seed is not None else []),
        "-n", cell_name(label, batch, seed, lr), "--runs-dir", str(Path(args.out) / "cells"), "--no-progress",
        "--resume", "auto", *extra, *(["--base-lr", f"{lr:g}"] if lr else []),
    ]  # fmt: skip


def run_cell(args, name: str, flags: list[str], epochs: int) -> Path:
    run_dir = Path(args.out) / "cells" / name
    if cell_finished(run_dir, epochs):
        print(f"{name}: finished before, skipped")
        return run_dir
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(REPO / "run.py"), *flags,
    ]  # fmt: skip
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        error, rest = split_error(result.stderr)
        if error:  # run.py's own sentence first, then torchrun's report for whoever needs it
            print(error, file=sys.stderr)
        print("\n".join(rest.splitlines()[-40:]), file=sys.stderr)
        raise SystemExit(f"error: cell {name} failed (exit {result.returncode}); fix it and run the sweep again")
    if run_dir.is_dir():  # the whole cell, start-up and evaluation included: what a sweep's length is made of
        (run_dir / "sweep_wall_seconds.txt").write_text(f"{time.perf_counter() - started:.1f}\n")
    return run_dir


def to_target(rows: list[dict], values: list[float], target: float | None, better: str) -> tuple[int, int] | None:
    """(optimizer steps, training samples) up to the end of the first epoch whose value reaches `target` (None: no
    epoch does, or no target). An epoch's samples: its steps times its mean global batch (metrics.csv)."""
    if target is None:
        return None
    samples, step = 0.0, 0
    for row, value in zip(rows, values):
        samples += (row["step"] - step) * row["global_batch"]
        step = int(row["step"])
        if (value >= target) if better == "max" else (value <= target):
            return step, round(samples)
    return None


def summarise(run_dir: Path, metric: dict, target: float | None = None) -> dict:
    """One cell's numbers: its global batch and LR, the headline metric (`run_folder.headline`) after the last
    epoch and at its best epoch, in the metric's unit, the steps and samples to reach `target` (in that unit), and
    its time."""
    rows = plots.read_metrics(run_dir)
    config = run_folder.read_config(run_dir)
    wall = run_dir / "sweep_wall_seconds.txt"
    values = [metric["scale"] * r[metric["column"]] for r in rows]
    return {
        "to_target": to_target(rows, values, target, metric["better"]),
        "batch": config["global_batch_size"],
        "lr": config["effective_lr"],
        "value": values[-1],
        "best": max(values) if metric["better"] == "max" else min(values),
        "seconds": sum(r["epoch_seconds"] for r in rows),
        "wall": float(wall.read_text()) if wall.exists() else 0.0,
    }


def over_seeds(cells: list[dict]) -> dict:
    """One table cell from a batch size's runs (one per seed): mean, sample standard deviation, min and max of
    the final value; mean of the best epochs; mean time to train."""
    values = [c["value"] for c in cells]
    reached = [c["to_target"] for c in cells if c.get("to_target")]
    return {
        "reached": len(reached),
        "steps_to_target": statistics.fmean(r[0] for r in reached) if reached else None,
        "samples_to_target": statistics.fmean(r[1] for r in reached) if reached else None,
        "batch": cells[0]["batch"],
        "lr": cells[0]["lr"],
        "runs": len(cells),
        "value": statistics.fmean(values),
        "value_std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "value_min": min(values),
        "value_max": max(values),
        "best": statistics.fmean(c["best"] for c in cells),
        "seconds": statistics.fmean(c["seconds"] for c in cells),
        "wall": sum(c["wall"] for c in cells),
    }


def write_results(
    out: Path, results: dict[str, list[dict]], command: str, metric: dict, target: float | None = None
) -> None:
    """results: label -> one over_seeds() dict per batch size, smallest batch first; `metric`: what they hold
    (`run_folder.headline`); `target`: the value whose steps and samples to reach the tables give."""
    smallest = min(c["batch"] for cells in results.values() for c in cells)
    at_smallest = [c["value"] for cells in results.values() for c in cells if c["batch"] == smallest]
    reference = max(at_smallest) if metric["better"] == "max" else min(at_smallest)
    wall = sum(c["wall"] for cells in results.values() for c in cells)
    unit = f" {metric['unit']}" if metric["unit"] else ""
    gap = " pt" if metric["unit"] == "%" else ""
    lines = ["# Batch-size sweep", "", f"Regenerate: `{command}`", ""]
    reach = f" steps to {target:g}{unit} | samples to {target:g}{unit} |" if target is not None else ""
    gridded = any(c.get("grid") for cells in results.values() for c in cells)
    for label, cells in results.items():
        lines += [
            f"## {label}",
            "",
            f"| Batch | Base LR | {metric['title']}, final | vs best batch-{smallest} | best epoch |{reach} time to "
            "train | runs |" + (" LR grid: final value at each LR |" if gridded else ""),
            "| --- | --- | --- | --- | --- |"
            + " --- | --- |" * (target is not None)
            + " --- | --- |"
            + " --- |" * gridded,
        ]
        for c in cells:
            spread = ""
            if c["runs"] > 1:
                spread = f" ± {c['value_std']:.2f} ({c['value_min']:.2f}–{c['value_max']:.2f})"
            reached = ""
            if target is not None:
                of = f" ({c['reached']} of {c['runs']} runs)" if c["reached"] < c["runs"] else ""
                if c["reached"]:
                    reached = f" {c['steps_to_target']:,.0f}{of} | {c['samples_to_target']:,.0f}{of} |"
                else:
                    reached = " not reached | not reached |"
            lines.append(
                f"| {c['batch']} | {c['lr']:.4g} | {c['value']:.2f}{unit}{spread} | {c['value'] - reference:+.2f}{gap} "
                f"| {c['best']:.2f}{unit} |{reached} {c['seconds']:.1f} s | {c['runs']} |"
                + (
                    " "
                    + ", ".join(
                        f"{'**' if b else ''}{lr:.3g}: {v:.2f}{'**' if b else ''}" for lr, v, b in c.get("grid", [])
                    )
                    + " |"
                    if gridded
                    else ""
                )  # fmt: skip
            )
        lines.append("")
    lines += [
        (
            "LR grid: each line's LR times each --lr-grid factor, run at every batch (and seed); the table gives the "
            "LR whose mean final value is best (in bold in the grid column). "
            if gridded
            else ""
        )
        + f"Base LR: the LR after scaling for that batch. {metric['title']}, final: the validation value after the "
        "last epoch, the mean over the runs (one per seed) ± their sample standard deviation (min–max). vs best "
        f"batch-{smallest}: the difference from the best mean at the smallest batch ({reference:.2f}{unit}). best "
        f"epoch: {metric['title']} at each run's best epoch, the mean over the runs. Time to train: the mean sum "
        "of the epochs' training times, "
        "without start-up or evaluation."
        + (
            f" Steps / samples to {target:g}{unit}: up to the end of the first epoch whose validation value reaches "
            "it, the mean over the runs that reach it. A cell with --batch-trace auto: Batch is its start batch."
            if target is not None
            else ""
        ),
        "",
        f"Wall time of the cells, start-up and evaluation included: {wall / 60:.1f} min"
        + (
            " (cells run before this version of the sweep are not counted)"
            if any(c["wall"] == 0 for cells in results.values() for c in cells)
            else ""
        ),  # fmt: skip
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", required=True, help="global batch sizes")
    parser.add_argument(
        "--optimizers", nargs="+", default=["sgd", "lars"], help="one table per optimizer (default: sgd lars)"
    )
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per cell (default: 10, or what each recipe says)")  # fmt: skip
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="warmup of every cell (default: 2, or half of --epochs when that is shorter; or what each recipe says)",
    )
    parser.add_argument(
        "--ref-batch-size", type=int, default=32, help="the batch each --base-lr is given for (default: 32)"
    )
    given = " ".join(f"{k}={v}" for k, v in DEFAULT_LR.items())
    parser.add_argument(
        "--base-lr", nargs="*", default=[], metavar="OPT=LR", help=f"LR per optimizer (default: {given})"
    )
    rules = " ".join(f"{k}={v}" for k, v in DEFAULT_SCALING.items())
    parser.add_argument(
        "--lr-scaling", nargs="*", default=[], metavar="OPT=RULE", help=f"LR rule with the batch (default: {rules})"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run each cell once per seed; mean ± spread (default: run.py's seed, once)")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2, help="processes per cell (default: 2)")
    parser.add_argument("--out", required=True, help="the sweep folder")
    parser.add_argument("--config", default=None, metavar="FILE.toml", help="run.py flags for every cell")
    parser.add_argument("--metric", default=None, metavar="NAME",
                        help="the validation metric of the tables (default: the runs' monitored metric, or the "
                             "task's first reported one where they monitor the loss)")  # fmt: skip
    parser.add_argument("--lr-grid", type=float, nargs="+", default=None, metavar="FACTOR",
                        help="run every cell at its LR times each FACTOR (e.g. 0.25 0.5 1 2) and tabulate the best, "
                             "with the grid beside it: each line at its own tuned LR")  # fmt: skip
    parser.add_argument("--target", type=float, default=None, metavar="VALUE",
                        help="also tabulate the optimizer steps and samples until the metric first reaches VALUE "
                             "(in the tables' unit, e.g. 98 for 98 %%)")  # fmt: skip
    parser.add_argument("--recipes", nargs="+", default=None, metavar="FILE.toml",
                        help="one table (and one line of the figure) per file, which says everything but the batch and "
                             "the seed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.recipes and (args.config or args.base_lr or args.lr_scaling or "--optimizers" in argv):
        print("error: --recipes files give each line's optimizer and LR: drop --optimizers, --config, --base-lr "
              "and --lr-scaling, or drop --recipes", file=sys.stderr)  # fmt: skip
        return 2
    if not args.recipes:
        args.epochs = args.epochs or 10
        if args.warmup_epochs is None:
            args.warmup_epochs = default_warmup(args.epochs)
    if args.epochs and args.warmup_epochs is not None and args.warmup_epochs > args.epochs:
        print(f"error: --warmup-epochs {args.warmup_epochs} exceeds --epochs {args.epochs}", file=sys.stderr)
        return 2
    bad = [b for b in args.batch_sizes if b % args.nproc]
    if bad:
        print(f"error: batch sizes {bad} do not divide by --nproc {args.nproc}", file=sys.stderr)
        return 2
    seeds = args.seeds or [None]
    cells = []  # (label, batch, LR factor, seed, name, flags, epochs)
    for label, flags in variants(args):
        for batch in sorted(args.batch_sizes):
            for times in args.lr_grid or [None]:
                for seed in seeds:  # a mistake in any cell's flags, before the first cell starts and writes
                    name = cell_name(label, batch, seed)
                    full = cell_flags(args, label, flags, batch, seed, extra)
                    try:
                        cfg, _ = cli.parse(full)
                        if times:  # the line's LR (its own flag, recipe or run.py's default) times the factor
                            lr = float(f"{cfg.base_lr * times:.6g}")
                            name = cell_name(label, batch, seed, lr)
                            full = cell_flags(args, label, flags, batch, seed, extra, lr)
                            cfg, _ = cli.parse(full)
                    except cli.UserError as error:
                        print(f"error: cell {name}: {error}", file=sys.stderr)
                        return 2
                    cells.append((label, batch, times, seed, name, full, cfg.epochs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[tuple[str, int, float | None], list[dict]] = {}
    run_dirs: dict[tuple[str, int, float | None], Path] = {}  # the first seed's run of each cell, for the curves
    metric = None
    for label, batch, times, _seed, name, flags, epochs in cells:
        run_dir = run_cell(args, name, flags, epochs)
        run_dirs.setdefault((label, batch, times), run_dir)
        if metric is None:
            try:
                metric = run_folder.headline(run_folder.read_config(run_dir), args.metric)
            except ValueError as error:
                print(f"error: --metric: {error}", file=sys.stderr)
                return 2
        runs.setdefault((label, batch, times), []).append(summarise(run_dir, metric, args.target))
    grids: dict[tuple[str, int], dict] = {}
    for (label, batch, times), cell_runs in runs.items():
        grids.setdefault((label, batch), {})[times] = over_seeds(cell_runs)
    results: dict[str, list[dict]] = {}
    shown = []
    for (label, batch), grid in grids.items():
        times, cell = best_of_grid(grid, metric["better"])
        results.setdefault(label, []).append(cell)
        shown.append(run_dirs[(label, batch, times)])
    command = "python tools/sweep.py " + " ".join(argv + (["--", *extra] if extra else []))
    write_results(out, results, command, metric, args.target)
    plots.accuracy_vs_batch(results, out / "accuracy_vs_batch.png", metric)
    plots.overlay(shown, out / "curves.png", metric)
    print(f"results: {out / 'results.md'}, {out / 'accuracy_vs_batch.png'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
