"""Batch-size sweep: run.py as real torchrun jobs over global batch sizes x optimizers, one after another,
resumable (finished cells are skipped), with results.md (the original LARS project's table shape),
accuracy_vs_batch.png and every cell's curves on one figure.

    python tools/sweep.py --batch-sizes 32 256 --optimizers sgd lars --epochs 1 --out DIR [-- run.py flags]
    python tools/sweep.py --config recipes/mnist-lars.toml --batch-sizes 64 512 --optimizers lars --out DIR

Each optimizer has its LR at --ref-batch-size (--base-lr sgd=0.05 lars=2.0) and its scaling rule with the
global batch (--lr-scaling sgd=linear lars=sqrt). Cells: DIR/cells/<optimizer>-b<batch>/ (run folders).
`--config FILE.toml` gives every cell run.py's flags from a file; the sweep's own flags for each cell (optimizer,
batch, LR, scaling, epochs, warmup) and those after `--` override it. Every cell's flags are checked before the
first cell starts.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import config  # noqa: E402
import plots  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3, "lars": 2.0, "lamb": 1e-2}
DEFAULT_SCALING = {"sgd": "linear", "adam": "sqrt", "adamw": "sqrt", "lars": "sqrt", "lamb": "sqrt"}
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


def cell_flags(args, optimizer: str, batch: int, lr: str, scaling: str, extra: list[str]) -> list[str]:
    """run.py's flags for one cell."""
    # run.py refuses --base-batch-size where `keep` would ignore it
    reference = [] if scaling == "keep" else ["--base-batch-size", str(args.ref_batch_size)]
    from_file = ["--config", str(Path(args.config).resolve())] if args.config else []
    return [
        *from_file, "--optimizer", optimizer, "--batch-size", str(batch // args.nproc), "--base-lr", lr,
        "--lr-scaling", scaling, *reference, "--epochs", str(args.epochs), "--warmup-epochs", str(args.warmup_epochs),
        "-n", f"{optimizer}-b{batch}", "--runs-dir", str(Path(args.out) / "cells"), "--no-progress",
        "--resume", "auto", *OPTIMIZER_FLAGS.get(optimizer, []), *extra,
    ]  # fmt: skip


def run_cell(args, optimizer: str, batch: int, lr: str, scaling: str, extra: list[str]) -> Path:
    name = f"{optimizer}-b{batch}"
    run_dir = Path(args.out) / "cells" / name
    if cell_finished(run_dir, args.epochs):
        print(f"{name}: finished before, skipped")
        return run_dir
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(REPO / "run.py"), *cell_flags(args, optimizer, batch, lr, scaling, extra),
    ]  # fmt: skip
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        error, rest = split_error(result.stderr)
        if error:  # run.py's own sentence first, then torchrun's report for whoever needs it
            print(error, file=sys.stderr)
        print("\n".join(rest.splitlines()[-40:]), file=sys.stderr)
        raise SystemExit(f"error: cell {name} failed (exit {result.returncode}); fix it and run the sweep again")
    return run_dir


def summarise(run_dir: Path) -> dict:
    rows = plots.read_metrics(run_dir)
    import json

    config = json.loads((run_dir / "config.json").read_text())
    return {
        "batch": config["global_batch_size"],
        "lr": config["effective_lr"],
        "top1": 100 * rows[-1]["val_acc"],
        "best": 100 * max(r["val_acc"] for r in rows),
        "seconds": sum(r["epoch_seconds"] for r in rows),
    }


def write_results(out: Path, results: dict[str, list[dict]], command: str) -> None:
    lines = ["# Batch-size sweep", "", f"Regenerate: `{command}`", ""]
    for optimizer, cells in results.items():
        lines += [
            f"## {optimizer}",
            "",
            "| Batch | Base LR | top-1 accuracy | time to train |",
            "| --- | --- | --- | --- |",
        ]
        for c in cells:
            lines.append(
                f"| {c['batch']} | {c['lr']:.4g} | {c['top1']:.2f} % (best {c['best']:.2f} %) | {c['seconds']:.1f} s |"
            )
        lines.append("")
    lines.append(
        "Base LR: the LR after scaling for that batch. top-1: final validation accuracy (best epoch in "
        "brackets). Time to train: the sum of the epochs' training times, without start-up or evaluation."
    )
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", required=True, help="global batch sizes")
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "lars"])
    parser.add_argument("--epochs", type=int, default=10, help="epochs per cell (default: 10)")
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="warmup of every cell (default: 2, or half of --epochs when that is shorter)",
    )
    parser.add_argument("--ref-batch-size", type=int, default=32, help="the batch each --base-lr is given for")
    parser.add_argument("--base-lr", nargs="*", default=[], metavar="OPT=LR", help="e.g. sgd=0.05 lars=2")
    parser.add_argument("--lr-scaling", nargs="*", default=[], metavar="OPT=RULE", help="e.g. sgd=linear lars=sqrt")
    parser.add_argument("--nproc", type=int, default=2, help="processes per cell")
    parser.add_argument("--out", required=True, help="the sweep folder")
    parser.add_argument("--config", default=None, metavar="FILE.toml", help="run.py flags for every cell")
    args = parser.parse_args(argv)
    if args.warmup_epochs is None:
        args.warmup_epochs = default_warmup(args.epochs)
    if args.warmup_epochs > args.epochs:
        print(f"error: --warmup-epochs {args.warmup_epochs} exceeds --epochs {args.epochs}", file=sys.stderr)
        return 2
    bad = [b for b in args.batch_sizes if b % args.nproc]
    if bad:
        print(f"error: batch sizes {bad} do not divide by --nproc {args.nproc}", file=sys.stderr)
        return 2
    lrs, scalings = pairs(args.base_lr, DEFAULT_LR), pairs(args.lr_scaling, DEFAULT_SCALING)
    cells = [(optimizer, batch) for optimizer in args.optimizers for batch in sorted(args.batch_sizes)]
    for optimizer, batch in cells:  # a mistake in any cell's flags, before the first cell starts and writes
        try:
            config.parse(cell_flags(args, optimizer, batch, lrs[optimizer], scalings[optimizer], extra))
        except config.UserError as error:
            print(f"error: cell {optimizer}-b{batch}: {error}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict]] = {}
    run_dirs = []
    for optimizer, batch in cells:
        run_dir = run_cell(args, optimizer, batch, lrs[optimizer], scalings[optimizer], extra)
        run_dirs.append(run_dir)
        results.setdefault(optimizer, []).append(summarise(run_dir))
    command = "python tools/sweep.py " + " ".join(argv + (["--", *extra] if extra else []))
    write_results(out, results, command)
    plots.accuracy_vs_batch(results, out / "accuracy_vs_batch.png")
    plots.overlay(run_dirs, out / "curves.png")
    print(f"results: {out / 'results.md'}, {out / 'accuracy_vs_batch.png'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
