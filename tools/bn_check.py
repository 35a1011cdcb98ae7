"""Is it BatchNorm? Evaluate one checkpoint twice, with the same weights: once with the running statistics it
saved, once with statistics recomputed from training samples (precise_bn.py, what --precise-bn does). A large
gap means the running statistics, not the weights, make the validation loss. It shows the loss and the run's
headline metric (the monitored one, or the task's first reported metric where the run monitors its loss).

    python tools/bn_check.py runs/NAME/last.pt -- --config recipes/mnist-large-batch-lars.toml

The flags after `--` are the run's task and data flags (the same as for run.py); one process, on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ddp_tricks import cli
from ddp_tricks.data import loaders
from ddp_tricks.storage import checkpoint, run_folder
from ddp_tricks.training import batches, metric_states, precise_bn


def evaluate(task, model, dataset, collate=None, batch: int = 1000) -> dict[str, float]:
    """The task's loss and metrics over the dataset (`val_loss`, `val_<metric>`), in eval mode, from its sums,
    batched as the template batches it and weighed by the task's units."""
    model.eval()
    layout, totals, units_total = None, None, 0.0
    with torch.no_grad():
        for start in range(0, len(dataset), batch):
            indices = list(range(start, min(start + batch, len(dataset))))
            inputs, targets = loaders.batch_of(dataset, indices, collate)
            outputs = batches.float_outputs(model(inputs))
            sums = task.metric_sums(outputs, targets) if hasattr(task, "metric_sums") else {}
            units = float(task.units(inputs, targets) if hasattr(task, "units") else len(indices))
            layout = metric_states.Layout.of_states(sums)
            row = [
                float(task.loss(outputs, targets)) * units,
                *torch.cat([s.double() for s in layout.flat(sums)] or [torch.zeros(0)]).tolist(),
            ]
            totals = row if totals is None else [a + b for a, b in zip(totals, row)]
            units_total += units
    return metric_states.report(task, layout, "val", totals, units_total)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a last.pt or best.pt")
    parser.add_argument("--samples", type=int, default=8000, help="training samples for the recomputed statistics")
    args = parser.parse_args(argv)
    try:
        run_args, task_class = cli.parse(flags)
        task = task_class(run_args)
        train, val = task.datasets()
        model = task.model()
        checkpoint.restore_model(model, checkpoint.load(Path(args.checkpoint), resumable=False), args.checkpoint)
    except cli.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = Path(args.checkpoint).parent / "config.json"  # the run's own, where the checkpoint sits in its folder
    described = {"monitor": run_args.monitor, "task_metrics": run_folder.task_metrics(task)}
    metric = run_folder.headline(run_folder.read_config(config.parent) if config.is_file() else described)
    column, scale, unit = metric["column"], metric["scale"], f" {metric['unit']}" if metric["unit"] else ""
    if metric["name"] not in ("loss", *run_folder.task_metrics(task)):
        print(
            f"error: the run shows {metric['name']!r}, which this task does not report: give the run's flags after --",
            file=sys.stderr,
        )
        return 2

    def show(row: dict) -> str:
        return f"loss {row['val_loss']:.4f}, {metric['title']} {scale * row[column]:.2f}{unit}"

    collate = getattr(task, "collate", None)
    saved, saved_train = evaluate(task, model, val, collate), evaluate(task, model, train, collate)
    limit = min(args.samples, len(train))
    inputs = [loaders.batch_of(train, list(range(i, min(i + 1000, limit))), collate)[0] for i in range(0, limit, 1000)]
    precise_bn.recompute(model, iter(inputs), len(inputs))
    recomputed, recomputed_train = evaluate(task, model, val, collate), evaluate(task, model, train, collate)
    print(f"{args.checkpoint}: the same weights, evaluated with")
    print(f"  the saved running statistics:      val {show(saved)} (train {show(saved_train)})")
    print(f"  statistics of {limit} training samples: val {show(recomputed)} (train {show(recomputed_train)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
