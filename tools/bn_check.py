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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ddp_tricks import cli  # noqa: E402
from ddp_tricks.storage import (
    checkpoint,  # noqa: E402
    run_folder,  # noqa: E402
)
from ddp_tricks.training import precise_bn, seam  # noqa: E402


def evaluate(task, model, dataset, batch: int = 1000) -> dict[str, float]:
    """The task's loss and metrics over the dataset (`val_loss`, `val_<metric>`), in eval mode, from its sums."""
    model.eval()
    names, totals = None, None
    with torch.no_grad():
        for start in range(0, len(dataset), batch):
            inputs, targets = dataset[start : start + batch]
            outputs = model(inputs)
            sums = task.metric_sums(outputs, targets) if hasattr(task, "metric_sums") else {}
            names = list(sums)
            row = [float(task.loss(outputs, targets)) * len(targets), *(float(v) for v in sums.values())]
            totals = row if totals is None else [a + b for a, b in zip(totals, row)]
    return seam.report(task, names, "val", totals, float(len(dataset)))


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
        checkpoint.restore_model(model, checkpoint.load(Path(args.checkpoint)), args.checkpoint)
    except cli.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    metric = run_folder.headline({"monitor": run_args.monitor, "task_metrics": run_folder.task_metrics(task)})
    column, scale, unit = metric["column"], metric["scale"], f" {metric['unit']}" if metric["unit"] else ""

    def show(row: dict) -> str:
        return f"loss {row['val_loss']:.4f}, {metric['title']} {scale * row[column]:.2f}{unit}"

    saved, saved_train = evaluate(task, model, val), evaluate(task, model, train)
    limit = min(args.samples, len(train))
    batches = [train[i : min(i + 1000, limit)][0] for i in range(0, limit, 1000)]
    precise_bn.recompute(model, iter(batches), len(batches))
    recomputed, recomputed_train = evaluate(task, model, val), evaluate(task, model, train)
    print(f"{args.checkpoint}: the same weights, evaluated with")
    print(f"  the saved running statistics:      val {show(saved)} (train {show(saved_train)})")
    print(f"  statistics of {sum(len(b) for b in batches)} training samples: val {show(recomputed)} "
          f"(train {show(recomputed_train)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
